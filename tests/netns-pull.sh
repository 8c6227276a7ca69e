#!/usr/bin/env bash
# A node-to-node copy of a model between two network namespaces over a lossy, delayed veth link.
#
# usage: tests/netns-pull.sh [FERRY_SERVER] [FERRY_CLI] MODEL.bpk OUT.bpk
#   FERRY_SERVER  the ferry-server binary (default target/debug/ferry-server)
#   FERRY_CLI     the ferry command line  (default target/debug/ferry)
#   MODEL.bpk     the tensors to send; OUT.bpk receives them back from the far node
#
# Node A runs in one namespace on 10.231.0.1, node B in another on 10.231.0.2; the only link
# between them is a veth pair with `netem delay 5ms loss 0.5%` on both ends. From inside A's
# namespace the CLI puts the model on A, has B pull it from A (`ferry cp`: the bytes cross the
# lossy link node to node), and gets it back from B into OUT.bpk (crossing it again). Comparing
# OUT with MODEL is the caller's job (tests/netns.rs).
#
# Nothing outside the two namespaces this script creates is touched: the veth pair is created
# inside A's namespace and one end moved into B's, so no interface ever appears on the host.
# Where it cannot run (not root, no ip or tc, no network namespaces, no netem) it prints a line
# starting with "skipping:" and exits 0. The whole run is bounded by FERRY_NETNS_TIMEOUT seconds
# (default 120), and the namespaces and nodes are removed on every way out.
set -euo pipefail

SERVER=${1:-target/debug/ferry-server}
FERRY=${2:-target/debug/ferry}
MODEL=${3:?usage: $0 [FERRY_SERVER] [FERRY_CLI] MODEL.bpk OUT.bpk}
OUT=${4:?usage: $0 [FERRY_SERVER] [FERRY_CLI] MODEL.bpk OUT.bpk}
LIMIT=${FERRY_NETNS_TIMEOUT:-120}
DEADLINE=$((SECONDS + LIMIT))

NS_A="ferry-a-$$"
NS_B="ferry-b-$$"
ADDR_A=10.231.0.1
ADDR_B=10.231.0.2
WORK=""
PID_A=""
PID_B=""
CREATED=()

skip() {
	echo "skipping: $*"
	exit 0
}

fail() {
	echo "netns-pull: $*" >&2
	exit 1
}

# Seconds left before the deadline; a step that would start past it fails instead.
left() {
	local left=$((DEADLINE - SECONDS))
	((left > 0)) || fail "out of time (FERRY_NETNS_TIMEOUT=${LIMIT}s)"
	echo "$left"
}

stop() {
	local pid=$1
	[[ -n $pid ]] || return 0
	kill -TERM "$pid" 2>/dev/null || return 0
	# The nodes get a short shutdown grace; past it they are killed outright.
	for _ in $(seq 50); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	kill -KILL "$pid" 2>/dev/null || true
	wait "$pid" 2>/dev/null || true
}

cleanup() {
	local status=$?
	trap - EXIT INT TERM
	stop "$PID_A"
	stop "$PID_B"
	# Deleting a namespace also destroys the veth end inside it, and with it the pair.
	for ns in "${CREATED[@]}"; do
		ip netns del "$ns" 2>/dev/null || true
	done
	if ((status != 0)) && [[ -n $WORK ]]; then
		for log in "$WORK"/*.log; do
			[[ -s $log ]] && { echo "--- $log" >&2; tail -n 20 "$log" >&2; }
		done
	fi
	[[ -n $WORK ]] && rm -rf "$WORK"
	exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

[[ $(id -u) -eq 0 ]] || skip "needs root to create network namespaces"
command -v ip >/dev/null 2>&1 || skip "no ip (iproute2)"
command -v tc >/dev/null 2>&1 || skip "no tc (iproute2)"
command -v timeout >/dev/null 2>&1 || skip "no timeout (coreutils)"
[[ -x $SERVER ]] || fail "$SERVER is not an executable ferry-server"
[[ -x $FERRY ]] || fail "$FERRY is not an executable ferry CLI"
[[ -f $MODEL ]] || fail "$MODEL does not exist"

WORK=$(mktemp -d)

for ns in "$NS_A" "$NS_B"; do
	ip netns add "$ns" 2>"$WORK/netns.err" || skip "cannot create network namespaces: $(head -n1 "$WORK/netns.err")"
	CREATED+=("$ns")
	ip -n "$ns" link set lo up
done
# Both ends are born inside A's namespace; one moves to B's. The host never sees either.
ip -n "$NS_A" link add veth-a type veth peer name veth-b 2>"$WORK/veth.err" ||
	skip "cannot create a veth pair: $(head -n1 "$WORK/veth.err")"
ip -n "$NS_A" link set veth-b netns "$NS_B"
ip -n "$NS_A" addr add "$ADDR_A/30" dev veth-a
ip -n "$NS_B" addr add "$ADDR_B/30" dev veth-b
ip -n "$NS_A" link set veth-a up
ip -n "$NS_B" link set veth-b up
ip netns exec "$NS_A" tc qdisc add dev veth-a root netem delay 5ms loss 0.5% 2>"$WORK/tc.err" ||
	skip "cannot add a netem qdisc: $(head -n1 "$WORK/tc.err")"
ip netns exec "$NS_B" tc qdisc add dev veth-b root netem delay 5ms loss 0.5%

# Starts a node in namespace $1 on address $2; its pid goes to PID_$3 and its address to ADDR_$3.
start_node() {
	local ns=$1 addr=$2 name=$3 line=""
	# `ip netns exec` execs the command, so $! is the node itself.
	env -u FERRY_TOKEN -u FERRY_PEER_TOKEN ip netns exec "$ns" "$SERVER" \
		--listen "$addr:0" --insecure --device flex --node-id "netns-$name" --shutdown-grace 2 \
		>"$WORK/$name.out" 2>"$WORK/$name.log" &
	printf -v "PID_$name" '%s' "$!"
	# The first stdout line is exactly `listening on ADDR`.
	for _ in $(seq 300); do
		line=$(head -n1 "$WORK/$name.out" 2>/dev/null || true)
		[[ $line == "listening on "* ]] && break
		kill -0 "$!" 2>/dev/null || fail "node $name exited before listening"
		((SECONDS < DEADLINE)) || fail "node $name did not start in time"
		sleep 0.1
	done
	[[ $line == "listening on "* ]] || fail "node $name did not start"
	printf -v "LISTEN_$name" '%s' "${line#listening on }"
}

start_node "$NS_A" "$ADDR_A" A
start_node "$NS_B" "$ADDR_B" B
echo "node A on $LISTEN_A (namespace $NS_A), node B on $LISTEN_B (namespace $NS_B)"

# The CLI runs in A's namespace: A is local to it, B is across the link.
cli() {
	local seconds
	seconds=$(left)
	env -u FERRY_TOKEN timeout --kill-after=5 "$seconds" ip netns exec "$NS_A" "$FERRY" "$@"
}

started=$SECONDS
cli put "$MODEL" "$LISTEN_A/0"
cli cp "$LISTEN_A/0" "$LISTEN_B/0"
cli get "$LISTEN_B/0" -o "$OUT"
echo "done in $((SECONDS - started)) s: $(stat -c %s "$MODEL") model bytes pulled A -> B and read back"
