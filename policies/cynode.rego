# CyNode default policy: decides whether a rendered job.json may be dispatched.
#
# Evaluated in-process by cynode-pm (regorus) or by an external OPA server
# (`cynode-pm --policy-endpoint URL`, query `POST /v1/data/cynode/policy`).
#
# input = {
#   "job":    the rendered job.json (design.md §3.1),
#   "skill":  the skill manifest (skill_id, purpose, allowed_commands, network, limits, …),
#   "tenant": the tenant policy (allow_network, allowed_purposes, allowed_images,
#             global_allowed_commands, max_runtime_seconds, max_output_bytes)
# }
#
# Output: `deny` and `warn`, sets of {"rule": …, "message": …}. Any deny blocks the job
# (unless the gate runs in dry-run mode); warn never does. Messages are lowercase and
# name the step id and the offending value (secret values are never echoed).
# See policies/README.md for the rule list.
package cynode.policy

import rego.v1

# ---------------------------------------------------------------------------
# Input views, tolerant of missing or mistyped sections (a missing section makes
# the checks that need it deny, never silently pass).
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

step_id(i, step) := step.id if {
	is_string(step.id)
} else := sprintf("#%d", [i])

step_args(step) := step.arguments if {
	is_object(step.arguments)
} else := {}

basename(p) := b if {
	parts := split(p, "/")
	b := parts[count(parts) - 1]
}

# Every run_command step as {"id", "args", "command"}.
run_steps := [s |
	some i, step in steps
	step.type == "run_command"
	args := step_args(step)
	s := {"id": step_id(i, step), "args": args, "command": object.get(args, "command", "")}
]

# ---------------------------------------------------------------------------
# Commands: allowed by the skill or globally by the tenant, and by the job's own
# constraints.allowed_commands when it carries one. An entry matches the command
# itself or its basename (`go` allows `/usr/local/go/bin/go`).
# ---------------------------------------------------------------------------

permitted_commands := {c | some c in object.get(skill, "allowed_commands", [])} | {c |
	some c in object.get(tenant, "global_allowed_commands", [])
}

command_matches(cmd, allowed) if cmd in allowed

command_matches(cmd, allowed) if basename(cmd) in allowed

deny contains {"rule": "command_not_allowed", "message": msg} if {
	some s in run_steps
	not command_matches(s.command, permitted_commands)
	msg := sprintf(
		"step %s: command `%s` is not allowed by skill %s or the tenant's global_allowed_commands",
		[s.id, s.command, skill_name],
	)
}

deny contains {"rule": "command_not_in_job_allowlist", "message": msg} if {
	is_array(constraints.allowed_commands)
	job_allowed := {c | some c in constraints.allowed_commands}
	some s in run_steps
	not command_matches(s.command, job_allowed)
	msg := sprintf("step %s: command `%s` is not in constraints.allowed_commands", [s.id, s.command])
}

# ---------------------------------------------------------------------------
# Paths: relative, or absolute under /workspace; no `..` component; no NUL byte.
# Checked: step paths and working_dir, constraints.allowed_paths, artifact globs and
# the file names in apply_unified_diff headers.
# ---------------------------------------------------------------------------

path_fields := {
	"write_file": ["path"],
	"read_file": ["path"],
	"list_tree": ["path"],
	"search_files": ["path"],
	"run_command": ["working_dir"],
}

checked_paths contains {"where": where, "path": p} if {
	some i, step in steps
	some field in path_fields[step.type]
	p := step_args(step)[field]
	where := sprintf("step %s: %s", [step_id(i, step), field])
}

checked_paths contains {"where": sprintf("constraints.allowed_paths[%d]", [i]), "path": p} if {
	some i, p in object.get(constraints, "allowed_paths", [])
}

checked_paths contains {"where": sprintf("artifacts[%d]", [i]), "path": p} if {
	some i, p in object.get(job, "artifacts", [])
}

checked_paths contains {"where": sprintf("step %s: diff header", [step_id(i, step)]), "path": p} if {
	some i, step in steps
	step.type == "apply_unified_diff"
	diff := step_args(step).diff
	is_string(diff)
	some line in split(diff, "\n")
	p := diff_header_path(line)
}

diff_header_path(line) := p if {
	some prefix in ["--- ", "+++ "]
	startswith(line, prefix)
	name := trim_space(split(substring(line, 4, -1), "\t")[0])
	name != "/dev/null"
	p := strip_diff_prefix(name)
}

strip_diff_prefix(name) := substring(name, 2, -1) if {
	some prefix in ["a/", "b/"]
	startswith(name, prefix)
} else := name

deny contains {"rule": "path_invalid", "message": msg} if {
	some c in checked_paths
	not is_string(c.path)
	msg := sprintf("%s: path must be a string, got %s", [c.where, type_name(c.path)])
}

