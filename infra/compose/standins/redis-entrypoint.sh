#!/bin/sh
set -e
if [ "$1" = redis-server ]; then
    shift
    chown redis:redis /data
    exec runuser -u redis -- redis-server --protected-mode no "$@"
fi
exec "$@"
