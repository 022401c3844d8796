#!/bin/sh
set -e
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
[ -n "$POSTGRES_PASSWORD" ] || { echo "POSTGRES_PASSWORD is required" >&2; exit 1; }
mkdir -p "$PGDATA" /var/run/postgresql
chown -R postgres:postgres "$PGDATA" /var/run/postgresql
chmod 700 "$PGDATA"
as_pg() { runuser -u postgres -- "$@"; }
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    echo "$POSTGRES_PASSWORD" >/tmp/pwfile && chown postgres /tmp/pwfile
    as_pg initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile=/tmp/pwfile --auth-local=trust --auth-host=scram-sha-256
    rm -f /tmp/pwfile
    echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    if [ "$POSTGRES_DB" != postgres ]; then
        echo "CREATE DATABASE \"$POSTGRES_DB\";" | as_pg postgres --single -D "$PGDATA" postgres >/dev/null
    fi
fi
if [ "$1" = postgres ]; then
    shift
    exec runuser -u postgres -- postgres -D "$PGDATA" "$@"
fi
exec "$@"
