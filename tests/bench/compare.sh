#!/usr/bin/env bash
# Side-by-side bench: keyhome against etcd, ZooKeeper and Redis on this machine (docs/benchmarks.md,
# "Side by side"). Installs the peers from Debian's packages if missing, starts 3-member etcd,
# 3-member ZooKeeper and two Redis servers (in memory; appendfsync always) on loopback in a temp
# directory, runs the keyhome-compare binary (which starts a 3-node keyhome itself), and stops every
# server it started by PID. Not part of CI. Arguments go to keyhome-compare, e.g.:
#   tests/bench/compare.sh --rounds 5
#   tests/bench/compare.sh --rounds 1 --iters 100 --seconds 0.5 --cli-runs 3   # smoke run
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tmp="$(mktemp -d /tmp/keyhome-compare.XXXXXX)"
pids=()

stop() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$tmp"
}
trap stop EXIT

# ---- packages ----
need=()
command -v etcd >/dev/null || need+=(etcd-server)
command -v etcdctl >/dev/null || need+=(etcd-client)
[ -e /usr/share/java/zookeeper.jar ] || need+=(zookeeper)
command -v redis-server >/dev/null || need+=(redis-server)
command -v protoc >/dev/null || need+=(protobuf-compiler)  # etcd-client's build
if [ "${#need[@]}" -gt 0 ]; then
    echo "installing ${need[*]}" >&2
    apt-get update -qq
    for pkg in "${need[@]}"; do
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg" >/dev/null \
            || echo "WARNING: cannot install $pkg; its system is left out" >&2
    done
fi

args=()
# waits until `$2 ...` succeeds, at most 60 s; says which server did not come up
wait_for() {
    local what="$1"; shift
    for _ in $(seq 600); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
    echo "WARNING: $what did not come up; see $tmp" >&2
    return 1
}

# ---- etcd: 3 members ----
if command -v etcd >/dev/null; then
    cluster="e1=http://127.0.0.1:23801,e2=http://127.0.0.1:23802,e3=http://127.0.0.1:23803"
    endpoints=""
    for i in 1 2 3; do
        etcd --name "e$i" --data-dir "$tmp/etcd-$i" \
            --listen-client-urls "http://127.0.0.1:2379$i" --advertise-client-urls "http://127.0.0.1:2379$i" \
            --listen-peer-urls "http://127.0.0.1:2380$i" --initial-advertise-peer-urls "http://127.0.0.1:2380$i" \
            --initial-cluster "$cluster" --initial-cluster-state new --initial-cluster-token bench \
            >"$tmp/etcd-$i.log" 2>&1 &
        pids+=($!)
        endpoints="${endpoints:+$endpoints,}http://127.0.0.1:2379$i"
    done
    if wait_for etcd env ETCDCTL_API=3 etcdctl --endpoints "$endpoints" endpoint health; then
        args+=(--etcd "$endpoints")
    fi
fi

# ---- ZooKeeper: 3 members ----
if [ -e /usr/share/java/zookeeper.jar ] && command -v java >/dev/null; then
    servers=""
    for i in 1 2 3; do
        mkdir -p "$tmp/zk-$i"
        echo "$i" >"$tmp/zk-$i/myid"
        cat >"$tmp/zk-$i.cfg" <<CFG
tickTime=2000
initLimit=10
syncLimit=5
dataDir=$tmp/zk-$i
clientPort=2181$i
clientPortAddress=127.0.0.1
admin.enableServer=false
4lw.commands.whitelist=ruok,srvr
server.1=127.0.0.1:22881:23881
server.2=127.0.0.1:22882:23882
server.3=127.0.0.1:22883:23883
CFG
        java -Xmx256m -cp "/etc/zookeeper/conf:/usr/share/java/zookeeper.jar" \
            -Dzookeeper.log.dir="$tmp" org.apache.zookeeper.server.quorum.QuorumPeerMain "$tmp/zk-$i.cfg" \
            >"$tmp/zk-$i.log" 2>&1 &
        pids+=($!)
        servers="${servers:+$servers,}127.0.0.1:2181$i"
    done
    zk_up() { for i in 1 2 3; do echo srvr | timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/2181$i; cat >&3; cat <&3" | grep -q Mode || return 1; done; }
    if wait_for ZooKeeper zk_up; then
        args+=(--zookeeper "$servers")
    fi
fi

# ---- Redis: in memory, and appendfsync always ----
if command -v redis-server >/dev/null; then
    redis-server --port 26379 --bind 127.0.0.1 --save "" --appendonly no --dir "$tmp" >"$tmp/redis.log" 2>&1 &
    pids+=($!)
    redis-server --port 26380 --bind 127.0.0.1 --save "" --appendonly yes --appendfsync always --dir "$tmp" \
        >"$tmp/redis-aof.log" 2>&1 &
    pids+=($!)
    if wait_for Redis redis-cli -p 26379 ping && wait_for "Redis (AOF)" redis-cli -p 26380 ping; then
        args+=(--redis redis://127.0.0.1:26379/ --redis-aof redis://127.0.0.1:26380/)
    fi
fi

# ---- the bench ----
cd "$here"
cargo build --release --quiet
"${CARGO_TARGET_DIR:-$here/target}/release/keyhome-compare" "${args[@]}" "$@"
