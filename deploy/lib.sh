# deploy/lib.sh - sourced by the deploy scripts that take arguments: `usage` prints the
# calling script's header comment (line 2 up to `set -euo`), `log` and `die` write to
# stderr prefixed with the script's name.
# shellcheck shell=bash
script_name=$(basename "$0" .sh)
usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
  exit "${1:-2}"
}
log() { printf '%s: %s\n' "$script_name" "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}
