#!/usr/bin/env bash
# Installs (if missing) and starts a local PostgreSQL for the PM's state tests, creates the
# role and database `cynode` (password `cynode`, loopback only), and prints
#   CYNODE_TEST_POSTGRES_URL=postgres://cynode:cynode@127.0.0.1:5432/cynode
# on stdout. Idempotent: a running cluster is reused.
set -euo pipefail
log() { printf 'postgres: %s\n' "$*" >&2; }
if ! command -v pg_lsclusters >/dev/null 2>&1 || [[ -z $(ls /usr/lib/postgresql 2>/dev/null) ]]; then
  log "installing postgresql"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq postgresql >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq postgresql >/dev/null; }
fi
exec 9>/run/lock/cynode-postgres.lock
flock -w 300 9
version=$(ls /usr/lib/postgresql | sort -n | tail -1)
if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -q "^$version main$"; then
  pg_createcluster "$version" main >&2 9>&-
fi
if ! pg_lsclusters -h | awk -v v="$version" '$1==v && $2=="main" {print $4}' | grep -q online; then
  pg_ctlcluster "$version" main start >&2 9>&-
fi
for _ in $(seq 1 100); do
  su postgres -c "psql -qAt -c 'select 1'" >/dev/null 2>&1 && break
  sleep 0.1
done
su postgres -c "psql -qAt -c \"select 1 from pg_roles where rolname='cynode'\"" | grep -q 1 ||
  su postgres -c "psql -q -c \"create role cynode login password 'cynode'\"" >&2
# The service tests give each test its own database (replicas of one test share only it).
su postgres -c "psql -q -c 'alter role cynode createdb'" >&2
su postgres -c "psql -qAt -c \"select 1 from pg_database where datname='cynode'\"" | grep -q 1 ||
  su postgres -c "psql -q -c 'create database cynode owner cynode'" >&2
port=$(pg_lsclusters -h | awk -v v="$version" '$1==v && $2=="main" {print $3}')
echo "CYNODE_TEST_POSTGRES_URL=postgres://cynode:cynode@127.0.0.1:${port}/cynode"
