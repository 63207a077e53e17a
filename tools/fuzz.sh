#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (tools/sanitize.sh's CMake build: clang, ASan + UBSan,
# against the project's PyTorch) and runs each from its seed corpus (tests/fuzz/corpus/<target>).
#   tools/fuzz.sh                 build, then run each target for FRAG_FUZZ_SECONDS (default 20)
#   tools/fuzz.sh --runs N        run each target for N executions instead (the long run: --runs 1000000)
#   tools/fuzz.sh --build-only
# Ends with "fuzz: N targets clean" or names the target and the crashing input (saved under build/fuzz/).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=time; runs=0; seconds=${FRAG_FUZZ_SECONDS:-20}
case "${1:-}" in
  --runs) mode=runs; runs=${2:?--runs N} ;;
  --build-only) mode=build ;;
  "") ;;
  *) echo "usage: tools/fuzz.sh [--runs N | --build-only]"; exit 2 ;;
esac

# The targets come from the sanitized CMake build (tools/sanitize.sh: clang, ASan+UBSan, FRAG_FUZZ=ON).
targets=(plan rules safetensors token_ids archive)
bin=${FRAG_SANITIZE_BUILD:-build/sanitize}/tests/fuzz
out=build/fuzz; mkdir -p "$out"
bash tools/sanitize.sh --build "${targets[@]/%/_fuzzer}" || { echo "fuzz: building the targets failed"; exit 1; }
[ "$mode" = build ] && { echo "fuzz: ${#targets[@]} targets built in $bin"; exit 0; }
status=0
# LibTorch's unpickler allocates what sizes inside a file say before reading on (a memo id can ask for
# 20 GB). frag gets std::bad_alloc and reports a clear error (tests/cli/frag_faults_test:
# AFileWhoseSizesAskForTooMuchMemoryIsAClearError), but under ASan operator new cannot throw: ASan reports
# "out-of-memory" and the process dies like a crash. So the archive target runs in fork mode and keeps
# going past crashes; afterwards each saved input is replayed alone and set aside only if ASan calls it
# out-of-memory or allocation-size-too-big. Any other crash, a hang (timeout-*) or a leak fails the target.
declare -A run_flags=([archive]="-fork=1 -ignore_ooms=1 -ignore_timeouts=0 -ignore_crashes=1")
declare -A replay_crashes=([archive]=1)

export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1  # LibTorch keeps process-lifetime caches
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
passed=0
for t in "${targets[@]}"; do
  work="$out/corpus/$t"; crashes="$out/crashes/$t"; mkdir -p "$work"
  rm -rf "$crashes"; mkdir -p "$crashes"  # this run's findings only
  # The target's scratch folders (tests/fuzz/fuzz_input.h) and libFuzzer's fork-mode jobs under a TMPDIR of its
  # own, removed after it: a child that dies on an input cannot remove its own.
  scratch="$out/tmp/$t"; rm -rf "$scratch"; mkdir -p "$scratch"
  limit=(-max_total_time="$seconds"); [ "$mode" = runs ] && limit=(-runs="$runs")
  log="$out/$t.log"
  # -timeout: an input that takes longer than 10 s is a hang, reported like a crash.
  # A fixed seed (FRAG_FUZZ_SEED, default 1) makes CI's short runs repeatable; FRAG_FUZZ_SEED=0 draws a random one.
  # shellcheck disable=SC2086
  TMPDIR="$scratch" "$bin/${t}_fuzzer" "$work" "tests/fuzz/corpus/$t" "${limit[@]}" -seed="${FRAG_FUZZ_SEED:-1}" -timeout=10 \
       -rss_limit_mb=4096 -max_len=65536 -artifact_prefix="$crashes/" -print_final_stats=1 \
       ${run_flags[$t]:-} > "$log" 2>&1
  rc=$?
  failure=""; set_aside=0
  if [ -n "${replay_crashes[$t]:-}" ]; then
    # Fork mode exits with its last job's code; the verdict is what the saved inputs are.
    grep -q "^INFO: exiting: " "$log" || failure="the fuzzer did not finish (exit $rc)"
    for f in "$crashes"/*; do
      [ -e "$f" ] || continue
      case "$(basename "$f")" in
        crash-*)
          TMPDIR="$scratch" "$bin/${t}_fuzzer" "$f" -rss_limit_mb=4096 > "$f.replay.log" 2>&1
          if grep -qE "^SUMMARY: AddressSanitizer: (out-of-memory|allocation-size-too-big)" "$f.replay.log"; then
            set_aside=$((set_aside + 1))
          else failure="crash on $f"; log="$f.replay.log"; fi ;;
        oom-*) set_aside=$((set_aside + 1)) ;;  # over -rss_limit_mb: the same class, seen by libFuzzer
        *.replay.log) ;;
        *) failure="$(basename "$f" | cut -d- -f1) on $f" ;;
      esac
    done
  elif [ $rc -ne 0 ]; then failure="exit $rc"
  fi
  rm -rf "$scratch"
  if [ -z "$failure" ]; then
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    secs=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    if [ -z "$execs" ]; then  # fork mode prints "#N: cov: ... exec/s R ..." per job instead
      execs=$(sed -n 's/^#\([0-9]*\): cov:.*/\1/p' "$log" | tail -1)
      secs=$(sed -n 's/^#[0-9]*: cov:.* exec\/s \([0-9]*\).*/\1/p' "$log" | tail -1)
    fi
    aside=""; [ $set_aside -gt 0 ] && aside=", $set_aside inputs set aside as out-of-memory (frag reports such files clearly: frag_faults_test)"
    echo "fuzz: $t clean: ${execs:-?} executions (${secs:-?}/s), corpus $(ls "$work" | wc -l) inputs$aside"
    passed=$((passed + 1))
  else
    # The details carry the "fuzz: " prefix so that tools/test_all.sh's summary shows them.
    echo "fuzz: $t FAILED: $failure (log $log, inputs in $crashes):"
    grep -v NEW_FUNC "$log" | grep -E "ERROR|SUMMARY|terminate|what\(\)|^ *#[0-9]+ 0x" | head -12 | sed 's/^/fuzz:   /'
    status=1
  fi
done
rmdir "$out/tmp" 2>/dev/null
[ $status -eq 0 ] && echo "fuzz: ${#targets[@]} targets clean"
# GoogleTest's summary lines, which tools/summarize_tests.py counts (one test per target).
echo "[  PASSED  ] $passed tests."
[ $passed -eq ${#targets[@]} ] || echo "[  FAILED  ] $((${#targets[@]} - passed)) tests, fuzz targets"
exit $status
