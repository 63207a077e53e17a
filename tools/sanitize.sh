#!/usr/bin/env bash
# The project's own code (and GoogleTest) built with clang under AddressSanitizer and
# UndefinedBehaviorSanitizer, LibTorch as shipped: a CMake build in build/sanitize
# (FRAG_SANITIZE=address,undefined, FRAG_FUZZ=ON, so the libFuzzer targets of tests/fuzz come from it
# too), and the GoogleTest suites run there.
#   tools/sanitize.sh                 build and run the suites of the CI tier (below), build the fuzz targets,
#                                     install the build and build + run tests/cmake_consumer against it
#   tools/sanitize.sh --all           build every target; run every C++ test binary (adds the long CLI suites)
#   tools/sanitize.sh --build [T...]  configure and build only (targets T; default all)
# Prints one line per suite and GoogleTest's summary lines, which tools/summarize_tests.py counts.
# Environment: FRAG_SANITIZE_BUILD (default build/sanitize), FRAG_SANITIZE_CXX (default clang++).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$(bash tools/python_env.sh)
build=${FRAG_SANITIZE_BUILD:-build/sanitize}
cxx=${FRAG_SANITIZE_CXX:-clang++}

# The CI tier: every unit suite, plus frag under faults and bad input (the paths where memory errors
# hide). --all adds the end-to-end CLI and model suites, which Bazel runs unsanitized on every build.
tier=(tests/ir/fragment_rule_test tests/ir/location_table_test tests/ir/head_layout_test tests/ir/digest_test
      tests/passes/classify_parallel_layers_test tests/passes/insert_fragment_ops_test
      tests/passes/remove_fragment_ops_test tests/passes/bind_location_ids_test
      tests/passes/insert_fragment_ops_pt2_test
      tests/runtime/plan_test tests/runtime/intervention_runtime_test tests/runtime/ad_hoc_call_test
      tests/runtime/communicator_test tests/runtime/collective_watchdog_test tests/runtime/whole_value_test
      tests/program/cuda_test tests/examples/api_example_test
      tests/cli/torch2_fixture_test tests/cli/frag_faults_test tests/cli/launcher_test
      tests/support/test_support_test)
# Suites with in-process thread ranks (communicator_test, ad_hoc_call_test) once crashed here inside
# LibTorch's c10d FlightRecorder, which inserts into a map before taking its lock; tests/support turns its
# recording off (TORCH_FR_BUFFER_SIZE=0), so they run in the tier. frag's ranks are processes: no race there.
more=(tests/program/sharded_model_test tests/cli/frag_inspect_test tests/cli/frag_inspect_pt2_test
      tests/cli/frag_rewrite_test
      tests/cli/frag_run_test tests/cli/frag_run_pt2_test)

mode=tier; targets=()
case "${1:-}" in
  --all) mode=all ;;
  --build) mode=build; shift; targets=("$@") ;;
  "") ;;
  *) echo "usage: tools/sanitize.sh [--all | --build [TARGET...]]"; exit 2 ;;
esac

