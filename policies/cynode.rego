# CyNode default policy: decides whether a rendered job.json may be dispatched.
#
# Evaluated in-process by cynode-pm (regorus) or by an external OPA server
# (`cynode-pm --policy-endpoint URL`, query `POST /v1/data/cynode/policy`).
#
# input = {
#   "job":    the rendered job.json (design.md §3.1),
#   "skill":  the skill manifest (skill_id, purpose, allowed_commands, network, limits, …),
#   "tenant": the tenant policy (allow_network, allowed_purposes, allowed_images,
#             global_allowed_commands, max_runtime_seconds, max_output_bytes,
#             egress {allow})
# }
#
# Output: `deny` and `warn`, sets of {"rule": …, "message": …}. Any deny blocks the job
# (unless the gate runs in dry-run mode); warn never does. Messages are lowercase and
# name the step id and the offending value (secret values are never echoed).
# See policies/README.md for the rule list.
#
# Speed matters (the gate runs on every job; target p50 well under 1 ms). Builtin and
# function calls dominate the cost, so per-item work uses references and operators,
# messages are only formatted for actual violations, and a single regex screens what
# would otherwise take several tests.
package cynode.policy

import rego.v1

# ---------------------------------------------------------------------------
# Input views. A missing or mistyped section reads as empty, which makes the checks
# that need it deny (e.g. no manifest = no allowed commands), never silently pass.
# ---------------------------------------------------------------------------

default job := {}

job := input.job if is_object(input.job)

default skill := {}

skill := input.skill if is_object(input.skill)

default tenant := {}

tenant := input.tenant if is_object(input.tenant)

default constraints := {}

constraints := job.constraints if is_object(job.constraints)

default steps := []

steps := job.steps if is_array(job.steps)

skill_name := sprintf("`%s`", [skill.skill_id]) if {
	is_string(skill.skill_id)
} else := "(unnamed skill)"

# A step the rules below could not see (no id, no arguments object, a run_command
# without a command) is denied outright, so nothing slips past by being malformed.
deny contains {"rule": "step_malformed", "message": msg} if {
	some i, step in steps
	not step_well_formed(step)
	msg := sprintf("steps[%d]: needs an id, a type and an arguments object", [i])
}

step_well_formed(step) if {
	step.id
	step.type
	is_object(step.arguments)
}

deny contains {"rule": "step_malformed", "message": msg} if {
	some step in steps
	step.type == "run_command"
	not step.arguments.command
	msg := sprintf("step %v: run_command needs a command", [step.id])
}

# Type guards. A builtin called with the wrong type fails the whole evaluation (the
# gate runs with strict builtin errors and then denies with policy_evaluation_failed;
# OPA by default would instead make the rule body fail and silently drop a denial), so
# a mistyped run_command is denied here and kept out of run_steps, which every rule
# below reads: their builtins only ever see the types checked here.
deny contains {"rule": "step_malformed", "message": msg} if {
	some step in steps
	step.type == "run_command"
	_ = step.arguments.command
	not run_arguments_well_typed(step.arguments)
	msg := sprintf(
		"step %v: run_command needs a string command, string args, string env values and a numeric timeout_seconds",
		[step.id],
	)
}

run_arguments_well_typed(a) if {
	is_string(a.command)
	args := object.get(a, "args", [])
	is_array(args)
	every x in args {
		is_string(x)
	}
	env := object.get(a, "env", {})
	is_object(env)
	every x in env {
		is_string(x)
	}
	is_number(object.get(a, "timeout_seconds", 0))
}

deny contains {"rule": "step_malformed", "message": msg} if {
	some step in steps
	step.type == "apply_unified_diff"
	not is_string(step.arguments.diff)
	msg := sprintf("step %v: apply_unified_diff needs a string diff", [step.id])
}

# Every well-typed run_command step as {"id", "args", "command"} (a mistyped one is
# denied as step_malformed above).
run_steps := [{"id": step.id, "args": step.arguments, "command": step.arguments.command} |
	some step in steps
	step.type == "run_command"
	run_arguments_well_typed(step.arguments)
]

basename(path) := parts[count(parts) - 1] if parts := split(path, "/")