deny contains {"rule": "path_nul_byte", "message": msg} if {
	some c in checked_paths
	is_string(c.path)
	contains(c.path, "\u0000")
	msg := sprintf("%s: path contains a nul byte", [c.where])
}

deny contains {"rule": "path_traversal", "message": msg} if {
	some c in checked_paths
	is_string(c.path)
	not contains(c.path, "\u0000")
	".." in split(c.path, "/")
	msg := sprintf("%s: path `%s` has a `..` component", [c.where, c.path])
}

deny contains {"rule": "path_outside_workspace", "message": msg} if {
	some c in checked_paths
	is_string(c.path)
	not contains(c.path, "\u0000")
	startswith(c.path, "/")
	not under_workspace(c.path)
	msg := sprintf("%s: absolute path `%s` is outside /workspace", [c.where, c.path])
}

under_workspace(p) if p == "/workspace"

under_workspace(p) if startswith(p, "/workspace/")

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

deny contains {"rule": "network_not_allowed", "message": msg} if {
	job_wants_network
	not tenant.allow_network == true
	msg := sprintf("constraints.ext_net_allowed is true but tenant `%v` does not allow network", [object.get(tenant, "tenant_id", "")])
}

# ---------------------------------------------------------------------------
# Limits: the job's ceilings may not exceed the skill's limits nor the tenant's
# ceilings; a step timeout may not exceed the job's deadline.
# ---------------------------------------------------------------------------

limit_rules := {"max_runtime_seconds": "runtime_ceiling", "max_output_bytes": "output_ceiling"}

ceilings contains {"field": f, "owner": sprintf("skill %s", [skill_name]), "limit": v} if {
	some f, _ in limit_rules
	v := skill.limits[f]
	is_number(v)
}

ceilings contains {"field": f, "owner": "tenant", "limit": v} if {
	some f, _ in limit_rules
	v := tenant[f]
	is_number(v)
}

positive_number(x) if {
	is_number(x)
	x > 0
}

deny contains {"rule": "limits_missing", "message": msg} if {
	some f, _ in limit_rules
	not positive_number(constraints[f])
	msg := sprintf("constraints.%s must be a positive number", [f])
}

deny contains {"rule": limit_rules[c.field], "message": msg} if {
	some c in ceilings
	v := constraints[c.field]
	is_number(v)
	v > c.limit
	msg := sprintf("constraints.%s %v exceeds the %s ceiling of %v", [c.field, v, c.owner, c.limit])
}

deny contains {"rule": "step_timeout_ceiling", "message": msg} if {
	some s in run_steps
	t := s.args.timeout_seconds
	is_number(t)
	job_max := constraints.max_runtime_seconds
	positive_number(job_max)
	t > job_max
	msg := sprintf(
		"step %s: timeout_seconds %v exceeds constraints.max_runtime_seconds %v",
		[s.id, t, job_max],
	)
}

# ---------------------------------------------------------------------------
# Secrets: run_command env must not carry credentials. The message names the
# variable and the kind of secret, never its value.
# ---------------------------------------------------------------------------

secret_name_markers := ["TOKEN", "SECRET", "PASSWORD", "PASSWD", "API_KEY", "PRIVATE_KEY"]

secret_value_shapes := {
	"a github token": `(^|[^A-Za-z0-9_])(gh[pousr]_[A-Za-z0-9]{16,}|github_pat_[A-Za-z0-9_]{16,})`,
	"an openai-style api key": `(^|[^A-Za-z0-9_-])sk-[A-Za-z0-9_-]{16,}`,
	"an aws access key id": `(^|[^A-Z0-9])AKIA[0-9A-Z]{16}([^A-Z0-9]|$)`,
	"a slack token": `(^|[^A-Za-z0-9])xox[bp]-[A-Za-z0-9-]{8,}`,
	"a pem private key or certificate": `-----BEGIN`,
	"a jwt": `(^|[^A-Za-z0-9_-])eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+`,
}

env_entries contains {"id": s.id, "name": name, "value": value} if {
	some s in run_steps
	env := s.args.env
	is_object(env)
	some name, value in env
}

deny contains {"rule": "secret_env_name", "message": msg} if {
	some e in env_entries
	some marker in secret_name_markers
	contains(upper(e.name), marker)
	e.value != ""
	msg := sprintf("step %s: env `%s` looks like a secret (name contains %s); secrets never go into jobs", [e.id, e.name, lower(marker)])
}

deny contains {"rule": "secret_env_value", "message": msg} if {
	some e in env_entries
	is_string(e.value)
	some kind, pattern in secret_value_shapes
	regex.match(pattern, e.value)
	msg := sprintf("step %s: env `%s` has a value that looks like %s; secrets never go into jobs", [e.id, e.name, kind])
}

