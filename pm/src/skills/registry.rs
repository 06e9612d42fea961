//! The skill registry: every skill package found in the skill directories, validated on
//! load, listable with its schema for the model.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;

use super::manifest::SkillManifest;
use super::template::TemplateError;

/// One loaded skill package.
#[derive(Debug, Clone)]
pub struct Skill {
    pub manifest: SkillManifest,
    pub template: String,
    pub dir: PathBuf,
    /// `(file name, inputs)` from `examples/`.
    pub examples: Vec<(String, Value)>,
}

/// A problem with a skill package, located as `file:line: message` where known.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{}: {message}", file.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
pub struct SkillError {
    pub file: PathBuf,
    pub line: Option<usize>,
    pub message: String,
}

impl SkillError {
    fn new(file: &Path, line: Option<usize>, message: impl Into<String>) -> Self {
        Self {
            file: file.to_path_buf(),
            line,
            message: message.into(),
        }
    }
}

/// What the model is shown of a skill.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CatalogEntry {
    pub skill_id: String,
    pub version: String,
    pub description: String,
    pub inputs_schema: Value,
    /// The manifest's `first_look` (not shown to the model: the turn rules use it).
    #[serde(skip)]
    pub first_look: bool,
}

/// All skills, by id.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    skills: BTreeMap<String, Skill>,
}

/// Names of the files of a skill package.
pub const MANIFEST_FILE: &str = "skill.yaml";
pub const TEMPLATE_FILE: &str = "job.json.j2";
pub const EXAMPLES_DIR: &str = "examples";

impl Registry {
    /// Loads every package under each directory (a directory that is itself a package
    /// counts too). Returns every problem found, not just the first.
    pub fn load(dirs: &[PathBuf]) -> Result<Registry, Vec<SkillError>> {
        let mut errors = Vec::new();
        let packages: Vec<PathBuf> = dirs
            .iter()
            .flat_map(|d| package_dirs(d, &mut errors))
            .collect();
        let reg = Registry::from_packages(packages.iter().map(|p| load_package(p)));
        match (reg, errors.is_empty()) {
            (Ok(reg), true) => Ok(reg),
            (Ok(_), false) => Err(errors),
            (Err(mut e), _) => {
                errors.append(&mut e);
                Err(errors)
            }
        }
    }

    /// A registry of loaded packages; two with one id are an error.
    pub fn from_packages(
        packages: impl IntoIterator<Item = Result<Skill, Vec<SkillError>>>,
    ) -> Result<Registry, Vec<SkillError>> {
        let mut reg = Registry::default();
        let mut errors = Vec::new();
        for package in packages {
            match package {
                Ok(skill) => {
                    let id = skill.manifest.skill_id.clone();
                    if let Some(prev) = reg.skills.get(&id) {
                        errors.push(SkillError::new(
                            &skill.dir.join(MANIFEST_FILE),
                            None,
                            format!("duplicate skill_id `{id}` (also in {})", prev.dir.display()),
                        ));
                    } else {
                        reg.skills.insert(id, skill);
                    }
                }
                Err(mut e) => errors.append(&mut e),
            }
        }
        if errors.is_empty() {
            Ok(reg)
        } else {
            Err(errors)
        }
    }

    /// Puts `other`'s skills on top: a skill of `other` is added, or replaces the one with
    /// its id.
    pub fn overlay(&mut self, other: Registry) {
        self.skills.extend(other.skills);
    }

    /// The skill with `id`.
    pub fn get(&self, id: &str) -> Option<&Skill> {
        self.skills.get(id)
    }

    /// All skills in id order.
    pub fn iter(&self) -> impl Iterator<Item = &Skill> {
        self.skills.values()
    }

    /// Number of skills.
    pub fn len(&self) -> usize {
        self.skills.len()
    }

    /// True when no skill is loaded.
    pub fn is_empty(&self) -> bool {
        self.skills.is_empty()
    }

    /// What the model is offered: id, version, description, input schema.
    pub fn catalog(&self) -> Vec<CatalogEntry> {
        self.catalog_of(|_| true)
    }

    /// The catalog of the skills `keep` accepts.
    pub fn catalog_of(&self, keep: impl Fn(&Skill) -> bool) -> Vec<CatalogEntry> {
        self.iter()
            .filter(|s| keep(s))
            .map(|s| CatalogEntry {
                skill_id: s.manifest.skill_id.clone(),
                version: s.manifest.version.clone(),
                description: s.manifest.description.clone(),
                inputs_schema: s.manifest.inputs_schema.clone(),
                first_look: s.manifest.first_look,
            })
            .collect()
    }
}

