#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (ASan + UBSan) against the project's PyTorch
# and runs each from its seed corpus (tests/fuzz/corpus/<target>).
#   tools/fuzz.sh                 build, then run each target for FRAG_FUZZ_SECONDS (default 20)
#   tools/fuzz.sh --runs N        run each target for N executions instead (the long run: --runs 1000000)
#   tools/fuzz.sh --build-only
# Ends with "fuzz: N targets clean" or names the target and the crashing input (saved under build/fuzz/).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$(bash tools/python_env.sh)
CXX=${FRAG_FUZZ_CXX:-clang++}
command -v "$CXX" >/dev/null || { echo "fuzz: $CXX not found (tools/install_deps.sh installs clang)"; exit 1; }
mode=time; runs=0; seconds=${FRAG_FUZZ_SECONDS:-20}
case "${1:-}" in
  --runs) mode=runs; runs=${2:?--runs N} ;;
  --build-only) mode=build ;;
  "") ;;
  *) echo "usage: tools/fuzz.sh [--runs N | --build-only]"; exit 2 ;;
esac

torch_dir=$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
out=build/fuzz; mkdir -p "$out/obj"
flags=(-std=c++17 -O1 -g -fno-omit-frame-pointer -D_GLIBCXX_USE_CXX11_ABI=1 -DFMT_HEADER_ONLY
       -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-sanitize=vptr
       -I. -isystem "$torch_dir/include" -isystem "$torch_dir/include/torch/csrc/api/include")
libs=(-L"$torch_dir/lib" -Wl,-rpath,"$torch_dir/lib" -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10 -Wl,--as-needed
      -lpthread)

# Every source a target needs; objects are rebuilt only when their source is newer.
compile() {
  local src=$1 obj="$out/obj/$(echo "$1" | tr / _).o" extra=()
  case "$src" in tests/fuzz/*) extra=(-fsanitize=fuzzer) ;; *) extra=(-fsanitize=fuzzer-no-link) ;; esac
  if [ ! -f "$obj" ] || [ "$src" -nt "$obj" ] || [ -n "$(find ir runtime passes tools tests/fuzz -name '*.h' -newer "$obj" -print -quit)" ]; then
    echo "fuzz: compiling $src" >&2
    "$CXX" "${flags[@]}" "${extra[@]}" -c "$src" -o "$obj" || return 1
  fi
  echo "$obj"
}
declare -A sources=(
  [plan]="runtime/plan.cpp runtime/safetensors.cpp ir/json_file.cpp"
  [rules]="passes/classify_parallel_layers.cpp ir/fragment_rule.cpp ir/fragment_table.cpp ir/json_file.cpp"
  [safetensors]="runtime/safetensors.cpp"
  [token_ids]="tools/token_ids.cpp tools/safe_files.cpp"
  [archive]="runtime/rank_module.cpp runtime/rank_context.cpp runtime/communicator.cpp runtime/gloo_communicator.cpp runtime/nccl_communicator.cpp ir/fragment_rule.cpp"
)
targets=(plan rules safetensors token_ids archive)
# LibTorch's unpickler allocates what sizes inside a file say before reading on (a memo id can ask for
# 20 GB): libFuzzer would report that as out-of-memory, where frag, under any memory limit, reports the
# std::bad_alloc as a clear error (tests/tools/frag_faults_test: AFileWhoseSizes...). So the archive target
# runs in fork mode with such out-of-memory inputs set aside; crashes, hangs and escaping exceptions still fail.
declare -A run_flags=([archive]="-fork=1 -ignore_ooms=1 -ignore_timeouts=0 -ignore_crashes=0")
status=0
# Compile every distinct source first, two at a time (CI has two cores), then link each target.
export -f compile; export CXX out; export FLAGS_STR="${flags[*]}"
all_sources=$(for t in "${targets[@]}"; do echo "tests/fuzz/${t}_fuzzer.cpp ${sources[$t]}"; done | tr ' ' '\n' | sort -u)
# shellcheck disable=SC2016
echo "$all_sources" | xargs -P 2 -I{} bash -c 'flags=($FLAGS_STR); compile {} > /dev/null' ||
  { echo "fuzz: compiling failed"; status=1; }
for t in "${targets[@]}"; do
  objs=()
  for src in tests/fuzz/${t}_fuzzer.cpp ${sources[$t]}; do
    obj=$(compile "$src") || { echo "fuzz: $t: compiling $src failed"; status=1; continue 2; }
    objs+=("$obj")
  done
  "$CXX" "${flags[@]}" -fsanitize=fuzzer "${objs[@]}" "${libs[@]}" -o "$out/${t}_fuzzer" ||
    { echo "fuzz: $t: link failed"; status=1; }
done
[ $status -eq 0 ] || exit $status
[ "$mode" = build ] && { echo "fuzz: ${#targets[@]} targets built in $out"; exit 0; }

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
  if "$out/${t}_fuzzer" "$work" "tests/fuzz/corpus/$t" "${limit[@]}" -seed="${FRAG_FUZZ_SEED:-1}" -timeout=10 \
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
