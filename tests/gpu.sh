#!/usr/bin/env bash
# GPU checks for a machine with a real GPU (or, without one, Mesa's software adapters):
#   1. the sample matrix against the adapter: put, get, flex <-> GPU copies both ways, refusals
#      (the `gpu::` integration tests, on FERRY_GPU's spec);
#   2. the holds table the device measured, as `ferry stat --holds` prints it;
#   3. the put/get benchmark against Burn's own from_data/into_data (`benches/gpu.rs`).
#
#   FERRY_GPU=vulkan:0 tests/gpu.sh        # default: wgpu:0 (the first discrete GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
export FERRY_GPU=${FERRY_GPU:-wgpu:0}
echo "== GPU device $FERRY_GPU"
# GPU devices are the node's `wgpu` feature (off in a plain build; the tests turn it on).
cargo build --release --workspace --bins --features ferry-server-cli/wgpu
echo "== the sample matrix on $FERRY_GPU"
cargo test --workspace --test it -- gpu:: --include-ignored --nocapture
echo "== what $FERRY_GPU holds"
log=$(mktemp)
target/release/ferry-server --listen 127.0.0.1:0 --device flex --device "$FERRY_GPU" >"$log" 2>&1 &
node=$!
trap 'kill $node 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 600); do grep -q "^listening on" "$log" && break; sleep 0.1; done
addr=$(sed -n 's/^listening on //p' "$log")
[ -n "$addr" ] || { cat "$log"; exit 1; }
grep "measured what it holds" "$log" || true
target/release/ferry stat "$addr" --holds
kill $node
echo "== put/get against Burn's own calls"
cargo bench --workspace --bench gpu
