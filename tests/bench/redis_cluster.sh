#!/usr/bin/env bash
# Starts a Redis Cluster of 3 masters + 3 replicas on loopback for benchmarks, prints its
# redis-cluster:// URL, and stops it (and removes its files) on `redis_cluster.sh stop DIR`.
#   url=$(tests/bench/redis_cluster.sh start /tmp/kvd-cluster 30001)   # ports 30001..30006
#   build/tests/bench/kvd_remote_bench --redis="$url"
#   tests/bench/redis_cluster.sh stop /tmp/kvd-cluster
set -euo pipefail
cmd="$1"; dir="$2"
if [ "$cmd" = stop ]; then
  for pidfile in "$dir"/*/redis.pid; do [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true; done
  sleep 0.5
  rm -rf "$dir"
  exit 0
fi
base="${3:-30001}"
addrs=()
for i in 0 1 2 3 4 5; do
  port=$((base + i))
  mkdir -p "$dir/$port"
  redis-server --bind 127.0.0.1 --port "$port" --cluster-enabled yes --cluster-config-file nodes.conf \
    --cluster-node-timeout 1000 --save "" --appendonly no --dir "$dir/$port" --logfile redis.log \
    --pidfile "$dir/$port/redis.pid" --daemonize yes
  addrs+=("127.0.0.1:$port")
done
for i in $(seq 50); do redis-cli -p "$((base + 5))" PING >/dev/null 2>&1 && break; sleep 0.1; done
redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes >/dev/null
for i in $(seq 100); do
  redis-cli -p "$base" CLUSTER INFO | grep -q cluster_state:ok && break
  sleep 0.1
done
(IFS=,; echo "redis-cluster://${addrs[*]}")
