#!/usr/bin/env bash
# deploy/sba/build-unlabelled-test-image.sh - the test image without its agent label.
#
# Usage:  deploy/sba/build-unlabelled-test-image.sh [SOURCE] [IMAGE_NAME]
#   SOURCE      default localhost/cynode-sba-test:latest (deploy/sba/build-test-image.sh)
#   IMAGE_NAME  default localhost/cynode-sba-test-unlabelled:latest
#
# The same root filesystem and configuration (entrypoint, user, workdir, environment) as
# SOURCE, imported with no io.cynodeai.sandbox.agent-compatible label: the image the
# worker's agent-image tests expect to be refused as `image_not_agent_compatible`. It
# carries only io.cynode.image.source (SOURCE's id) and io.cynode.image.recipe, and is
# rebuilt when either changes. Nothing is pulled. Concurrent runs serialise on a lock file.
#
# Output: the image id on stdout (only that); progress on stderr.
# Needs: root, podman, and SOURCE in podman's store.
set -euo pipefail

# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

[[ ${1:-} == -h || ${1:-} == --help ]] && usage 0
(($# <= 2)) || usage 2
source_image=${1:-localhost/cynode-sba-test:latest}
image=${2:-localhost/cynode-sba-test-unlabelled:latest}

command -v podman >/dev/null || die "podman not found: run deploy/install-deps.sh"
source_id=$(podman image inspect --format '{{.Id}}' "$source_image") ||
  die "podman has no image $source_image: run deploy/sba/build-test-image.sh"
recipe_sha=$(sha256sum "$0" | cut -d' ' -f1)

lock_image "$image"

old_id=""
if podman image exists "$image"; then
  old_id=$(podman image inspect --format '{{.Id}}' "$image")
  if [[ $(image_label "$image" io.cynode.image.source) == "$source_id" &&
    $(image_label "$image" io.cynode.image.recipe) == "$recipe_sha" ]]; then
    log "$image is up to date (source ${source_id:0:12})"
    echo "$old_id"
    exit 0
  fi
fi

ctr=$(podman create --pull=never "$source_image" true)
trap 'podman rm -f "$ctr" >/dev/null 2>&1 || true' EXIT
podman export "$ctr" |
  podman import --quiet \
    --change 'ENTRYPOINT ["/usr/local/bin/cynode-sba"]' \
    --change 'USER 1000:1000' \
    --change 'WORKDIR /workspace' \
    --change 'ENV PATH=/usr/local/bin:/usr/bin:/usr/sbin:/bin:/sbin' \
    --change 'ENV HOME=/home/sandbox' \
    --change "LABEL io.cynode.image.source=$source_id" \
    --change "LABEL io.cynode.image.recipe=$recipe_sha" \
    --message "cynode-sba test image without the agent label (from ${source_id:0:12})" \
    - "$image" >/dev/null
[[ -z $(image_label "$image" io.cynodeai.sandbox.agent-compatible) ]] ||
  die "$image still carries io.cynodeai.sandbox.agent-compatible"

finish_image "$image"
