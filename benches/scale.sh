#!/usr/bin/env bash
# benches/scale.sh: the node-to-node, model-load and model-store benchmarks on two of this
# machine's cores and on all of them, side by side: what more cores buy ferry (content hashes
# computed on every free core, tensors in flight over several lanes), each figure a ratio
# against raw TCP measured in the same run. Run it on a machine with many cores; on two, both
# rows are the same machine.
#
#   benches/scale.sh              # all three (about 10 minutes each, after the build)
#   benches/scale.sh node_to_node # one of them
#
# Each run's whole output goes to target/scale/BENCH-CORES.log; the lines with ratios, CPU and
# memory are printed here. `taskset` pins the bench and the nodes it starts (its children) to
# the cores named.
set -euo pipefail
cd "$(dirname "$0")/.."

benches=("$@")
[ ${#benches[@]} -gt 0 ] || benches=(node_to_node model_load model_store)
all=$(nproc)
command -v taskset > /dev/null || { echo "scale.sh needs taskset (util-linux)" >&2; exit 1; }

# The nodes the benches start are the release binaries beside them.
cargo build --release --workspace --bins
for bench in "${benches[@]}"; do
  cargo bench -p ferry-suite --bench "$bench" --no-run
done

mkdir -p target/scale
# The first two cores this process may use, and all of them (a cpuset need not start at 0).
allowed=$(taskset -cp $$ | sed 's/.*: //')
mapfile -t cpus < <(python3 -c "
import os; c=sorted(os.sched_getaffinity(0)); print(f'{c[0]},{c[1]}' if len(c)>1 else c[0]); print(len(c))")
sets=("${cpus[0]}")
[ "${cpus[1]}" -gt 2 ] && sets+=("$allowed")
for bench in "${benches[@]}"; do
  for set in "${sets[@]}"; do
    n=$(taskset -c "$set" nproc)
    log="target/scale/$bench-$n.log"
    echo "== $bench on $n of $all cores (taskset -c $set) -> $log"
    taskset -c "$set" cargo bench -p ferry-suite --bench "$bench" > "$log" 2>&1 || {
      echo "   failed: see $log" >&2
      continue
    }
    grep -E "raw TCP|ceiling|CPU per copy|peak|resident|goal" "$log" | sed 's/^/   /'
  done
done