# ---------------------------------------------------------------------------
# Commands: allowed by the skill or globally by the tenant, and by the job's own
# constraints.allowed_commands when it carries one. An entry matches the command
# itself or its basename (`go` allows `/usr/local/go/bin/go`).
# ---------------------------------------------------------------------------

permitted_commands := {c | some c in skill.allowed_commands} | {c | some c in tenant.global_allowed_commands}

deny contains {"rule": "command_not_allowed", "message": msg} if {
	some s in run_steps
	not s.command in permitted_commands
	not basename(s.command) in permitted_commands
	msg := sprintf(
		"step %v: command `%v` is not allowed by skill %s or the tenant's global_allowed_commands",
		[s.id, s.command, skill_name],
	)
}

job_allowed_commands := {c | some c in constraints.allowed_commands}

deny contains {"rule": "command_not_in_job_allowlist", "message": msg} if {
	constraints.allowed_commands
	some s in run_steps
	not s.command in job_allowed_commands
	not basename(s.command) in job_allowed_commands
	msg := sprintf("step %v: command `%v` is not in constraints.allowed_commands", [s.id, s.command])
}

# ---------------------------------------------------------------------------
# Paths: relative, or absolute under /workspace; no `..` component; no NUL byte.
# Checked: step paths and working_dir, constraints.allowed_paths, artifact globs and
# the file names in apply_unified_diff headers. `where` is a sprintf format and its
# arguments, formatted only when a path is denied.
# ---------------------------------------------------------------------------

# BEGIN generated from protocol/src/job/step_defs.rs (CYNODE_REGENERATE_POLICY=1)
path_fields := {
	"write_file": "path",
	"read_file": "path",
	"run_command": "working_dir",
	"list_tree": "path",
	"search_files": "path",
}
# END generated

checked_paths contains {"where": ["step %v: %s", [step.id, field]], "path": p} if {
	some step in steps
	field := path_fields[step.type]
	p := step.arguments[field]
}

checked_paths contains {"where": ["constraints.allowed_paths[%d]", [i]], "path": p} if {
	some i, p in constraints.allowed_paths
}

checked_paths contains {"where": ["artifacts[%d]", [i]], "path": p} if {
	some i, p in job.artifacts
}

# `--- a/x` / `+++ b/x` lines: the name up to a tab, without the a/ or b/ prefix.
checked_paths contains {"where": ["step %v: diff header", [step.id]], "path": p} if {
	some step in steps
	step.type == "apply_unified_diff"
	diff := step.arguments.diff
	is_string(diff)
	some line in regex.find_n(`(?m)^(?:---|\+\+\+) [^\t\n]*`, diff, -1)
	name := trim_space(substring(line, 4, -1))
	name != "/dev/null"
	p := trim_diff_prefix(name)
}

trim_diff_prefix(name) := substring(name, 2, -1) if {
	startswith(name, "a/")
} else := substring(name, 2, -1) if {
	startswith(name, "b/")
} else := name

where(c) := sprintf(c.where[0], c.where[1])

deny contains {"rule": "path_invalid", "message": msg} if {
	some c in checked_paths
	not is_string(c.path)
	msg := sprintf("%s: path must be a string, got %s", [where(c), type_name(c.path)])
}

# Paths with a NUL byte or a `..` somewhere: cheap substring tests screen every path.
suspect_paths contains c if {
	some c in checked_paths
	is_string(c.path)
	contains(c.path, "..")
}

suspect_paths contains c if {
	some c in checked_paths
	is_string(c.path)
	contains(c.path, "\u0000")
}

deny contains {"rule": "path_nul_byte", "message": msg} if {
	some c in suspect_paths
	contains(c.path, "\u0000")
	msg := sprintf("%s: path contains a nul byte", [where(c)])
}

deny contains {"rule": "path_traversal", "message": msg} if {
	some c in suspect_paths
	".." in split(c.path, "/")
	not contains(c.path, "\u0000")
	msg := sprintf("%s: path `%s` has a `..` component", [where(c), c.path])
}

