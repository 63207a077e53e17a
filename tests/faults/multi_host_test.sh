#!/usr/bin/env bash
# Issue 16, "Keep it so": multi-host for real. Two "hosts", network namespaces joined by a veth pair
# (10.213.0.1/24 and 10.213.0.2/24, made and removed by this test), each running two ranks of a tp=4 model,
# launched the way torchrun launches (RANK, WORLD_SIZE=4, LOCAL_RANK, MASTER_ADDR = host 0, MASTER_PORT),
# each rank `frag run 'DIR/rank{rank}.pt' --input ids --out ...`. Asserts:
#   1. the tp=4 logits equal frag's tp=1 logits (relative 1e-5);
#   2. host 1 cut off mid-run (its veth deleted): every rank exits non-zero with a clear error within the
#      timeout;
#   3. host 1's ranks SIGKILLed mid-run: host 0's ranks exit non-zero with a clear error within the timeout.
# Needs root (CAP_NET_ADMIN); without it the test skips loudly. Usage:
#   multi_host_test.sh FRAG LLAMA_TP1_RANK0 PYTHON   (the venv's python, with safetensors and torch)
set -uo pipefail
frag=$(realpath "${1:?usage: $0 FRAG LLAMA_TP1_RANK0 PYTHON}")
tp1=$(realpath "${2:?usage: $0 FRAG LLAMA_TP1_RANK0 PYTHON}")
python=${3:?usage: $0 FRAG LLAMA_TP1_RANK0 PYTHON}
python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")  # absolute, not resolved: a venv's python is a link
tp4_dir=$(dirname "$(dirname "$tp1")")/llama_tp4
for f in "$frag" "$tp1" "$python" "$tp4_dir"/rank{0,1,2,3}.pt; do [ -e "$f" ] || { echo "FAIL: missing $f"; exit 1; }; done

skip() {
  echo "SKIPPED: multi-host test: $1"
  echo "[  SKIPPED ] 1 tests, multi_host_test: $1"
  exit 0
}
[ "$(id -u)" -eq 0 ] || skip "needs root (CAP_NET_ADMIN) for ip netns; running as uid $(id -u)"
command -v ip > /dev/null || skip "no 'ip' command (iproute2)"

