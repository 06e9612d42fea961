#!/bin/sh
# deploy/pm/entrypoint.sh - the cynode-pm image's entrypoint.
# When CYNODE_DATASTORE_PASSWORD_FILE names a file, its first line becomes PGPASSWORD,
# which sqlx uses when --datastore-endpoint carries no password (so the password lives
# in a mounted secret file, never in an argument or the compose file). Then it execs
# cynode-pm with the given arguments.
set -eu
if [ -n "${CYNODE_DATASTORE_PASSWORD_FILE:-}" ]; then
  IFS= read -r PGPASSWORD <"$CYNODE_DATASTORE_PASSWORD_FILE" || [ -n "${PGPASSWORD:-}" ]
  export PGPASSWORD
fi
exec /usr/local/bin/cynode-pm "$@"