deny contains {"rule": "path_outside_workspace", "message": msg} if {
	some c in checked_paths
	is_string(c.path)
	startswith(c.path, "/")
	c.path != "/workspace"
	not startswith(c.path, "/workspace/")
	not contains(c.path, "\u0000")
	msg := sprintf("%s: absolute path `%s` is outside /workspace", [where(c), c.path])
}

# ---------------------------------------------------------------------------
# Network: only when the skill declares it AND the tenant allows it.
# ---------------------------------------------------------------------------

job_wants_network if constraints.ext_net_allowed == true

job_wants_network if constraints.network_allowed == true

deny contains {"rule": "network_not_declared", "message": msg} if {
	job_wants_network
	not skill.network == true
	msg := sprintf("constraints.ext_net_allowed is true but skill %s does not declare network", [skill_name])
}

tenant_allows_network if tenant.allow_network == true

tenant_allows_network if count(object.get(object.get(tenant, "egress", {}), "allow", [])) > 0

deny contains {"rule": "network_not_allowed", "message": msg} if {
	job_wants_network
	not tenant_allows_network
	msg := sprintf("constraints.ext_net_allowed is true but tenant `%v` does not allow network", [object.get(tenant, "tenant_id", "")])
}

# Egress: a job with network reaches only the skill's declared `egress` destinations (the
# worker's proxy enforces them); each must be within the tenant's `egress.allow`: listed
# as is, or under one of its `*.suffix` patterns.

tenant_egress := object.get(object.get(tenant, "egress", {}), "allow", [])

egress_covered(dest) if {
	some p in tenant_egress
	p == dest
}

egress_covered(dest) if {
	some p in tenant_egress
	startswith(p, "*.")
	endswith(dest, substring(p, 1, -1))
}

deny contains {"rule": "egress_not_allowed", "message": msg} if {
	job_wants_network
	some dest in object.get(skill, "egress", [])
	not egress_covered(dest)
	msg := sprintf("skill %s needs egress to `%v`, which tenant `%v` does not allow (its egress.allow: %v)", [skill_name, dest, object.get(tenant, "tenant_id", ""), concat(", ", tenant_egress)])
}

# ---------------------------------------------------------------------------
# Limits: the job's ceilings may not exceed the skill's limits nor the tenant's
# ceilings; a step timeout may not exceed the job's deadline.
# ---------------------------------------------------------------------------

limit_rules := {"max_runtime_seconds": "runtime_ceiling", "max_output_bytes": "output_ceiling"}

ceilings contains {"field": f, "owner": "skill", "limit": skill.limits[f]} if some f, _ in limit_rules

ceilings contains {"field": f, "owner": "tenant", "limit": tenant[f]} if some f, _ in limit_rules

owner_name(c) := sprintf("skill %s", [skill_name]) if c.owner == "skill"

owner_name(c) := "tenant" if c.owner == "tenant"

deny contains {"rule": "limits_missing", "message": msg} if {
	some f, _ in limit_rules
	not valid_limit(constraints[f])
	msg := sprintf("constraints.%s must be a positive number", [f])
}

valid_limit(v) if {
	v > 0
	is_number(v)
}

deny contains {"rule": limit_rules[c.field], "message": msg} if {
	some c in ceilings
	v := constraints[c.field]
	v > c.limit
	is_number(v)
	is_number(c.limit)
	msg := sprintf("constraints.%s %v exceeds the %s ceiling of %v", [c.field, v, owner_name(c), c.limit])
}

deny contains {"rule": "step_timeout_ceiling", "message": msg} if {
	some s in run_steps
	t := s.args.timeout_seconds
	job_max := constraints.max_runtime_seconds
	t > job_max
	is_number(t)
	valid_limit(job_max)
	msg := sprintf(
		"step %v: timeout_seconds %v exceeds constraints.max_runtime_seconds %v",
		[s.id, t, job_max],
	)
}

# ---------------------------------------------------------------------------
# Secrets: run_command env must not carry credentials. The message names the
# variable and the kind of secret, never its value.
# ---------------------------------------------------------------------------

secret_name_pattern := `TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|PRIVATE_KEY`

