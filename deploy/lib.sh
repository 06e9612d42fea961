# deploy/lib.sh - sourced by the image builders (deploy/sba/build-*-image.sh) and the
# session-state bench (worker/benches/session_state.sh): `usage`
# prints the calling script's header comment (line 2 up to `set -euo`), `log` and `die`
# write to stderr prefixed with the script's name, `elapsed` is the time since it was
# sourced, `exit_if_image_current` and `finish_image` skip an up-to-date image and remove
# the one a build replaced.
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
start=$(date +%s.%N)
elapsed() { awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN {printf "%.2f s", e - s}'; }

image_label() { # IMAGE LABEL
  podman image inspect --format "{{index .Labels \"$2\"}}" "$1" 2>/dev/null || true
}

# Sets old_id to IMAGE's id ("" when there is none). When IMAGE carries SBA_SHA and
# RECIPE_SHA in its labels and no rebuild is forced (FORCE is not 1), prints its id and
# exits 0: the image is up to date.
exit_if_image_current() { # IMAGE SBA_SHA RECIPE_SHA FORCE
  old_id=""
  podman image exists "$1" || return 0
  old_id=$(podman image inspect --format '{{.Id}}' "$1")
  if [[ $4 != 1 && $(image_label "$1" io.cynode.sba.sha256) == "$2" &&
    $(image_label "$1" io.cynode.image.recipe) == "$3" ]]; then
    log "$1 is up to date (sba sha256 ${2:0:12}); not rebuilding ($(elapsed))"
    echo "$old_id"
    exit 0
  fi
}

# Removes the image IMAGE replaced (unless a container still uses it) and prints the new id.
finish_image() { # IMAGE
  local new_id
  new_id=$(podman image inspect --format '{{.Id}}' "$1")
  if [[ -n $old_id && $old_id != "$new_id" ]]; then
    podman rmi "$old_id" >/dev/null 2>&1 || log "old image ${old_id:0:12} still in use; left in place"
  fi
  log "built $1 ($(elapsed))"
  echo "$new_id"
}
