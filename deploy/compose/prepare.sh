#!/usr/bin/env bash
# deploy/compose/prepare.sh - make what compose.yaml expects on the host, idempotently:
#   deploy/compose/secrets/{pg-password,worker-token,pm-tokens}   random, never overwritten
#   /var/lib/cynode-worker                                         the worker's state dir
# Compose bind-mounts secret files with their host owner and mode, so the files are 0644
# (readable by the containers' non-root users) inside a 0700 directory that only root
# can enter on the host.
# Usage: deploy/compose/prepare.sh [TENANT]   (TENANT of the first API token, default "default")
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tenant=${1:-default}
secrets=$here/secrets
umask 077
mkdir -p "$secrets"
chmod 0700 "$secrets"
rand() { head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
write_once() { # NAME CONTENT
  local f=$secrets/$1
  if [[ -s $f ]]; then
    echo "prepare: $f exists, kept" >&2
  else
    printf '%s\n' "$2" >"$f"
    echo "prepare: wrote $f" >&2
  fi
  chmod 0644 "$f"
}
write_once pg-password "$(rand)"
write_once worker-token "$(rand)"
# One "TOKEN TENANT" line per API client of the PM.
write_once pm-tokens "$(rand) $tenant"
mkdir -p /var/lib/cynode-worker 2>/dev/null && chmod 0755 /var/lib/cynode-worker ||
  echo "prepare: cannot create /var/lib/cynode-worker (run as root)" >&2
echo "prepare: API token for tenant '$tenant': $(cut -d' ' -f1 "$secrets/pm-tokens" | head -n 1)" >&2
