//! The built-in skills: the repository's `skills/` folder, embedded in the binary at build
//! time, so that an installed `cynode-pm` has them in any working directory.

use std::path::PathBuf;

use include_dir::{include_dir, Dir};

use super::registry::{load_files, PackageFiles, Registry, SkillError, EXAMPLES_DIR};

static SKILLS: Dir<'static> = include_dir!("$CARGO_MANIFEST_DIR/../skills");

/// How a built-in package is named in messages and in `Skill::dir`.
pub const PREFIX: &str = "builtin:skills";

/// One embedded package folder.
struct Embedded<'a>(&'a Dir<'a>);

impl PackageFiles for Embedded<'_> {
    fn dir(&self) -> PathBuf {
        PathBuf::from(PREFIX).join(self.0.path())
    }

    fn read(&self, name: &str) -> std::io::Result<String> {
        self.0
            .get_file(self.0.path().join(name))
            .and_then(|f| f.contents_utf8())
            .map(str::to_string)
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("{name} is not in the built-in package"),
                )
            })
    }

    fn examples(&self) -> Vec<(String, std::io::Result<String>)> {
        let Some(dir) = self.0.get_dir(self.0.path().join(EXAMPLES_DIR)) else {
            return Vec::new();
        };
        let mut out: Vec<(String, std::io::Result<String>)> = dir
            .files()
            .filter(|f| f.path().extension().is_some_and(|x| x == "json"))
            .map(|f| {
                let name = f
                    .path()
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let text = f.contents_utf8().map(str::to_string).ok_or_else(|| {
                    std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8")
                });
                (name, text)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

/// Every built-in skill, checked as a package on disk would be.
pub fn registry() -> Result<Registry, Vec<SkillError>> {
    let mut packages: Vec<&Dir<'static>> = SKILLS.dirs().collect();
    packages.sort_by_key(|d| d.path());
    Registry::from_packages(packages.into_iter().map(|d| load_files(&Embedded(d))))
}

impl Registry {
    /// The built-in skills (embedded in the binary) with the packages under `dirs` on top:
    /// a package of `dirs` adds a skill, or replaces the built-in one with its id. Two
    /// packages of `dirs` with one id are still an error.
    pub fn builtin_with(dirs: &[PathBuf]) -> Result<Registry, Vec<SkillError>> {
        let mut reg = registry()?;
        reg.overlay(Registry::load(dirs)?);
        Ok(reg)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_built_in_skills_are_the_repository_folder() {
        let reg = registry().unwrap();
        let mut on_disk: Vec<String> =
            std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../skills"))
                .unwrap()
                .flatten()
                .filter(|e| e.path().join("skill.yaml").is_file())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
        on_disk.sort();
        let built_in: Vec<String> = reg.iter().map(|s| s.manifest.skill_id.clone()).collect();
        assert_eq!(built_in, on_disk);
        let disk = Registry::load(&[PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../skills"
        ))])
        .unwrap();
        for s in reg.iter() {
            let d = disk.get(&s.manifest.skill_id).unwrap();
            assert_eq!(
                (&s.template, &s.examples, s.dir.starts_with(PREFIX)),
                (&d.template, &d.examples, true)
            );
        }
    }
}