tag=$$
ns0=frag_h0_$tag
ns1=frag_h1_$tag
veth0=fv0_$tag
veth1=fv1_$tag
addr0=10.213.0.1
addr1=10.213.0.2
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/multihost.XXXXXX")
rank_pids=()
cleanup() {
  for p in "${rank_pids[@]}"; do kill -KILL "$p" 2> /dev/null; done
  ip link del "$veth0" 2> /dev/null
  ip netns del "$ns0" 2> /dev/null
  ip netns del "$ns1" 2> /dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if ! ip netns add "$ns0" 2> "$work/netns.err"; then skip "ip netns add failed: $(cat "$work/netns.err")"; fi
ip netns add "$ns1" || skip "ip netns add failed"
ip link add "$veth0" type veth peer name "$veth1" 2> "$work/veth.err" || skip "ip link add veth failed: $(cat "$work/veth.err")"
ip link set "$veth0" netns "$ns0" && ip link set "$veth1" netns "$ns1" || skip "moving veth ends failed"
ip -n "$ns0" addr add $addr0/24 dev "$veth0" && ip -n "$ns1" addr add $addr1/24 dev "$veth1" || skip "addresses"
for ns in "$ns0" "$ns1"; do ip -n "$ns" link set lo up; done
ip -n "$ns0" link set "$veth0" up && ip -n "$ns1" link set "$veth1" up || skip "link up failed"
echo "hosts: $ns0 ($addr0, ranks 0 1) <-veth-> $ns1 ($addr1, ranks 2 3)"

passed=0
failed=0
failures=()
ok() { echo "ok: $1"; passed=$((passed + 1)); }
fail() { echo "FAIL: $1"; failed=$((failed + 1)); failures+=("$1"); }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
within() { awk -v t="$1" -v bound="$2" 'BEGIN { exit !(t <= bound) }'; }

printf '%s\n' "1 5 9 13 17 21 25 29" "2 4 8 16 32 64 128 256" > "$work/ids.txt"
port=29500

# launch TAG TIMEOUT EXTRA...: starts 4 ranks, 2 per host, as torchrun would; pids in rank_pids[0..3].
launch() {
  local name=$1 timeout=$2; shift 2
  rank_pids=()
  port=$((port + 1))
  local r ns host
  for r in 0 1 2 3; do
    if [ $r -lt 2 ]; then ns=$ns0; host=$addr0; else ns=$ns1; host=$addr1; fi
    ip netns exec "$ns" env RANK=$r WORLD_SIZE=4 LOCAL_RANK=$((r % 2)) LOCAL_WORLD_SIZE=2 \
      GROUP_RANK=$((r / 2)) MASTER_ADDR=$addr0 MASTER_PORT=$port FRAG_GLOO_HOSTNAME=$host \
      "$frag" run "$tp4_dir/rank{rank}.pt" --input "$work/ids.txt" --out "$work/$name.safetensors" \
      --timeout "$timeout" "$@" > "$work/$name.rank$r.log" 2>&1 &
    rank_pids+=($!)
  done
}
# wait_rank PID BOUND: sets $status (999 if still running after BOUND seconds, then killed). Not in $(...):
# a subshell cannot wait for its parent's children.
wait_rank() {
  local pid=$1 bound=$2 deadline
  deadline=$(awk -v n="$(now)" -v b="$bound" 'BEGIN { printf "%.0f", n + b }')
  while kill -0 "$pid" 2> /dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.1; done
  if kill -0 "$pid" 2> /dev/null; then kill -KILL "$pid"; wait "$pid" 2> /dev/null; status=999; return; fi
  wait "$pid"; status=$?
}

# 1. tp=4 over two hosts equals tp=1.
"$frag" run --world 1 "$tp1" --input "$work/ids.txt" --out "$work/tp1.safetensors" > "$work/tp1.log" 2>&1 \
  || { cat "$work/tp1.log"; fail "tp=1 reference run failed"; }
t0=$(now)
launch tp4 60
for r in 0 1 2 3; do
  wait_rank "${rank_pids[$r]}" 180
  [ "$status" -eq 0 ] && ok "two hosts, rank $r: exit 0" || { fail "two hosts, rank $r: exit $status"; cat "$work/tp4.rank$r.log"; }
done
t1=$(now)
echo "two hosts x two ranks, tp=4 forward: $(elapsed "$t0" "$t1") s"
if compare=$("$python" - "$work/tp1.safetensors" "$work/tp4.safetensors" <<'PY'
import sys
from safetensors.torch import load_file
ref, got = load_file(sys.argv[1])["logits"].double(), load_file(sys.argv[2])["logits"].double()
assert ref.shape == got.shape, f"shapes differ: tp1 {tuple(ref.shape)}, tp4 {tuple(got.shape)}"
diff = (ref - got).abs()
scale = ref.abs().max().item()
rel = diff.max().item() / scale
elementwise = (diff / ref.abs().clamp_min(1e-3 * scale)).max().item()
print(f"logits {tuple(ref.shape)}: max |tp4 - tp1| = {diff.max().item():.3e}, max|tp1| = {scale:.3e}, "
      f"relative (to max|tp1|) = {rel:.3e}, elementwise relative max = {elementwise:.3e}")
sys.exit(0 if rel <= 1e-5 else 1)
PY
); then ok "tp=4 on two hosts equals tp=1: $compare"; else fail "tp=4 differs from tp=1: $compare"; fi

timing=()
# 2./3. Faults mid-run: many forwards, so that the fault lands while the ranks exchange tensors.
fault_run() {  # fault_run NAME HOW (cut | kill)
  local name=$1 how=$2 timeout=10 r status s t0 t1 i
  launch "$name" $timeout --repeat 100000
  # Mid-run: rank 0 has been running for a while (past loading and the first collectives).
  sleep 8
  for r in 0 1 2 3; do
    kill -0 "${rank_pids[$r]}" 2> /dev/null || { fail "$name: rank $r ended before the fault"; cat "$work/$name.rank$r.log"; }
  done
  t0=$(now)
  if [ "$how" = cut ]; then
    ip -n "$ns1" link del "$veth1"  # deletes both ends: host 1 is cut off
  else
    kill -KILL "${rank_pids[2]}" "${rank_pids[3]}"
  fi
  local survivors=(0 1 2 3)
  [ "$how" = kill ] && survivors=(0 1)
  for r in "${survivors[@]}"; do
    wait_rank "${rank_pids[$r]}" $((timeout + 60))
    t1=$(now); s=$(elapsed "$t0" "$t1")
    local log=$work/$name.rank$r.log
    [ "$status" -ne 0 ] && [ "$status" -ne 999 ] && ok "$name: rank $r exits $status" \
      || fail "$name: rank $r exit $status (999: still running after $((timeout + 60)) s)"
    [ "$status" -lt 128 ] || [ "$status" -eq 999 ] || fail "$name: rank $r died of signal $((status - 128))"
    if grep -qE '^frag: (rank [0-9]+: )?error: ' "$log"; then ok "$name: rank $r printed a frag: error: line"
    else fail "$name: rank $r printed no 'frag: error:' line"; cat "$log"; fi
    grep -qE 'terminate called|Aborted|core dumped' "$log" && { fail "$name: rank $r crashed"; cat "$log"; }
    # The error is the lost peer, not something else (the generation is long, past the fault and the timeout).
    grep -qE 'error: .*(peer|gloo|Connection|timed out)' "$log" && ok "$name: rank $r names the lost peer" \
      || { fail "$name: rank $r's error is not about the lost peer"; cat "$log"; }
    within "$s" $((timeout + 10)) && ok "$name: rank $r ended ${s}s after the fault (<= $((timeout + 10))s)" \
      || fail "$name: rank $r ended ${s}s after the fault (> $((timeout + 10))s)"
    timing+=("$(printf '%-22s | rank %d | %6s | %s' "$name" "$r" "$s" "$(grep -m1 'error' "$log" | sed -E 's|/[^ :]*/||g' | cut -c1-120)")")
  done
}
fault_run host1-cut cut
# Join the hosts again for the kill case.
ip link add "$veth0" type veth peer name "$veth1" && ip link set "$veth0" netns "$ns0" && ip link set "$veth1" netns "$ns1" \
  && ip -n "$ns0" addr add $addr0/24 dev "$veth0" && ip -n "$ns1" addr add $addr1/24 dev "$veth1" \
  && ip -n "$ns0" link set "$veth0" up && ip -n "$ns1" link set "$veth1" up || fail "could not join the hosts again"
fault_run host1-killed kill

echo
echo "Faults on two hosts (--timeout 10): seconds from the fault to each rank's exit"
printf '%-22s | %-6s | %6s | %s\n' "fault" "rank" "seconds" "message (first line)"
printf '%s\n' "${timing[@]}"
echo
[ $failed -eq 0 ] || printf 'FAILED: %s\n' "${failures[@]}"
echo "[  PASSED  ] $passed tests."
[ $failed -eq 0 ] || echo "[  FAILED  ] $failed tests, listed above"
[ $failed -eq 0 ]
