#!/usr/bin/env bash
# Soak: runs `ferry load` against one release node for MINUTES (default 30) in one-minute rounds
# and fails on any error, any mismatch, any tensor left behind, or resident memory that grows:
# after each round (every tensor deleted) and 35 s without a request (a node's receive pool
# keeps freed buffers ready until 30 s pass without a receive, then gives back all above its
# idle amount), the node's memory must stay within 10% of what it was after the first round
# (which pays for the runtime's one-time allocations), with a floor of 16 MiB.
#
#   tests/soak.sh            # 30 minutes, 256 clients, 4 KiB to 64 MiB
#   tests/soak.sh 5 64       # 5 minutes, 64 clients
set -euo pipefail
cd "$(dirname "$0")/.."
minutes="${1:-30}"
clients="${2:-256}"
cargo build --release --bins
dir="$(mktemp -d)"
trap 'kill "$node" 2>/dev/null || true; rm -rf "$dir"' EXIT
# Every client comes from one address, and the generator adds a connection of its own (its
# memory sampler): room for them all beyond the default per-address share (256).
target/release/ferry-server --listen 127.0.0.1:0 --device flex --device flex \
    --max-connections-per-address 1024 \
    > "$dir/node.out" 2> "$dir/node.err" &
node=$!
for _ in $(seq 50); do
    grep -q "listening on" "$dir/node.out" 2>/dev/null && break
    sleep 0.1
done
addr="$(head -1 "$dir/node.out" | sed 's/^listening on //')"
echo "soak: node $addr, $clients clients, $minutes one-minute rounds"
baseline=""
for round in $(seq "$minutes"); do
    if ! target/release/ferry load "$addr" --clients "$clients" --seconds 60 \
        --seed "$round" --warmup-rounds 0 --json > "$dir/round.json" 2> "$dir/round.err"; then
        cat "$dir/round.err" "$dir/round.json"
        echo "soak: FAILED in round $round (errors, mismatches or leftovers above)"
        exit 1
    fi
    summary="$(python3 - "$dir/round.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("%d rounds, %.2f GB/s, put p99 %.0f ms, peak %.0f MiB" % (
    r["rounds"], r["gbps"], r["put"]["p99_ms"], r["node_resident_peak"] / 2**20))
PY
)"
    sleep 35
    after="$(target/release/ferry stat "$addr" --json \
        | python3 -c 'import json, sys; print(json.load(sys.stdin)["resident_bytes"])')"
    baseline="${baseline:-$after}"
    echo "round $round: $summary; resident after $((after / 1024)) KiB (baseline $((baseline / 1024)) KiB)"
    allowed=$((baseline / 10))
    if [ "$allowed" -lt $((16 * 1048576)) ]; then allowed=$((16 * 1048576)); fi
    if [ "$after" -gt $((baseline + allowed)) ]; then
        echo "soak: FAILED: resident memory grew past the baseline by more than $((allowed / 1048576)) MiB"
        exit 1
    fi
done
echo "soak: passed ($minutes rounds, no error, no mismatch, no growth)"