command -v "$cxx" >/dev/null || { echo "sanitize: $cxx not found (tools/install_deps.sh installs clang)"; exit 1; }
mkdir -p "$build"
log="$build/build.log"
# The reference exports the suites read: Bazel's when tools/test_all.sh has built them (the same files,
# and exporting them again would cost CI minutes), else the CMake build exports its own.
exports=OFF; [ -f bazel-bin/tests/models/llama_tp2/rank1.pt ] || exports=ON
# ccache (tools/install_deps.sh) keeps compiled objects across clean clones, like Bazel's disk cache:
# paths under the checkout are hashed relative to it, so a clone elsewhere hits the same entries.
launcher=()
if command -v ccache > /dev/null; then
  export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/fragments/ccache} CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
  export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-10G}
  # Precompiled headers (CMakeLists.txt, FRAG_PCH): ccache caches them and the sources using them only so.
  export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros}
  # Through tools/ccache_launcher.sh: CMake names each PCH's header by its absolute path in the build
  # folder, which ccache does not rewrite; the launcher gives them one path in every clone (its header).
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER="$PWD/tools/ccache_launcher.sh")
fi
# A build folder configured with another launcher (plain ccache, before that script) is brought to it.
if [ -f "$build/build.ninja" ] && [ ${#launcher[@]} -gt 0 ] &&
   ! grep -qE "^CMAKE_CXX_COMPILER_LAUNCHER:[A-Z]+=$PWD/tools/ccache_launcher.sh\$" "$build/CMakeCache.txt"; then
  cmake -S . -B "$build" "${launcher[@]}" > "$log" 2>&1 || rm -f "$build/build.ninja"
fi
if [ ! -f "$build/build.ninja" ]; then
  # -O1 -g1: fast enough to run the suites, line tables for the sanitizers' stack traces; asserts stay on.
  cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CXX_FLAGS_RELEASE="-O1 -g1" -DFRAG_SANITIZE=address,undefined -DFRAG_FUZZ=ON \
        -DFRAG_EXPORT_MODELS=$exports "${launcher[@]}" \
        -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
        -DPython3_EXECUTABLE="$PY" > "$log" 2>&1 ||
    { echo "sanitize: configuring $build failed (log $log):"; tail -30 "$log"
      echo "[  FAILED  ] 1 test, configuring the sanitized build"; exit 1; }
fi
# The CI tier builds what it runs (frag, the example the API test starts, its suites, the fuzz targets);
# --all builds every target of the CMake build. Bazel compiles every source on each run either way.
if [ "$mode" = tier ]; then
  targets=(frag api_example plan_fuzzer rules_fuzzer safetensors_fuzzer token_ids_fuzzer archive_fuzzer)
  for suite in "${tier[@]}"; do targets+=("$(basename "$suite")"); done
fi
target_args=(); for t in "${targets[@]}"; do target_args+=(--target "$t"); done
# ccache's counters before and after, so the log says how much of the build the cache served.
ccache_counts() { command -v ccache > /dev/null && ccache --print-stats 2>/dev/null |
                  awk '$1 ~ /^(direct_cache_hit|preprocessed_cache_hit|cache_miss)$/ {n[$1] = $2}
                       END {print n["direct_cache_hit"] + n["preprocessed_cache_hit"], n["cache_miss"] + 0}'; }
counts_before=$(ccache_counts || true); build_start=$SECONDS
if ! cmake --build "$build" -j"${FRAG_BUILD_JOBS:-2}" "${target_args[@]}" >> "$log" 2>&1; then
  echo "sanitize: building in $build failed (log $log):"; grep -E "error|FAILED" "$log" | head -20
  echo "[  FAILED  ] 1 test, building the sanitized build"; exit 1
fi
if [ -n "$counts_before" ]; then
  read -r hits0 misses0 <<< "$counts_before"; read -r hits1 misses1 <<< "$(ccache_counts)"
  echo "sanitize: build took $((SECONDS - build_start)) s; ccache served $((hits1 - hits0)) objects, compiled $((misses1 - misses0))"
fi
[ "$mode" = build ] && exit 0
if [ "$(sed -n 's/^FRAG_EXPORT_MODELS:BOOL=//p' "$build/CMakeCache.txt")" = OFF ]; then
  [ -f bazel-bin/tests/models/llama_tp2/rank1.pt ] ||
    { echo "sanitize: $build reads Bazel's exports, and bazel-bin/tests/models has none (bazel build //tests/models:all)"
      echo "[  FAILED  ] 1 test, no reference exports"; exit 1; }
  rm -rf "$build/tests/models"; mkdir -p "$build/tests"
  ln -s "$PWD/bazel-bin/tests/models" "$build/tests/models"
fi

suites=("${tier[@]}"); [ "$mode" = all ] && suites+=("${more[@]}")
# Leaks: LibTorch keeps process-lifetime caches, so leak checking would report LibTorch. Every other
# report (use after free, overflow, undefined behaviour) ends the suite with a non-zero exit.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=0:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export FRAG_TEST_DATA=$PWD/$build FRAG_PYTHON=$PY
status=0
for suite in "${suites[@]}"; do
  out="$build/logs/$suite.log"; mkdir -p "$(dirname "$out")"
  start=$SECONDS
  (cd "$build" && "./$suite") > "$out" 2>&1; rc=$?
  summary=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\]' "$out" | tr '\n' ' ')
  if [ $rc -eq 0 ] && ! grep -qE 'ERROR: AddressSanitizer|runtime error:' "$out"; then
    echo "sanitize: $suite clean ($((SECONDS - start)) s): $summary"
  else
    echo "sanitize: $suite FAILED (exit $rc, log $out):"
    # With the "sanitize: " prefix, so that tools/test_all.sh's summary (and CI's log) shows them.
    grep -E -A4 ': Failure$|ERROR: AddressSanitizer|runtime error:|^SUMMARY' "$out" | head -24 | sed 's/^/sanitize:   /'
    # A suite that died before GoogleTest's summary counts as one failed test.
    grep -qE '^\[  FAILED  \]' "$out" || echo "[  FAILED  ] 1 test, $suite ended before its summary"
    status=1
  fi
  # GoogleTest's own summary lines, for tools/summarize_tests.py.
  grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ tests?' "$out"
done
# find_package(fragments) from another project: install this build, then build and run
# tests/cmake_consumer against the installed copy only (its config finds LibTorch where fragments was built).
start=$SECONDS; out="$build/logs/cmake_consumer.log"; prefix="$PWD/$build/install"
rm -rf "$prefix" "$build/consumer"
if { cmake --install "$build" --prefix "$prefix" &&
     cmake -S tests/cmake_consumer -B "$build/consumer" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" \
           -DCMAKE_PREFIX_PATH="$prefix" "${launcher[@]}" &&
     cmake --build "$build/consumer" &&
     "$build/consumer/consumer" "$build/tests/models/llama_tp1/rank0.pt"; } > "$out" 2>&1 &&
   ! grep -qE 'ERROR: AddressSanitizer|runtime error:' "$out"; then
  echo "sanitize: tests/cmake_consumer clean ($((SECONDS - start)) s): $(grep '^consumer: ' "$out")"
  echo "[  PASSED  ] 1 test."
else
  echo "sanitize: tests/cmake_consumer FAILED (log $out):"
  tail -15 "$out" | sed 's/^/sanitize:   /'
  echo "[  FAILED  ] 1 test, tests/cmake_consumer (cmake --install, find_package(fragments))"
  status=1
fi
exit $status
