#!/usr/bin/env bash
# A local Redis Cluster for tests and development: 3 masters + 3 replicas on six ports.
#
#   scripts/redis-cluster.sh start PORTBASE   # ports PORTBASE..PORTBASE+5 (bus: +10000);
#                                             # prints the store URL (redis+cluster://...)
#   scripts/redis-cluster.sh stop PORTBASE    # shuts those six servers down, removes their dir
#   scripts/redis-cluster.sh restart-node PORT PORTBASE   # restart one (killed) node; it
#                                             # rejoins from its nodes.conf (as a replica)
#
# Node timeout 1000 ms: a killed master's replica takes over in ~2 s. No persistence.
# The servers' files live in ${TMPDIR:-/tmp}/kvwire-redis-cluster-PORTBASE.
set -euo pipefail

usage() { echo "usage: $0 start|stop PORTBASE | restart-node PORT PORTBASE" >&2; exit 2; }
[ $# -ge 2 ] || usage
command=$1

node_up() {   # node_up PORT DIR: start one cluster-enabled server
    redis-server --port "$1" --bind 127.0.0.1 --cluster-enabled yes --cluster-node-timeout 1000 \
        --cluster-config-file "nodes-$1.conf" --save '' --appendonly no --repl-diskless-sync-delay 0 \
        --daemonize yes \
        --dir "$2" --logfile "$2/redis-$1.log" --pidfile "$2/redis-$1.pid"
    for _ in $(seq 100); do redis-cli -p "$1" ping >/dev/null 2>&1 && return 0; sleep 0.05; done
    echo "$0: redis-server on port $1 did not start (see $2/redis-$1.log)" >&2
    return 1
}

case $command in
start)
    base=$2
    dir="${TMPDIR:-/tmp}/kvwire-redis-cluster-$base"
    rm -rf "$dir" && mkdir -p "$dir"
    ports=$(seq "$base" $((base + 5)))
    for port in $ports; do node_up "$port" "$dir"; done
    # shellcheck disable=SC2046
    redis-cli --cluster create $(for port in $ports; do printf '127.0.0.1:%s ' "$port"; done) \
        --cluster-replicas 1 --cluster-yes >"$dir/create.log" 2>&1 \
        || { cat "$dir/create.log" >&2; exit 1; }
    for port in $ports; do
        for _ in $(seq 200); do
            redis-cli -p "$port" cluster info 2>/dev/null | grep -q '^cluster_state:ok' && break
            sleep 0.05
        done
        redis-cli -p "$port" cluster info | grep -q '^cluster_state:ok' \
            || { echo "$0: node $port never reported cluster_state:ok" >&2; exit 1; }
    done
    for port in $ports; do   # replicas synced: a master killed from now on has a full copy
        for _ in $(seq 200); do
            info=$(redis-cli -p "$port" info replication)
            echo "$info" | grep -q '^role:master' && break
            echo "$info" | grep -q '^master_link_status:up' && break
            sleep 0.05
        done
    done
    echo "redis+cluster://$(for port in $ports; do printf '127.0.0.1:%s,' "$port"; done | sed 's/,$//')"
    ;;
stop)
    base=$2
    dir="${TMPDIR:-/tmp}/kvwire-redis-cluster-$base"
    for port in $(seq "$base" $((base + 5))); do
        redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
    done
    rm -rf "$dir"
    ;;
restart-node)
    [ $# -eq 3 ] || usage
    node_up "$2" "${TMPDIR:-/tmp}/kvwire-redis-cluster-$3"
    ;;
*) usage ;;
esac
