//! Skills: versioned packages the model may choose from, and the deterministic job builder
//! that turns a skill plus inputs into job.json.
//!
//! A skill package is a folder:
//! - `skill.yaml`: the [`manifest::SkillManifest`] (id, semver, description for the
//!   model, input JSON Schema, allowed commands, network need, limits, sandbox purpose);
//! - `job.json.j2`: the job template (minijinja, JSON auto-escaping);
//! - `examples/*.json`: example inputs, each of which must validate and render.
//!
//! Every job the PM builds carries a `context` it fills from the session and the skill
//! ([`context`]): the objective, the plan step, the template's task and acceptance
//! criteria, preferences and the skill in scope, each bounded.
//!
//! The repository's `skills/` folder is built into the binary ([`builtin`]), so an
//! installed `cynode-pm` works from any directory; `--skill-dir` adds packages or replaces
//! built-in ones by id.

pub mod build;
pub mod builtin;
pub mod context;
pub mod manifest;
pub mod registry;
pub mod template;

pub use build::{build_job, build_job_in, job_id, BuildError, BuiltJob, JobRef};
pub use context::Brief;
pub use manifest::SkillManifest;
pub use registry::{Registry, Skill, SkillError};