secret_value_shapes := {
	"a github token": `(?:^|[^A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{16,}|github_pat_[A-Za-z0-9_]{16,})`,
	"an openai-style api key": `(?:^|[^A-Za-z0-9_-])sk-[A-Za-z0-9_-]{16,}`,
	"an aws access key id": `(?:^|[^A-Z0-9])AKIA[0-9A-Z]{16}(?:[^A-Z0-9]|$)`,
	"a slack token": `(?:^|[^A-Za-z0-9])xox[bp]-[A-Za-z0-9-]{8,}`,
	"a pem private key or certificate": `-----BEGIN`,
	"a jwt": `(?:^|[^A-Za-z0-9_-])eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+`,
}

# The alternation of all the shapes above: one match screens a value, and only a value
# that matches is tested shape by shape to name the kind. (tests cover every shape)
any_secret_value := concat("|", [p | some p in secret_value_shapes])

env_entries contains {"id": s.id, "name": name, "value": value} if {
	some s in run_steps
	some name, value in s.args.env
}

deny contains {"rule": "secret_env_name", "message": msg} if {
	some e in env_entries
	e.value != ""
	name := upper(e.name)
	regex.match(secret_name_pattern, name)
	marker := regex.find_n(secret_name_pattern, name, 1)[0]
	msg := sprintf("step %v: env `%s` looks like a secret (name contains %s); secrets never go into jobs", [e.id, e.name, lower(marker)])
}

deny contains {"rule": "secret_env_value", "message": msg} if {
	some e in env_entries
	is_string(e.value)
	regex.match(any_secret_value, e.value)
	some kind, pattern in secret_value_shapes
	regex.match(pattern, e.value)
	msg := sprintf("step %v: env `%s` has a value that looks like %s; secrets never go into jobs", [e.id, e.name, kind])
}

# The job's context (the objective, the plan step, the task and its criteria) reaches
# the sandbox's agent and its model: a credential in it would too. The message names the
# field, never the value.
default context := {}

context := job.context if is_object(job.context)

# Every string of the context down to three levels (`task_context`,
# `acceptance_criteria[0]`, `preferences.style`, `skills.<id>.description`), with its path.
context_strings contains {"field": k, "value": v} if {
	some k, v in context
	is_string(v)
}

context_strings contains {"field": sprintf("%v[%v]", [k, i]), "value": v} if {
	some k, items in context
	is_array(items)
	some i, v in items
	is_string(v)
}

context_strings contains {"field": sprintf("%v.%v", [k, k2]), "value": v} if {
	some k, obj in context
	is_object(obj)
	some k2, v in obj
	is_string(v)
}

context_strings contains {"field": sprintf("%v.%v.%v", [k, k2, k3]), "value": v} if {
	some k, obj in context
	is_object(obj)
	some k2, inner in obj
	is_object(inner)
	some k3, v in inner
	is_string(v)
}

deny contains {"rule": "secret_in_context", "message": msg} if {
	some c in context_strings
	regex.match(any_secret_value, c.value)
	some kind, pattern in secret_value_shapes
	regex.match(pattern, c.value)
	msg := sprintf("context.%s has a value that looks like %s; secrets never go into jobs", [c.field, kind])
}

# ---------------------------------------------------------------------------
# Purpose and image allowlists of the tenant (empty list = any).
# ---------------------------------------------------------------------------

deny contains {"rule": "purpose_not_allowed", "message": msg} if {
	count(tenant.allowed_purposes) > 0
	purpose := object.get(skill, "purpose", "")
	not purpose in tenant.allowed_purposes
	msg := sprintf("skill %s: purpose `%v` is not in the tenant's allowed_purposes", [skill_name, purpose])
}

deny contains {"rule": "image_not_allowed", "message": msg} if {
	count(tenant.allowed_images) > 0
	image := skill.image
	not image_allowed(image)
	msg := sprintf("skill %s: image `%v` is not in the tenant's allowed_images", [skill_name, image])
}

image_allowed(image) if image in tenant.allowed_images

image_allowed(image) if {
	some pattern in tenant.allowed_images
	endswith(pattern, "*")
	startswith(image, trim_suffix(pattern, "*"))
}

