# deploy/lib.sh - sourced by the image builders (deploy/sba/build-*-image.sh) and the
# session-state bench (worker/benches/session_state.sh): `usage`
# prints the calling script's header comment (line 2 up to `set -euo`), `log` and `die`
# write to stderr prefixed with the script's name, `elapsed` is the time since it was
# sourced, `exit_if_image_current` and `finish_image` skip an up-to-date image and remove
# the one a build replaced; `installed`, `dependency_closure`, `lock_image`,
# `add_libraries` and `pack_layer` are the steps of the images made from the host's Debian
# packages (build-python-test-image.sh, build-toolchain-test-image.sh).
# shellcheck shell=bash
script_name=$(basename "$0" .sh)
# This file, which a recipe that uses its steps hashes with the script.
cynode_lib=${BASH_SOURCE[0]}
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

installed() { # PACKAGE: true when dpkg has it installed
  [[ $(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null) == installed ]]
}

# Sets `packages` (sorted) to the installed dependency closure of ROOTS (Depends and
# Pre-Depends, the first installed alternative of each) kept to the names KEEP matches;
# a name FOLLOW_ONLY matches is followed but not kept ('' matches none).
dependency_closure() { # KEEP FOLLOW_ONLY ROOTS...
  local keep=$1 follow_only=$2 pkg deps alt choice name
  shift 2
  local -A seen=()
  local queue=("$@") alternatives choices
  packages=()
  while ((${#queue[@]})); do
    pkg=${queue[0]}
    queue=("${queue[@]:1}")
    [[ -n ${seen[$pkg]:-} ]] && continue
    seen[$pkg]=1
    [[ $pkg =~ $keep ]] || continue
    [[ -n $follow_only && $pkg =~ $follow_only ]] || packages+=("$pkg")
    deps=$(dpkg-query -W -f='${Pre-Depends}, ${Depends}' "$pkg")
    IFS=',' read -ra alternatives <<<"$deps"
    for alt in "${alternatives[@]}"; do
      IFS='|' read -ra choices <<<"$alt"
      for choice in "${choices[@]}"; do
        name=$(sed -e 's/([^)]*)//g' -e 's/:.*//' -e 's/[[:space:]]//g' <<<"$choice")
        [[ -n $name ]] || continue
        if installed "$name"; then
          queue+=("$name")
          break
        fi
      done
    done
  done
  mapfile -t packages < <(printf '%s\n' "${packages[@]}" | sort)
}

# Holds IMAGE's build lock (fd 9) for the rest of the script: builds of one image from
# several test processes run one after the other.
lock_image() { # IMAGE
  local name
  name=$(printf '%s' "$1" | tr -c 'A-Za-z0-9._-' '_')
  mkdir -p /run/lock
  exec 9>"/run/lock/cynode-image-$name.lock"
  flock -w 900 9 || die "timed out waiting for the build lock of $1"
}

# Reads paths of programs and shared libraries on stdin; prints the shared libraries
# `ldd` finds for them (each also as the path its merged-/usr link leads to: the base
# image links /lib to usr/lib, so a library named under /lib is stored under /usr/lib),
# then the host's CA bundle.
add_libraries() {
  xargs -r sh -c 'ldd "$@" 2>/dev/null || true' ldd | grep -o '/[^ ]* (0x' |
    sed 's/ (0x$//' | sort -u | while read -r lib; do
    printf '%s\n' "$lib"
    real=$(readlink -f "$lib")
    if [[ $real != "$lib" ]]; then printf '%s\n' "$real"; fi
  done
  if [[ -f /etc/ssl/certs/ca-certificates.crt ]]; then
    echo /etc/ssl/certs/ca-certificates.crt
  fi
}

# Copies the files FILES lists into the tar layer TAR, under /usr only (paths under /lib,
# /bin go to /usr: the base image links them there); logs its size.
pack_layer() { # FILES TAR
  local root f dest
  root=$(mktemp -d "$(dirname "$2")/root.XXXXXX")
  sort -u "$1" | while read -r f; do
    case $f in
      /lib/* | /lib64/* | /bin/* | /sbin/*) dest=/usr$f ;;
      *) dest=$f ;;
    esac
    mkdir -p "$root$(dirname "$dest")"
    cp -a "$f" "$root$dest"
  done
  tar --numeric-owner -C "$root" -cf "$2" .
  rm -rf "$root"
  log "layer: $(du -m "$2" | cut -f1) MiB"
}
