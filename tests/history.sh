#!/usr/bin/env bash
# History: runs the long randomized history test of tests/it/concurrency.rs (clients racing on
# shared keys of two nodes, checked for phantom and stale reads and lost acknowledged writes) in
# release mode for SECONDS with CLIENTS clients (default 8) from SEED (default 1).
#
#   tests/history.sh 60          # a minute, 8 clients, seed 1
#   tests/history.sh 600 16 7    # ten minutes, 16 clients, seed 7
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 1 || $# -gt 3 ]]; then
    echo "usage: $0 SECONDS [CLIENTS] [SEED]" >&2
    exit 2
fi
export FERRY_HISTORY_SECS="$1"
export FERRY_HISTORY_CLIENTS="${2:-8}"
export FERRY_HISTORY_SEED="${3:-1}"
exec cargo test --release -p ferry-suite --test it concurrency::long_random_history -- --ignored --nocapture
