#!/usr/bin/env bash
# Runs every ferry fuzz target (or those named) for SECONDS each (default 600), one after the
# other, starting from the checked-in seeds. Needs the nightly toolchain and cargo-fuzz
# (`cargo install cargo-fuzz`). A finding stops the run and leaves its input under
# tests/fuzz/artifacts/TARGET/; fix it and add a regression test that replays it.
#
#   tests/fuzz/run.sh            # every target, 10 minutes each
#   tests/fuzz/run.sh 60 frame   # one target, one minute
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds="${1:-600}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(frame dtype meta bpk)
fi
for target in "${targets[@]}"; do
    corpus="tests/fuzz/corpus/$target"
    mkdir -p "$corpus"
    echo "== fuzzing $target for ${seconds}s"
    cargo +nightly fuzz run --fuzz-dir tests/fuzz "$target" "$corpus" "tests/fuzz/seeds/$target" \
        -- -max_total_time="$seconds" -rss_limit_mb=4096 -timeout=20 -print_final_stats=1
done
echo "== no findings"
