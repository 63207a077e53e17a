#!/usr/bin/env bash
# Issue 16, "Keep it so": fault injection over `frag run --world 2` and `frag rewrite`, with the time each
# fault took to surface. Usage: fault_injection_test.sh FRAG LLAMA_TP1_RANK0 (Bazel passes both; by hand:
#   bash tests/faults/fault_injection_test.sh bazel-bin/cli/frag bazel-bin/tests/models/llama_tp1/rank0.pt)
# Faults: a rank SIGKILLed mid-run, a rank SIGSTOPped mid-run, a full disk (/dev/full with --force, and a
# file-size limit), SIGINT/SIGTERM during rewrite, an unreachable rendezvous (closed port) and a silent one
# (a listener that accepts and never answers). Each: non-zero exit, a `frag: error:` line, within a bound.
# FRAG_FAULT_DEVICE=cuda (a machine with 2 GPUs; tools/device/README.md): only the killed and the stalled
# rank, over NCCL (`frag run --device cuda`, one GPU per rank, the watchdog's path), and a rank killed while
# forwards replay from a CUDA graph; the other faults do not depend on the device and run on CPUs.
set -uo pipefail
frag=$(realpath "${1:?usage: $0 FRAG LLAMA_TP1_RANK0}")
tp1=$(realpath "${2:?usage: $0 FRAG LLAMA_TP1_RANK0}")
models=$(dirname "$(dirname "$tp1")")
tp2_0=$models/llama_tp2/rank0.pt
tp2_1=$models/llama_tp2/rank1.pt
for f in "$frag" "$tp1" "$tp2_0" "$tp2_1"; do [ -e "$f" ] || { echo "FAIL: missing $f"; exit 1; }; done
device=${FRAG_FAULT_DEVICE:-cpu}
# A killed peer: Gloo sees its socket close; NCCL reports it gone or the watchdog times the collective out.
killed_pattern='rank 0: error: .*forward failed: .*peer'
[ "$device" = cuda ] && killed_pattern='rank 0: error: .*forward failed: .*(peer|NCCL|timed out|timeout)'
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/faults.XXXXXX")
pids_to_kill=()
cleanup() {
  for p in "${pids_to_kill[@]}"; do kill -KILL "$p" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
echo "1 2 3 4 5 6 7 8" > "$work/ids.txt"

passed=0
failed=0
failures=()
rows=()
ok() { echo "ok: $1"; passed=$((passed + 1)); }
fail() { echo "FAIL: $1"; failed=$((failed + 1)); failures+=("$1"); }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
within() { awk -v t="$1" -v bound="$2" 'BEGIN { exit !(t <= bound) }'; }
first_error() { grep -m1 'error' "$1" | sed -E 's|/[^ :]*/||g' | cut -c1-120; }  # paths as basenames
# row FAULT EXPECTED SECONDS LOG
row() { rows+=("$(printf '%-26s | %-30s | %7s | %s' "$1" "$2" "$3" "$(first_error "$4")")"); }

# Checks one finished fault: exit status non-zero and not a crash signal, a `frag: error:` line, in time.
# check NAME STATUS SECONDS BOUND LOG [PATTERN [ALLOWED_STATUS]] (ALLOWED_STATUS: a signal death that is no
# crash, e.g. the launcher passing on its killed rank's 137)
check() {
  local name=$1 status=$2 seconds=$3 bound=$4 log=$5 pattern=${6:-} allowed=${7:-}
  if [ "$status" -eq 0 ]; then fail "$name: exit 0"; else ok "$name: exit $status"; fi
  if [ "$status" -ge 128 ] && [ "$status" -ne 130 ] && [ "$status" -ne 143 ] && [ "$status" != "$allowed" ]; then
    fail "$name: died of signal $((status - 128)) (a crash?)"; fi
  if grep -qE '^frag: (rank [0-9]+: )?error: ' "$log"; then ok "$name: a frag: error: line"
  else fail "$name: no 'frag: [rank N: ]error:' line"; cat "$log"; fi
  if [ -n "$pattern" ]; then
    if grep -qE "$pattern" "$log"; then ok "$name: message matches /$pattern/"
    else fail "$name: no line matching /$pattern/"; cat "$log"; fi
  fi
  if grep -qE 'terminate called|Aborted|core dumped|std::bad_alloc|EnforceNotMet' "$log"; then
    fail "$name: crash text in the log"; cat "$log"; fi
  if within "$seconds" "$bound"; then ok "$name: surfaced in ${seconds}s <= ${bound}s"
  else fail "$name: took ${seconds}s > ${bound}s"; fi
}

# The rank processes of a launcher (its children), and a child's RANK.
children() { ps -o pid= --ppid "$1" | tr -d ' '; }
rank_of() { tr '\0' '\n' < "/proc/$1/environ" 2>/dev/null | sed -n 's/^RANK=//p'; }
rank_pid() {  # rank_pid LAUNCHER R -> pid of rank R, waiting up to 60 s for it
  local launcher=$1 want=$2 i c
  for i in $(seq 600); do
    for c in $(children "$launcher"); do [ "$(rank_of "$c")" = "$want" ] && { echo "$c"; return 0; }; done
    sleep 0.1
  done
  return 1
}
# Waits (up to 120 s) for a child to finish; sets $status (999: still running, then killed). Bounded: a hang
# is a failure, not a stuck test. (Not in $(...): a subshell cannot wait for its parent's children.)
# With a LOG, also sets $error_at: when the first error line appeared there (the fault surfaced).
wait_bounded() {
  local pid=$1 log=${2:-} i
  error_at=
  for i in $(seq 1200); do
    [ -z "$error_at" ] && [ -n "$log" ] && grep -qE '^frag: (rank [0-9]+: )?error: ' "$log" && error_at=$(now)
    kill -0 "$pid" 2>/dev/null || break; sleep 0.1
  done
  [ -z "$error_at" ] && error_at=$(now)
  if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; status=999; return; fi
  wait "$pid"; status=$?
}

# Mid-run: rank R holds its store connection and its Gloo pair (two sockets or more), then 3 s more.
wait_mid_run() {
  local pid=$1 i
  for i in $(seq 900); do
    [ "$(ls -l "/proc/$pid/fd" 2>/dev/null | grep -c 'socket:')" -ge 2 ] && break; sleep 0.1
  done
  sleep 3
}
# A long run so that a fault lands mid-run: many forwards (rank 0's --out is never written; generation decodes
# from a KV cache now, too fast and bounded by the model's positions), or the extra `frag run` arguments given.
long_run() {  # long_run LOG TIMEOUT [ARGS...] -> launcher pid in $launcher
  local log=$1 timeout=$2
  shift 2
  [ $# -gt 0 ] || set -- --repeat 100000 --out "$work/long.safetensors"
  "$frag" run --world 2 "$tp2_0" "$tp2_1" --input "$work/ids.txt" --timeout "$timeout" --device "$device" "$@" \
    > "$log" 2>&1 &
  launcher=$!
  pids_to_kill+=("$launcher")
}

# A rank SIGKILLed mid-run: the launcher (and the other rank) end non-zero with an error.
# killed_mid_run NAME ROW TIMEOUT LOG [ARGS of long_run...]
killed_mid_run() {
  local name=$1 what=$2 timeout=$3 log=$4
  shift 4
  long_run "$log" "$timeout" "$@"
  if r1=$(rank_pid "$launcher" 1); then
    r0=$(rank_pid "$launcher" 0)
    wait_mid_run "$r1"  # past loading and the rendezvous: the ranks are running
    kill -0 "$launcher" 2>/dev/null || { echo "the run ended before the fault:"; cat "$log"; }
    t0=$(now); kill -KILL "$r1"
    wait_bounded "$launcher" "$log"; t1=$(now)
    s=$(elapsed "$t0" "$t1")
    # The launcher exits as its first failed rank did: 128 + SIGKILL.
    check "$name" "$status" "$s" $((timeout + 10)) "$log" "$killed_pattern" 137
    [ "$status" -eq 137 ] && ok "$name: the launcher exits 137 (its rank 1's death)" \
      || fail "$name: launcher exit $status, expected 137"
    grep -q 'frag: rank 0: error' "$log" && ok "$name: rank 0 printed its error" \
      || fail "$name: rank 0 printed no error"
    if kill -0 "$r0" 2>/dev/null; then fail "$name: rank 0 (pid $r0) still alive"; kill -KILL "$r0"
    else ok "$name: rank 0 ended too"; fi
    row "$what" "error, others end (< ${timeout}s)" "$s" "$log"
  else
    fail "$name: no rank 1 process appeared"; cat "$log"
  fi
}

# (a) A rank SIGKILLed mid-run.
killed_mid_run "killed rank" "rank SIGKILLed mid-run" 20 "$work/a.log"

# (b) A rank SIGSTOPped mid-run: an error once --timeout has passed (not before: it is a stall, not a death).
timeout_b=5
long_run "$work/b.log" "$timeout_b"
if r1=$(rank_pid "$launcher" 1); then
  wait_mid_run "$r1"
  t0=$(now); kill -STOP "$r1"
  wait_bounded "$launcher" "$work/b.log"; t1=$(now)
  kill -CONT "$r1" 2>/dev/null; kill -KILL "$r1" 2>/dev/null
  s=$(elapsed "$t0" "$error_at")
  exit_s=$(elapsed "$t0" "$t1")
  # The error (rank 0's collective timing out) surfaces after --timeout; the launcher then sees that only a
  # paused rank is left and ends it at once (cli/launcher.cpp), so it exits soon after the error.
  check "stalled rank" "$status" "$s" $((timeout_b + 10)) "$work/b.log" 'rank 0: error: .*forward failed: .*(timed out|timeout)'
  if within "$((timeout_b - 1))" "$s"; then ok "stalled rank: not before the timeout (${s}s >= $((timeout_b - 1))s)"
  else fail "stalled rank: the error came after ${s}s, before --timeout $timeout_b"; fi
  within "$exit_s" $((timeout_b + 5)) && ok "stalled rank: the launcher exited after ${exit_s}s" \
    || fail "stalled rank: the launcher exited after ${exit_s}s > $timeout_b + 5"
  grep -q 'frag: rank 1 is paused (stopped by a signal) after another rank failed; ending it' "$work/b.log" \
    && ok "stalled rank: the launcher said it ended the paused rank" \
    || fail "stalled rank: no line about ending the paused rank 1"
  row "rank SIGSTOPped mid-run" "error after --timeout ${timeout_b}s" "$s" "$work/b.log"
  rows+=("$(printf '%-26s | %-30s | %7s | %s' "  (launcher exit)" "<= timeout + 5 s" "$exit_s" "paused rank 1 ended by the launcher")")
else
  fail "stalled rank: no rank 1 process appeared"; cat "$work/b.log"
fi

# (a2) GPUs only: a rank SIGKILLed while the forwards replay from a CUDA graph (`--repeat`: one input, captured
# on its third forward); the marker watched behind each replay fails rank 0 within the timeout.
if [ "$device" = cuda ]; then
  killed_mid_run "killed rank, replaying" "rank SIGKILLed, replaying" 10 "$work/r.log" --repeat 100000
fi

if [ "$device" = cpu ]; then
# (c) A full disk: /dev/full (with --force, a device is written in place) and a 64 KiB file-size limit.
t0=$(now); "$frag" rewrite "$tp1" -o /dev/full --force > "$work/c1.log" 2>&1; status=$?; t1=$(now)
s=$(elapsed "$t0" "$t1")
check "rewrite onto /dev/full" "$status" "$s" 60 "$work/c1.log" '/dev/full: writing failed'
[ -c /dev/full ] && ok "/dev/full is still a device" || fail "/dev/full is no longer a device"
row "rewrite -o /dev/full --force" "clear error" "$s" "$work/c1.log"
mkdir -p "$work/full"
t0=$(now)
/bin/sh -c "trap '' XFSZ; ulimit -f 128; exec \"\$0\" rewrite \"\$1\" -o \"\$2\"" "$frag" "$tp1" "$work/full/out.pt" \
  > "$work/c2.log" 2>&1; status=$?; t1=$(now)
s=$(elapsed "$t0" "$t1")
check "rewrite onto a full disk" "$status" "$s" 60 "$work/c2.log" 'writing failed after'
left=$(ls -A "$work/full")
[ -z "$left" ] && ok "full disk: no output, no X.tmp.* left" || fail "full disk: left behind: $left"
row "rewrite, disk full (ulimit -f)" "clear error, no X.tmp.*" "$s" "$work/c2.log"

# (d) SIGINT/SIGTERM during rewrite: frag stops itself once the temporary is written (fault injection),
# the signal arrives, frag dies of it and leaves nothing.
for sig in INT TERM; do
  mkdir -p "$work/sig$sig"
  FRAG_FAULT_STOP_AFTER_WRITE=1 "$frag" rewrite "$tp1" -o "$work/sig$sig/out.pt" > "$work/d$sig.log" 2>&1 &
  p=$!; pids_to_kill+=("$p")
  for i in $(seq 600); do [ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" = T ] && break; sleep 0.1; done
  if [ -e "$work/sig$sig/out.pt.tmp.$p" ]; then ok "SIG$sig: the temporary exists mid-write"
  else fail "SIG$sig: no temporary out.pt.tmp.$p mid-write ($(ls -A "$work/sig$sig"))"; fi
  t0=$(now); kill -"$sig" "$p"; kill -CONT "$p"
  wait "$p"; status=$?; t1=$(now)
  s=$(elapsed "$t0" "$t1")
  expected=$((128 + $(kill -l "$sig")))
  [ "$status" -eq "$expected" ] && ok "SIG$sig: frag died of the signal ($status)" \
    || fail "SIG$sig: exit $status, expected $expected"
  left=$(ls -A "$work/sig$sig")
  [ -z "$left" ] && ok "SIG$sig: no temporaries left" || fail "SIG$sig: left behind: $left"
  within "$s" 10 && ok "SIG$sig: ended in ${s}s" || fail "SIG$sig: took ${s}s"
  echo "frag: died of SIG$sig (exit $status), left: ${left:-nothing}" > "$work/d$sig.msg"
  rows+=("$(printf '%-26s | %-30s | %7s | %s' "SIG$sig during rewrite" "dies of it, no X.tmp.*" "$s" "$(cat "$work/d$sig.msg")")")
done

# (e) An unreachable rendezvous (a closed port) and a silent one (accepts, never answers): one rank under
# an external launcher's variables, with --timeout 3.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
timeout_e=3
closed=$(free_port)
t0=$(now)
RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$closed \
  timeout 120 "$frag" run "$tp2_0" "$tp2_1" --input "$work/ids.txt" --timeout $timeout_e > "$work/e1.log" 2>&1
status=$?; t1=$(now)
s=$(elapsed "$t0" "$t1")
# Rank 0 hosts the store on that port, so for it the fault is a peer that never comes.
check "rendezvous, no peer (rank 0)" "$status" "$s" $((timeout_e + 10)) "$work/e1.log"
row "rendezvous: peer never comes" "error within --timeout ${timeout_e}s" "$s" "$work/e1.log"
# Rank 1 cannot reach the closed port.
t0=$(now)
RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$closed \
  timeout 120 "$frag" run "$tp2_0" "$tp2_1" --input "$work/ids.txt" --timeout $timeout_e > "$work/e2.log" 2>&1
status=$?; t1=$(now)
s=$(elapsed "$t0" "$t1")
check "unreachable rendezvous" "$status" "$s" $((timeout_e + 10)) "$work/e2.log" 'rendezvous'
row "rendezvous: closed port" "error within --timeout ${timeout_e}s" "$s" "$work/e2.log"

python3 - "$work/silent.port" <<'PY' &
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0)); s.listen(16)
open(sys.argv[1], "w").write(str(s.getsockname()[1]))
held = []
end = time.time() + 150
s.settimeout(1)
while time.time() < end:
    try: held.append(s.accept()[0])  # accept, keep open, never answer
    except socket.timeout: pass
PY
listener=$!; pids_to_kill+=("$listener")
for i in $(seq 100); do [ -s "$work/silent.port" ] && break; sleep 0.1; done
silent=$(cat "$work/silent.port")
for r in 0 1; do
  t0=$(now)
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$silent \
    timeout 120 "$frag" run "$tp2_0" "$tp2_1" --input "$work/ids.txt" --timeout $timeout_e > "$work/e3$r.log" 2>&1
  status=$?; t1=$(now)
  s=$(elapsed "$t0" "$t1")
  [ "$status" -eq 124 ] && fail "silent rendezvous, rank $r: hung until timeout(1) killed it"
  check "silent rendezvous (rank $r)" "$status" "$s" $((timeout_e + 10)) "$work/e3$r.log" 'rendezvous'
  row "rendezvous: silent, rank $r" "error within --timeout ${timeout_e}s" "$s" "$work/e3$r.log"
done
kill "$listener" 2>/dev/null
fi  # the faults that do not depend on the device

echo
echo "Time each fault took to surface (from the fault, or from the start where the fault is there from the start):"
printf '%-26s | %-30s | %7s | %s\n' "fault" "expected" "seconds" "message (first line)"
printf '%s\n' "${rows[@]}"
echo
[ $failed -eq 0 ] || printf 'FAILED: %s\n' "${failures[@]}"
# GoogleTest's summary lines, which tools/summarize_tests.py counts.
echo "[  PASSED  ] $passed tests."
[ $failed -eq 0 ] || echo "[  FAILED  ] $failed tests, listed above"
[ $failed -eq 0 ]
