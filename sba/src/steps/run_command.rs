//! `run_command`: argv only, no shell, confined working directory, explicit environment,
//! deadline and output cap enforced by [`crate::process`].

use std::path::Path;
use std::time::{Duration, Instant};

use cynode_protocol::job::RunCommandArgs;
use cynode_protocol::result::{RunCommandOutput, StepOutput};
use cynode_protocol::FailureCode;
use rustix::fs::{Mode, OFlags};

use super::{Outcome, StepContext};
use crate::capture::split_budget;
use crate::error::{describe_io, StepError};
use crate::process;

/// Stderr phrases that mean "this needed a network it did not have".
const NETWORK_HINTS: [&str; 6] = [
    "could not resolve host",
    "temporary failure in name resolution",
    "network is unreachable",
    "name or service not known",
    "could not resolve hostname",
    "failed to lookup address",
];

/// Runs the step.
pub fn run(ctx: &StepContext<'_>, args: &RunCommandArgs) -> Outcome {
    match prepare(ctx, args) {
        Ok((program, cwd, env, deadline)) => launch(ctx, args, &program, &cwd, env, deadline),
        Err(e) => Err(e).into(),
    }
}

type Prepared = (String, std::os::fd::OwnedFd, Vec<(String, String)>, Instant);

/// Applies `allowed_commands`. A command with a `/` must equal an entry exactly. A bare
/// name must be an entry and is resolved here against the runner's PATH, never the step's
/// (a step could otherwise put a workspace script named like an allowed tool first on its
/// PATH). Without an allowlist the command is passed through unchanged.
fn resolve_program(ctx: &StepContext<'_>, command: &str) -> Result<String, StepError> {
    let Some(allowed) = &ctx.job.constraints.allowed_commands else {
        return Ok(command.to_string());
    };
    let refuse = || {
        StepError::policy(format!(
            "command `{command}` is not in constraints.allowed_commands"
        ))
    };
    if !allowed.iter().any(|a| a == command) {
        return Err(refuse());
    }
    if command.contains('/') {
        return Ok(command.to_string());
    }
    let path = ctx
        .base_env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_str())
        .unwrap_or_default();
    path.split(':')
        .filter(|dir| dir.starts_with('/'))
        .map(|dir| Path::new(dir).join(command))
        .find(|p| is_executable(p))
        .map(|p| p.display().to_string())
        .ok_or_else(|| {
            StepError::new(
                FailureCode::ExecutionFailure,
                format!("cannot start `{command}`: not found on the runner's PATH"),
            )
        })
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn prepare(ctx: &StepContext<'_>, args: &RunCommandArgs) -> Result<Prepared, StepError> {
    let rel = ctx.path(args.working_dir.as_deref().unwrap_or(""))?;
    let cwd = ctx
        .ws
        .open_at(&rel, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())?;
    let mut env: Vec<(String, String)> = ctx.base_env.to_vec();
    for (k, v) in &args.env {
        if k.starts_with("CYNODE_") {
            return Err(StepError::policy(format!("env may not override {k}")));
        }
        env.retain(|(existing, _)| existing != k);
        env.push((k.clone(), v.clone()));
    }
    let deadline = match args.timeout_seconds {
        Some(s) => ctx.deadline.min(Instant::now() + Duration::from_secs(s)),
        None => ctx.deadline,
    };
    let program = resolve_program(ctx, &args.command)?;
    Ok((program, cwd, env, deadline))
}

fn launch(
    ctx: &StepContext<'_>,
    args: &RunCommandArgs,
    program: &str,
    cwd: &std::os::fd::OwnedFd,
    env: Vec<(String, String)>,
    deadline: Instant,
) -> Outcome {
    use std::os::fd::AsFd;
    let cap = ctx.output_cap();
    let spec = process::Spec {
        program,
        args: &args.args,
        env,
        cwd: cwd.as_fd(),
        stdin: args.stdin.as_deref().map(str::as_bytes),
        deadline,
        cap,
        interrupt: ctx.interrupt,
    };
    let out = match process::run(spec) {
        Ok(out) => out,
        Err(e) => {
            let code = match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::ENOMEM) => FailureCode::ResourceLimitExceeded,
                _ => FailureCode::ExecutionFailure,
            };
            return Err(StepError::new(
                code,
                format!("cannot start `{}`: {}", args.command, describe_io(&e)),
            ))
            .into();
        }
    };
    let (b_out, b_err, truncated) = split_budget(out.stdout.total(), out.stderr.total(), cap);
    let output = RunCommandOutput {
        exit_code: out.exit_code,
        signal: out.signal,
        stdout: out.stdout.render(b_out),
        stderr: out.stderr.render(b_err),
        duration_ms: out.duration.as_millis() as u64,
        truncated,
    };
    let error = classify(ctx, args, &out, &output, deadline);
    Outcome {
        output: Some(StepOutput::RunCommand(output)),
        error,
    }
}

/// Turns how the process ended into the step's error, most fundamental cause first.
fn classify(
    ctx: &StepContext<'_>,
    args: &RunCommandArgs,
    out: &process::Outcome,
    output: &RunCommandOutput,
    deadline: Instant,
) -> Option<StepError> {
    let cmd = &args.command;
    if out.timed_out {
        if deadline < ctx.deadline {
            return Some(StepError::new(
                FailureCode::Timeout,
                format!(
                    "command `{cmd}` exceeded its timeout_seconds of {}s",
                    args.timeout_seconds.unwrap_or_default()
                ),
            ));
        }
        return Some(ctx.deadline_error());
    }
    if out.interrupted {
        return Some(StepError::internal("runner interrupted by SIGTERM"));
    }
    if output.truncated {
        return Some(StepError::new(
            FailureCode::ConstraintViolation,
            format!(
                "output of `{cmd}` exceeded max_output_bytes: {} bytes produced, cap {}",
                out.stdout.total() + out.stderr.total(),
                ctx.job.constraints.max_output_bytes
            ),
        ));
    }
    if let Some(sig) = out.signal {
        if sig == libc::SIGKILL {
            return Some(StepError::new(
                FailureCode::ResourceLimitExceeded,
                format!("command `{cmd}` was killed by SIGKILL (out of memory or a limit)"),
            ));
        }
        return Some(StepError::failed(format!(
            "command `{cmd}` was killed by signal {sig}"
        )));
    }
    match out.exit_code {
        Some(0) => None,
        Some(code) => {
            let stderr = output.stderr.to_lowercase();
            if !ctx.job.constraints.ext_net_allowed
                && NETWORK_HINTS.iter().any(|h| stderr.contains(h))
            {
                return Some(StepError::new(
                    FailureCode::ExtNetRequired,
                    format!(
                        "command `{cmd}` exited with status {code} after a network lookup failed; \
                         the job does not allow external network (constraints.ext_net_allowed)"
                    ),
                ));
            }
            Some(StepError::failed(format!(
                "command `{cmd}` exited with status {code}"
            )))
        }
        None => Some(StepError::internal(format!(
            "command `{cmd}` ended without a status"
        ))),
    }
}