fn package_dirs(dir: &Path, errors: &mut Vec<SkillError>) -> Vec<PathBuf> {
    if dir.join(MANIFEST_FILE).is_file() {
        return vec![dir.to_path_buf()];
    }
    let Ok(rd) = std::fs::read_dir(dir) else {
        errors.push(SkillError::new(dir, None, "not a readable skill directory"));
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join(MANIFEST_FILE).is_file())
        .collect();
    out.sort();
    out
}

/// Where a package's files come from: a folder on disk, or the copy built into the binary.
pub trait PackageFiles {
    /// The package's location, for messages and `Skill::dir`.
    fn dir(&self) -> PathBuf;
    /// The text of the file `name` of the package.
    fn read(&self, name: &str) -> std::io::Result<String>;
    /// `(file name, text)` of every `examples/*.json`, sorted by name.
    fn examples(&self) -> Vec<(String, std::io::Result<String>)>;
}

/// A package folder on disk.
struct DiskPackage<'a>(&'a Path);

impl PackageFiles for DiskPackage<'_> {
    fn dir(&self) -> PathBuf {
        self.0.to_path_buf()
    }

    fn read(&self, name: &str) -> std::io::Result<String> {
        std::fs::read_to_string(self.0.join(name))
    }

    fn examples(&self) -> Vec<(String, std::io::Result<String>)> {
        let Ok(rd) = std::fs::read_dir(self.0.join(EXAMPLES_DIR)) else {
            return Vec::new();
        };
        let mut files: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        files
            .into_iter()
            .map(|f| {
                let name = f
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                (name, std::fs::read_to_string(&f))
            })
            .collect()
    }
}

/// Loads and checks one package folder: manifest, schema, template syntax, examples' shape.
pub fn load_package(dir: &Path) -> Result<Skill, Vec<SkillError>> {
    load_files(&DiskPackage(dir))
}

/// Loads and checks one package from `files`.
pub fn load_files(files: &dyn PackageFiles) -> Result<Skill, Vec<SkillError>> {
    let dir = files.dir();
    let dir = dir.as_path();
    let mut errors = Vec::new();
    let mpath = dir.join(MANIFEST_FILE);
    let manifest: Option<SkillManifest> = match files.read(MANIFEST_FILE) {
        Ok(text) => match serde_yaml::from_str::<SkillManifest>(&text) {
            Ok(m) => Some(m),
            Err(e) => {
                errors.push(SkillError::new(
                    &mpath,
                    e.location().map(|l| l.line()),
                    strip_location(&e.to_string()),
                ));
                None
            }
        },
        Err(e) => {
            errors.push(SkillError::new(&mpath, None, format!("cannot read: {e}")));
            None
        }
    };
    let manifest_text = files.read(MANIFEST_FILE).unwrap_or_default();
    if let Some(m) = &manifest {
        if let Err(e) = m.check() {
            // The message opens with the field it is about.
            let field = e.0.split([' ', ':', '.']).next().unwrap_or_default();
            errors.push(SkillError::new(
                &mpath,
                key_line(&manifest_text, field),
                e.to_string(),
            ));
        }
        if let Some((pointer, message)) = schema_problem(&m.inputs_schema) {
            errors.push(SkillError::new(
                &mpath,
                key_line(&manifest_text, "inputs_schema"),
                format!("inputs_schema{pointer} is not a valid JSON Schema: {message}"),
            ));
        }
        let expected = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !expected.is_empty() && expected != m.skill_id {
            errors.push(SkillError::new(
                &mpath,
                None,
                format!(
                    "skill_id `{}` differs from its folder name `{expected}`",
                    m.skill_id
                ),
            ));
        }
    }
    let tpath = dir.join(TEMPLATE_FILE);
    let template = match files.read(TEMPLATE_FILE) {
        Ok(t) => {
            if let Err(e) = super::template::check_escaping(&t) {
                let line = match &e {
                    TemplateError::Unescaped { line, .. } => Some(*line),
                    _ => None,
                };
                errors.push(SkillError::new(&tpath, line, e.to_string()));
            }
            let mut env = super::template::environment();
            match env.add_template("job", &t) {
                Err(e) => errors.push(SkillError::new(&tpath, e.line(), e.to_string())),
                Ok(()) => {
                    if let (Ok(tmpl), Some(m)) = (env.get_template("job"), &manifest) {
                        for (line, message) in undeclared(&t, &tmpl, &m.inputs_schema) {
                            errors.push(SkillError::new(&tpath, line, message));
                        }
                    }
                }
            }
            t
        }
        Err(e) => {
            errors.push(SkillError::new(&tpath, None, format!("cannot read: {e}")));
            String::new()
        }
    };
    let mut examples = Vec::new();
    let edir = dir.join(EXAMPLES_DIR);
    for (name, text) in files.examples() {
        match text.map_err(|e| e.to_string()).and_then(|t| {
            serde_json::from_str::<Value>(&t).map_err(|e| format!("line {}: {e}", e.line()))
        }) {
            Ok(v) => examples.push((name, v)),
            Err(msg) => errors.push(SkillError::new(&edir.join(&name), None, msg)),
        }
    }
    if examples.is_empty() {
        errors.push(SkillError::new(
            &edir,
            None,
            "a skill needs at least one example input",
        ));
    }
    match (manifest, errors.is_empty()) {
        (Some(manifest), true) => Ok(Skill {
            manifest,
            template,
            dir: dir.to_path_buf(),
            examples,
        }),
        _ => Err(errors),
    }
}

