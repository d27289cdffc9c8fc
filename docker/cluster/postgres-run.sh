#!/bin/bash
# PostgreSQL for MLflow: the data folder initialised once (a database and a user named by
# POSTGRES_DB / POSTGRES_USER / POSTGRES_PASSWORD), then the server, listening on the cluster's
# network with password authentication.
set -euo pipefail
data=${PGDATA:-/var/lib/postgresql/data}
bin=/usr/lib/postgresql/15/bin
mkdir -p "$data" /run/postgresql
chown -R postgres:postgres "$data" /run/postgresql
if [ ! -s "$data/PG_VERSION" ]; then
  printf '%s\n' "$POSTGRES_PASSWORD" > /tmp/pwfile
  chown postgres /tmp/pwfile
  runuser -u postgres -- "$bin/initdb" -D "$data" -U postgres --pwfile=/tmp/pwfile --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f /tmp/pwfile
  echo "host all all 0.0.0.0/0 scram-sha-256" >> "$data/pg_hba.conf"
  runuser -u postgres -- "$bin/pg_ctl" -D "$data" -o "-c listen_addresses=''" -w start >/dev/null
  runuser -u postgres -- psql -q -v ON_ERROR_STOP=1 -c "CREATE USER \"$POSTGRES_USER\" PASSWORD '$POSTGRES_PASSWORD'" \
    -c "CREATE DATABASE \"$POSTGRES_DB\" OWNER \"$POSTGRES_USER\""
  runuser -u postgres -- "$bin/pg_ctl" -D "$data" -m fast -w stop >/dev/null
fi
exec runuser -u postgres -- "$bin/postgres" -D "$data" -c listen_addresses='*'