# ---------------------------------------------------------------------------
# Git stays local-only (sandbox_container.md): no clone, fetch, pull, push,
# ls-remote, lfs, submodule update/add/foreach, remote update, archive --remote,
# and no `-c alias.…` (an alias could rename any of those).
# The subcommand is the first argument that is not an option and not the value of
# an option that takes one (`git -C repo push` → push).
# ---------------------------------------------------------------------------

git_value_options := {"-C", "-c", "--git-dir", "--work-tree", "--namespace", "--config-env", "--super-prefix"}

git_remote_subcommands := {"clone", "fetch", "pull", "push", "ls-remote", "lfs"}

git_remote_sub_subcommands := {
	"submodule": {"update", "add", "foreach"},
	"remote": {"update"},
}

git_runs contains {"id": s.id, "args": s.args.args} if {
	some s in run_steps
	s.command == "git"
}

git_runs contains {"id": s.id, "args": s.args.args} if {
	some s in run_steps
	s.command != "git"
	endswith(s.command, "/git")
}

# Each git run with its subcommand: {"id", "args", "i" (index), "sub"}.
git_calls contains {"id": g.id, "args": g.args, "i": i, "sub": g.args[i]} if {
	some g in git_runs
	candidates := {j |
		some j, a in g.args
		not startswith(a, "-")
		not git_option_value(g.args, j)
	}
	count(candidates) > 0
	i := min(candidates)
}

# args[i] is the value of the option before it (that option not itself a value).
git_option_value(args, i) if {
	args[i - 1] in git_value_options
	not args[i - 2] in git_value_options
}

deny contains {"rule": "git_local_only", "message": msg} if {
	some g in git_calls
	g.sub in git_remote_subcommands
	msg := sprintf("step %v: `git %s` reaches a remote; git is kept local-only", [g.id, g.sub])
}

deny contains {"rule": "git_local_only", "message": msg} if {
	some g in git_calls
	some j, a in g.args
	j > g.i
	a in git_remote_sub_subcommands[g.sub]
	msg := sprintf("step %v: `git %s %s` reaches a remote; git is kept local-only", [g.id, g.sub, a])
}

deny contains {"rule": "git_local_only", "message": msg} if {
	some g in git_calls
	g.sub == "archive"
	some j, a in g.args
	j > g.i
	startswith(a, "--remote")
	msg := sprintf("step %v: `git archive %s` reaches a remote; git is kept local-only", [g.id, a])
}

deny contains {"rule": "git_local_only", "message": msg} if {
	some g in git_runs
	some i, a in g.args
	git_alias_config(g.args, i, a)
	msg := sprintf("step %v: git config `%s` defines an alias; git is kept local-only", [g.id, a])
}

git_alias_config(args, i, a) if {
	args[i - 1] in {"-c", "--config-env"}
	startswith(lower(a), "alias.")
}

git_alias_config(_, _, a) if startswith(lower(a), "--config-env=alias.")

# ---------------------------------------------------------------------------
# Consistency between the job and the manifest it is judged against.
# ---------------------------------------------------------------------------

deny contains {"rule": "skill_mismatch", "message": msg} if {
	job.skill_id != skill.skill_id
	msg := sprintf("job skill_id `%v` does not match the skill manifest `%v`", [job.skill_id, skill.skill_id])
}

# ---------------------------------------------------------------------------
# Warnings: never block, reported in the decision.
# ---------------------------------------------------------------------------

warn contains {"rule": "no_steps", "message": "job has no steps; it will do nothing"} if {
	count(steps) == 0
	not job.execution_mode == "agent_inference"
}

runtime_ceiling := min(limits) if {
	limits := {c.limit | some c in ceilings; c.field == "max_runtime_seconds"; is_number(c.limit)}
	count(limits) > 0
}

warn contains {"rule": "runtime_near_ceiling", "message": msg} if {
	v := constraints.max_runtime_seconds
	v > runtime_ceiling / 2
	v <= runtime_ceiling
	is_number(v)
	msg := sprintf(
		"constraints.max_runtime_seconds %v is over half the ceiling of %v",
		[v, runtime_ceiling],
	)
}