# ---------------------------------------------------------------------------
# Purpose and image allowlists of the tenant (empty list = any).
# ---------------------------------------------------------------------------

deny contains {"rule": "purpose_not_allowed", "message": msg} if {
	allowed := object.get(tenant, "allowed_purposes", [])
	count(allowed) > 0
	purpose := object.get(skill, "purpose", "")
	not purpose in allowed
	msg := sprintf("skill %s: purpose `%v` is not in the tenant's allowed_purposes", [skill_name, purpose])
}

image_matches(image, pattern) if image == pattern

image_matches(image, pattern) if {
	endswith(pattern, "*")
	startswith(image, trim_suffix(pattern, "*"))
}

deny contains {"rule": "image_not_allowed", "message": msg} if {
	allowed := object.get(tenant, "allowed_images", [])
	count(allowed) > 0
	image := skill.image
	not any_image_matches(image, allowed)
	msg := sprintf("skill %s: image `%v` is not in the tenant's allowed_images", [skill_name, image])
}

any_image_matches(image, allowed) if {
	some pattern in allowed
	image_matches(image, pattern)
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

git_steps := [{"id": s.id, "args": args} |
	some s in run_steps
	basename(s.command) == "git"
	args := object.get(s.args, "args", [])
	is_array(args)
]

# args[i] is the value of the option before it (that option not itself a value).
git_option_value(args, i) if {
	i > 0
	args[i - 1] in git_value_options
	not git_option_value_shallow(args, i - 1)
}

git_option_value_shallow(args, i) if {
	i > 0
	args[i - 1] in git_value_options
}

git_subcommand_index(args) := min(candidates) if {
	candidates := {i |
		some i, a in args
		is_string(a)
		not startswith(a, "-")
		not git_option_value(args, i)
	}
	count(candidates) > 0
}

deny contains {"rule": "git_local_only", "message": msg} if {
	some g in git_steps
	sub := g.args[git_subcommand_index(g.args)]
	sub in git_remote_subcommands
	msg := sprintf("step %s: `git %s` reaches a remote; git is kept local-only", [g.id, sub])
}

deny contains {"rule": "git_local_only", "message": msg} if {
	some g in git_steps
	i := git_subcommand_index(g.args)
	sub := g.args[i]
	some j, a in g.args
	j > i
	a in git_remote_sub_subcommands[sub]
	msg := sprintf("step %s: `git %s %s` reaches a remote; git is kept local-only", [g.id, sub, a])
}

deny contains {"rule": "git_local_only", "message": msg} if {
	some g in git_steps
	i := git_subcommand_index(g.args)
	g.args[i] == "archive"
	some j, a in g.args
	j > i
	startswith(a, "--remote")
	msg := sprintf("step %s: `git archive %s` reaches a remote; git is kept local-only", [g.id, a])
}

deny contains {"rule": "git_local_only", "message": msg} if {
	some g in git_steps
	some i, a in g.args
	git_alias_config(g.args, i, a)
	msg := sprintf("step %s: git config `%s` defines an alias; git is kept local-only", [g.id, a])
}

git_alias_config(args, i, a) if {
	i > 0
	args[i - 1] in {"-c", "--config-env"}
	startswith(lower(a), "alias.")
}

git_alias_config(_, _, a) if startswith(lower(a), "--config-env=alias.")

# ---------------------------------------------------------------------------
# Consistency between the job and the manifest it is judged against.
# ---------------------------------------------------------------------------

deny contains {"rule": "skill_mismatch", "message": msg} if {
	is_string(job.skill_id)
	is_string(skill.skill_id)
	job.skill_id != skill.skill_id
	msg := sprintf("job skill_id `%s` does not match the skill manifest `%s`", [job.skill_id, skill.skill_id])
}

# ---------------------------------------------------------------------------
# Warnings: never block, reported in the decision.
# ---------------------------------------------------------------------------

warn contains {"rule": "no_steps", "message": "job has no steps; it will do nothing"} if {
	count(steps) == 0
	not job.execution_mode == "agent_inference"
}

runtime_ceiling := min(limits) if {
	limits := {c.limit | some c in ceilings; c.field == "max_runtime_seconds"}
	count(limits) > 0
}

warn contains {"rule": "runtime_near_ceiling", "message": msg} if {
	v := constraints.max_runtime_seconds
	is_number(v)
	v > runtime_ceiling / 2
	v <= runtime_ceiling
	msg := sprintf(
		"constraints.max_runtime_seconds %v is over half the ceiling of %v",
		[v, runtime_ceiling],
	)
}
