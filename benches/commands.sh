#!/usr/bin/env bash
# ferry's commands timed as a user times them, against raw TCP measured in the same run: the
# figures the README quotes.
#
#   cargo build --release --workspace --bins && benches/commands.sh [ROUNDS]
#
# Release binaries; nodes started with no flag but the addresses they listen on (--listen
# 127.0.0.1:0, --unix PATH), 10 s before their first command; every command timed from spawn to
# exit as a whole process (start-up, connections, the transfer, the answer). The ceiling is
# `ferry-raw-tcp`: one loopback TCP stream landing into warm memory of the same total size, best
# of three, measured in each round just before its nodes start. Per round (ROUNDS, default 3):
# - model put: `ferry put MODEL A/0`, MODEL a model-shaped .safetensors in /dev/shm (168 bf16
#   tensors of 8 to 23 MiB, 2.3 GiB: 24 layers of four attention and three MLP tensors);
# - model copy: `ferry cp A/0 B/0`, the whole device;
# - 256 MiB copy: `ferry cp A/0/w B/0` of one f32 tensor, once untimed, then the median of 3
#   (B's copy removed, untimed, between them);
# - same host: `ferry cp unix:A/0/w unix:B/1` of that tensor, through shared memory, median of 5,
#   in ms (goal: under 15 ms);
# with the CPU each process spent on the model's put and copy (user + system), and each node's
# peak resident memory (VmHWM). The ratio is raw TCP's time over the command's
# (1.00: as fast as the ceiling). A summary gives each figure's range over the rounds.
set -euo pipefail
ROUNDS=${1:-3}
BIN=${BIN:-$(cd "$(dirname "$0")/.." && pwd)/target/release}
for binary in ferry ferry-server ferry-raw-tcp; do
  [ -x "$BIN/$binary" ] || { echo "$BIN/$binary is missing: run \`cargo build --release --workspace --bins\` first" >&2; exit 2; }
done
WARM_UP=10
SHM=${SHM:-/dev/shm}
# shellcheck source=benches/lib.sh
. "$(dirname "$0")/lib.sh"
d=$(mktemp -d)
files=$(mktemp -d "$SHM/ferry-bench.XXXXXX")
nodes=()
stop_nodes() {
  for pid in "${nodes[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${nodes[@]}"; do wait "$pid" 2>/dev/null || true; done
  nodes=()
}
trap 'stop_nodes; rm -rf "$d" "$files"' EXIT

# start NAME: a node listening on a free port and on $d/NAME.sock; sets ADDR.
start() {
  "$BIN/ferry-server" --listen 127.0.0.1:0 --unix "$d/$1.sock" >"$d/$1.out" 2>"$d/$1.err" &
  nodes+=($!)
  local _
  for _ in $(seq 200); do
    ADDR=$(sed -n 's/^listening on \([0-9.]*:[0-9]*\)$/\1/p' "$d/$1.out")
    [ -n "$ADDR" ] && [ -S "$d/$1.sock" ] && return
    sleep 0.05
  done
  echo "node $1 did not start: $(cat "$d/$1.err")" >&2
  exit 1
}

# quiet COMMAND...: runs it, showing its output only if it fails (which stops the run).
# (Its message goes to descriptor 3, the script's own standard error, from inside a capture.)
exec 3>&2
quiet() { "$@" >"$d/command.out" 2>&1 || { echo "failed: $*" >&3; cat "$d/command.out" >&3; exit 1; }; }

# timed COMMAND...: runs it quietly; prints its wall time in seconds, and leaves the CPU it
# spent (user + system, s) in $d/cpu.
timed() {
  local TIMEFORMAT="%R %U %S" measured
  measured=$( { time quiet "$@"; } 2>&1 ) || exit 1
  read -r wall user system <<<"$measured"
  awk -v u="$user" -v s="$system" 'BEGIN { printf "%.2f", u + s }' >"$d/cpu"
  printf '%s' "$wall"
}

# node_cpu PID: the CPU the process has spent so far, in s.
node_cpu() { awk '{ printf "%.2f", ($14 + $15) / 100 }' "/proc/$1/stat"; }
# spent BEFORE AFTER
spent() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

# median X...
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
# ratio RAW SECONDS: raw TCP's time over the command's.
ratio() { awk -v raw="$1" -v took="$2" 'BEGIN { printf "%.2f", raw / took }'; }
peak() { awk '/^VmHWM/ { printf "%d MiB", $2 / 1024 }' "/proc/$1/status"; }