/// The variables `tmpl` reads that its render context does not give: a top-level name
/// other than `inputs`, `job` and `skill`, an `inputs.X` whose `X` the input schema's
/// `properties` do not declare, a `job.X` or `skill.X` the PM does not set. Each with the
/// first line of `source` that names it.
fn undeclared(
    source: &str,
    tmpl: &minijinja::Template<'_, '_>,
    inputs_schema: &Value,
) -> Vec<(Option<usize>, String)> {
    const JOB: &[&str] = &["job_id", "task_id", "session_id", "attempt"];
    const SKILL: &[&str] = &["skill_id", "version", "limits"];
    let declared = inputs_schema.get("properties").and_then(Value::as_object);
    let mut used: Vec<String> = tmpl.undeclared_variables(true).into_iter().collect();
    used.sort();
    let mut out = Vec::new();
    for name in used {
        let mut parts = name.splitn(3, '.');
        let (root, field) = (parts.next().unwrap_or_default(), parts.next());
        let problem = match (root, field) {
            ("inputs", Some(f)) if declared.is_some_and(|d| !d.contains_key(f)) => Some(format!(
                "`{root}.{f}` is not declared in inputs_schema.properties (declared: {})",
                declared
                    .map(|d| d.keys().cloned().collect::<Vec<_>>().join(", "))
                    .unwrap_or_default()
            )),
            ("job", Some(f)) if !JOB.contains(&f) => Some(format!(
                "`job.{f}` is not set by the PM (it sets job.{})",
                JOB.join(", job.")
            )),
            ("skill", Some(f)) if !SKILL.contains(&f) => Some(format!(
                "`skill.{f}` is not set by the PM (it sets skill.{})",
                SKILL.join(", skill.")
            )),
            ("inputs" | "job" | "skill", _) => None,
            _ => Some(format!(
                "`{root}` is not defined: a template reads inputs, job and skill"
            )),
        };
        if let Some(message) = problem {
            let needle = match field {
                Some(f) if root != "inputs" || declared.is_some() => format!("{root}.{f}"),
                _ => root.to_string(),
            };
            let line = source
                .lines()
                .position(|l| l.contains(&needle))
                .map(|i| i + 1);
            out.push((line, message));
        }
    }
    out
}

/// The first problem of an input schema, as (JSON pointer into the schema, message): a
/// keyword the meta-schema refuses, else one the validator cannot compile though the
/// meta-schema accepts it (a `pattern` that is no regex: the meta-schema only says it is
/// a string). Either is the manifest's problem, found before any example runs into it.
fn schema_problem(schema: &Value) -> Option<(String, String)> {
    if let Err(e) = jsonschema::meta::validate(schema) {
        return Some((e.instance_path().to_string(), e.to_string()));
    }
    let e = jsonschema::validator_for(schema).err()?;
    // A compile error's schema path is where in the schema it is.
    let pointer = e.schema_path().to_string();
    let message = match e.kind() {
        jsonschema::error::ValidationErrorKind::Format { format } if format == "regex" => {
            format!("invalid regex {}", e.instance())
        }
        _ => e.to_string(),
    };
    Some((pointer, message))
}

/// The 1-based line of the top-level `key:` in a YAML document, when it has one.
fn key_line(yaml: &str, key: &str) -> Option<usize> {
    if key.is_empty() {
        return None;
    }
    yaml.lines()
        .position(|l| {
            l.strip_prefix(key)
                .is_some_and(|rest| rest.trim_start().starts_with(':'))
        })
        .map(|i| i + 1)
}

/// serde_yaml appends " at line L column C"; the location is printed as `file:line`.
fn strip_location(msg: &str) -> String {
    match msg.find(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg.to_string(),
    }
}
