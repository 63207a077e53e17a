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
# 20 GB): libFuzzer would report that as out-of-memory, where frag, under any memory limit, reports the
# std::bad_alloc as a clear error (tests/tools/frag_faults_test: AFileWhoseSizes...). So the archive target
# runs in fork mode with such out-of-memory inputs set aside; crashes, hangs and escaping exceptions still fail.
declare -A run_flags=([archive]="-fork=1 -ignore_ooms=1 -ignore_timeouts=0 -ignore_crashes=0")

export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1  # LibTorch keeps process-lifetime caches
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
passed=0
for t in "${targets[@]}"; do
  work="$out/corpus/$t"; mkdir -p "$work" "$out/crashes/$t"
  limit=(-max_total_time="$seconds"); [ "$mode" = runs ] && limit=(-runs="$runs")
  log="$out/$t.log"
  # -timeout: an input that takes longer than 10 s is a hang, reported like a crash.
  # A fixed seed (FRAG_FUZZ_SEED, default 1) makes CI's short runs repeatable; FRAG_FUZZ_SEED=0 draws a random one.
  # shellcheck disable=SC2086
  if "$bin/${t}_fuzzer" "$work" "tests/fuzz/corpus/$t" "${limit[@]}" -seed="${FRAG_FUZZ_SEED:-1}" -timeout=10 \
       -rss_limit_mb=4096 -max_len=65536 -artifact_prefix="$out/crashes/$t/" -print_final_stats=1 \
       ${run_flags[$t]:-} > "$log" 2>&1; then
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    secs=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    if [ -z "$execs" ]; then  # fork mode prints "#N: cov: ... exec/s R ..." per job instead
      execs=$(sed -n 's/^#\([0-9]*\): cov:.*/\1/p' "$log" | tail -1)
      secs=$(sed -n 's/^#[0-9]*: cov:.* exec\/s \([0-9]*\).*/\1/p' "$log" | tail -1)
    fi
    echo "fuzz: $t clean: ${execs:-?} executions (${secs:-?}/s), corpus $(ls "$work" | wc -l) inputs"
    passed=$((passed + 1))
  else
    echo "fuzz: $t FAILED (log $log, inputs in $out/crashes/$t):"; grep -E "ERROR|SUMMARY|terminate|what\(\)" "$log" | head -5
    status=1
  fi
done
[ $status -eq 0 ] && echo "fuzz: ${#targets[@]} targets clean"
# GoogleTest's summary lines, which tools/summarize_tests.py counts (one test per target).
echo "[  PASSED  ] $passed tests."
[ $passed -eq ${#targets[@]} ] || echo "[  FAILED  ] $((${#targets[@]} - passed)) tests, fuzz targets"
exit $status