layers=()
for layer in $(seq 0 23); do
  for w in 0 1 2 3; do layers+=("layers.$layer.w$w:8"); done
  layers+=("layers.$layer.w4:22" "layers.$layer.w5:22" "layers.$layer.w6:23")
done
safetensors "$files/model.safetensors" BF16 2 "${layers[@]}"
safetensors "$files/w.safetensors" F32 4 "w:256"
model_bytes=$(( $(printf '%s\n' "${layers[@]}" | awk -F: '{ s += $2 } END { print s }') << 20 ))
echo "model: ${#layers[@]} bf16 tensors, $(( model_bytes >> 20 )) MiB, in $files; $ROUNDS rounds"

declare -A seen
note() { seen[$1]+="$2 "; }
for round in $(seq "$ROUNDS"); do
  read -r raw_model _ < <("$BIN/ferry-raw-tcp" "$model_bytes" 3)
  read -r raw_w _ < <("$BIN/ferry-raw-tcp" 256MiB 3)
  start a; A=$ADDR; A_PID=${nodes[-1]}
  start b; B=$ADDR; B_PID=${nodes[-1]}
  sleep "$WARM_UP"
  a0=$(node_cpu "$A_PID")
  put=$(timed "$BIN/ferry" put "$files/model.safetensors" "$A/0")
  put_cpu="CLI $(cat "$d/cpu") s, A $(spent "$a0" "$(node_cpu "$A_PID")") s"
  a0=$(node_cpu "$A_PID") b0=$(node_cpu "$B_PID")
  copy=$(timed "$BIN/ferry" cp "$A/0" "$B/0")
  copy_cpu="CLI $(cat "$d/cpu") s, A $(spent "$a0" "$(node_cpu "$A_PID")") s, B $(spent "$b0" "$(node_cpu "$B_PID")") s"
  peaks="A $(peak "$A_PID"), B $(peak "$B_PID")"

  quiet "$BIN/ferry" put "$files/w.safetensors" "unix:$d/a.sock/0"
  quiet "$BIN/ferry" cp "$A/0/w" "$B/0"
  tcp=()
  for _ in 1 2 3; do
    quiet "$BIN/ferry" rm "$B/0/w"
    tcp+=("$(timed "$BIN/ferry" cp "$A/0/w" "$B/0")")
  done
  shm=()
  for _ in 1 2 3 4 5; do
    shm+=("$(timed "$BIN/ferry" cp "unix:$d/a.sock/0/w" "unix:$d/b.sock/1")")
    # Untimed: let B verify the stated hash before its copy is dropped.
    sleep 0.5
    quiet "$BIN/ferry" rm "unix:$d/b.sock/1/w"
  done
  stop_nodes

  tcp_median=$(median "${tcp[@]}")
  shm_ms=$(awk -v s="$(median "${shm[@]}")" 'BEGIN { printf "%.1f", s * 1000 }')
  note put "$(ratio "$raw_model" "$put")"
  note copy "$(ratio "$raw_model" "$copy")"
  note cp256 "$(ratio "$raw_w" "$tcp_median")"
  note shm "$shm_ms"
  echo "round $round: raw TCP $(awk -v b="$model_bytes" -v s="$raw_model" 'BEGIN { printf "%.2f", b / s / 1e9 }') GB/s (model), $(awk -v s="$raw_w" 'BEGIN { printf "%.2f", 268435456 / s / 1e9 }') GB/s (256 MiB)"
  echo "  model put   ${put} s  $(ratio "$raw_model" "$put")x raw TCP  (CPU: $put_cpu)"
  echo "  model copy  ${copy} s  $(ratio "$raw_model" "$copy")x raw TCP  (CPU: $copy_cpu)"
  echo "  nodes' peak resident memory: $peaks"
  echo "  256 MiB cp  ${tcp_median} s  $(ratio "$raw_w" "$tcp_median")x raw TCP  (median of ${tcp[*]})"
  echo "  same host   ${shm_ms} ms  (median of ${shm[*]} s)"
done

range() { printf '%s\n' $1 | sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END { print (lo == hi ? lo : lo "-" hi) }'; }
echo "summary over $ROUNDS rounds:"
echo "  model put to a default node        $(range "${seen[put]}")x raw TCP   (goal 0.8x)"
echo "  model copied whole to another      $(range "${seen[copy]}")x raw TCP   (goal 0.8x)"
echo "  ferry cp of 256 MiB, node to node  $(range "${seen[cp256]}")x raw TCP   (goal 0.9x)"
echo "  ferry cp unix:A unix:B, 256 MiB    $(range "${seen[shm]}") ms   (goal under 15 ms)"
