#!/usr/bin/env bash
# Soak: runs `ferry load` against one release node for MINUTES (default 30) in one-minute rounds
# and fails on any error, any mismatch, any tensor left behind, or resident memory that grows:
# after each round (every tensor deleted) the node's memory must stay within 10% of what it was
# after the first round (which pays for the runtime's one-time allocations).
#
#   tests/soak.sh            # 30 minutes, 256 clients, 4 KiB to 64 MiB
#   tests/soak.sh 5 64       # 5 minutes, 64 clients
set -euo pipefail
cd "$(dirname "$0")/.."
minutes="${1:-30}"
clients="${2:-256}"
cargo build --release -p ferry-server -p ferry-client
dir="$(mktemp -d)"
trap 'kill "$node" 2>/dev/null || true; rm -rf "$dir"' EXIT
target/release/ferry-server --listen 127.0.0.1:0 --device flex --device flex \
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
        --seed "$round" --json > "$dir/round.json" 2> "$dir/round.err"; then
        cat "$dir/round.err" "$dir/round.json"
        echo "soak: FAILED in round $round (errors, mismatches or leftovers above)"
        exit 1
    fi
    after="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["node_resident_after"])' "$dir/round.json")"
    summary="$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(f"{r[\"rounds\"]} rounds, {r[\"gbps\"]:.2f} GB/s, put p99 {r[\"put\"][\"p99_ms\"]:.0f} ms, peak {r[\"node_resident_peak\"]/2**20:.0f} MiB")' "$dir/round.json")"
    baseline="${baseline:-$after}"
    echo "round $round: $summary; resident after $((after / 1048576)) MiB (baseline $((baseline / 1048576)) MiB)"
    if [ "$after" -gt $((baseline + baseline / 10)) ]; then
        echo "soak: FAILED: resident memory grew past baseline + 10%"
        exit 1
    fi
done
echo "soak: passed ($minutes rounds, no error, no mismatch, no growth)"
