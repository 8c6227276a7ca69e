#!/usr/bin/env bash
# One model to many workers where links are the limit: a 1 GiB model (128 bf16 tensors of
# 8 MiB) sent by `ferry cp SOURCE/0 T1/0 ... TN/0` (relayed along a chain) to N = 1, 2, 4 and 8
# targets, each node behind a link limited to RATE each way, timed until every target holds
# it, against the single-target copy and against N copies one after another, in one run.
#
#   cargo build --release --workspace --bins && benches/broadcast.sh [RATE]   # as root
#
# RATE is tc's (default 1gbit). Nine network namespaces (the source and eight targets), each
# with a veth to a bridge in a tenth (the hub, where the CLI runs); tbf limits both directions
# of every node's veth. Nothing appears on the host: every veth is born inside the hub's
# namespace. The nodes listen on 0.0.0.0:7070 with --insecure (their links are private to
# the namespaces) and --pool-ready 256MiB (nine nodes making the default start amount ready
# would take more memory than a small machine has; at these rates a warm pool buys nothing).
# Between runs the targets are restarted, so each run lands into nodes that hold nothing. Goal
# (issue 45): N = 8 within 1.3x the single-target time. Namespaces and nodes are removed on
# every way out.
set -euo pipefail
RATE=${1:-1gbit}
BIN=${BIN:-$(cd "$(dirname "$0")/.." && pwd)/target/release}
# shellcheck source=benches/lib.sh
. "$(dirname "$0")/lib.sh"
[[ $(id -u) -eq 0 ]] || { echo "broadcast.sh makes network namespaces: run it as root" >&2; exit 2; }
for tool in ip tc; do
  command -v "$tool" >/dev/null || { echo "broadcast.sh needs $tool (iproute2)" >&2; exit 2; }
done
for binary in ferry ferry-server; do
  [ -x "$BIN/$binary" ] || { echo "$BIN/$binary is missing: run \`cargo build --release --workspace --bins\` first" >&2; exit 2; }
done

HUB="ferry-hub-$$"
NODES=9
ns() { echo "ferry-n$1-$$"; }
addr() { echo "10.233.0.$(( $1 + 1 ))"; }
work=$(mktemp -d)
created=()
pids=()
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do [ -n "$pid" ] && wait "$pid" 2>/dev/null || true; done
  for n in "${created[@]}"; do ip netns del "$n" 2>/dev/null || true; done
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ip netns add "$HUB"; created+=("$HUB")
ip -n "$HUB" link set lo up
ip -n "$HUB" link add br0 type bridge
ip -n "$HUB" addr add 10.233.0.254/24 dev br0
ip -n "$HUB" link set br0 up
for i in $(seq 0 $((NODES - 1))); do
  n=$(ns "$i")
  ip netns add "$n"; created+=("$n")
  ip -n "$n" link set lo up
  ip -n "$HUB" link add "h$i" type veth peer name "e$i"
  ip -n "$HUB" link set "e$i" netns "$n"
  ip -n "$n" link set "e$i" name eth0
  ip -n "$n" addr add "$(addr "$i")/24" dev eth0
  ip -n "$n" link set eth0 up
  ip -n "$HUB" link set "h$i" master br0
  ip -n "$HUB" link set "h$i" up
  # The node's link, both ways: what it sends (eth0) and what it receives (the hub's end).
  ip netns exec "$n" tc qdisc add dev eth0 root tbf rate "$RATE" burst 512kb latency 100ms
  ip netns exec "$HUB" tc qdisc add dev "h$i" root tbf rate "$RATE" burst 512kb latency 100ms
done

# start I: node I in its namespace, pid in pids[I].
start() {
  local i=$1
  : >"$work/n$i.out"
  env -u FERRY_TOKEN -u FERRY_PEER_TOKEN ip netns exec "$(ns "$i")" "$BIN/ferry-server" \
    --listen 0.0.0.0:7070 --insecure --device flex --pool-ready 256MiB --node-id "n$i" \
    >"$work/n$i.out" 2>"$work/n$i.log" &
  pids[i]=$!
  for _ in $(seq 100); do
    grep -q '^listening on' "$work/n$i.out" && return
    sleep 0.1
  done
  echo "node $i did not start: $(cat "$work/n$i.log")" >&2
  exit 1
}
restart_targets() {
  for i in $(seq 1 $((NODES - 1))); do
    kill "${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
    start "$i"
  done
}
# hub COMMAND...: the CLI, in the hub's namespace.
hub() { env -u FERRY_TOKEN ip netns exec "$HUB" "$BIN/ferry" "$@" >"$work/cli.out" 2>&1 || { cat "$work/cli.out" >&2; exit 1; }; }
seconds() { awk -v ns="$1" 'BEGIN { printf "%.2f", ns / 1e9 }'; }

for i in $(seq 0 $((NODES - 1))); do start "$i"; done
layers=()
for t in $(seq 0 127); do layers+=("t$t:8"); done
safetensors "$work/model.safetensors" BF16 2 "${layers[@]}"
# Put from inside the source's namespace, over its loopback: not through its limited link.
env -u FERRY_TOKEN ip netns exec "$(ns 0)" "$BIN/ferry" put "$work/model.safetensors" 127.0.0.1:7070/0 >/dev/null 2>&1
echo "broadcast: 1 GiB (128 bf16 tensors of 8 MiB), every node's link $RATE each way"

single=""
for n in 1 2 4 8; do
  restart_targets
  targets=()
  for i in $(seq 1 "$n"); do targets+=("$(addr "$i"):7070/0"); done
  started=$(date +%s%N)
  hub cp "$(addr 0):7070/0" "${targets[@]}"
  relayed=$(( $(date +%s%N) - started ))
  [ -n "$single" ] || single=$relayed
  line="  N = $n: relayed $(seconds "$relayed") s, $(awk -v r="$relayed" -v s="$single" 'BEGIN { printf "%.2f", r / s }')x the single-target copy"
  if (( n > 1 )); then
    restart_targets
    started=$(date +%s%N)
    for target in "${targets[@]}"; do hub cp "$(addr 0):7070/0" "$target"; done
    one_by_one=$(( $(date +%s%N) - started ))
    line+="; one after another $(seconds "$one_by_one") s ($(awk -v r="$relayed" -v s="$one_by_one" 'BEGIN { printf "%.2f", r / s }')x of that)"
  fi
  echo "$line"
done
echo "goal: N = 8 within 1.3x the single-target copy"
