#!/usr/bin/env bash
# The test command: builds everything with Bazel (and with CMake, so neither build rots),
# runs every test with Bazel and ends with one line "N passed, N failed, N skipped".
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$(bash tools/python_env.sh)  # the project's Python (tools/install_deps.sh); its torch is the LibTorch of both builds

status=0
echo "== bazel build //..."
bazel build //... 2>&1 | grep -v -E 'linux-sandbox|^ *(exec env|PATH=|PWD=|TMPDIR=)' || status=1

if [ "${FRAG_SKIP_CMAKE:-0}" != 1 ]; then
  echo "== cmake build (LibTorch from find_package(Torch))"
  mkdir -p build
  # -O1 as Bazel builds: here CMake's build is a check that it compiles and links (Bazel runs the tests),
  # and -O3 would double its time on CI's two cores.
  if cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" \
        -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
        -DPython3_EXECUTABLE="$PY" > build/cmake.log 2>&1 &&
     cmake --build build/cmake -j2 >> build/cmake.log 2>&1; then
    echo "cmake build OK (log: build/cmake.log)"
  else
    echo "cmake build FAILED (log: build/cmake.log):"; tail -40 build/cmake.log; status=1
  fi
fi

echo "== bazel test //..."
labels=$(bazel query 'tests(//...)' 2>/dev/null | sed 's|^//||; s|:|/|')
bazel test //... --test_output=errors 2>&1 | grep -v -E 'linux-sandbox|^ *(exec env|PATH=|PWD=|TMPDIR=)'

# Fuzz targets (clang, ASan+UBSan; not a Bazel toolchain): built, then each run from its seed corpus
# for FRAG_FUZZ_SECONDS (bounded; the long runs are recorded in tools/bench/README.md). Counted as tests.
echo "== fuzz (tools/fuzz.sh, ${FRAG_FUZZ_SECONDS:=15} s per target)"
mkdir -p build
FRAG_FUZZ_SECONDS=$FRAG_FUZZ_SECONDS bash tools/fuzz.sh > build/fuzz.log 2>&1
grep -E '^fuzz: [a-z_]+ (clean|FAILED)|^fuzz: .*failed' build/fuzz.log
"$PY" tools/summarize_tests.py "$(bazel info bazel-testlogs 2>/dev/null)" $labels --log build/fuzz.log || status=1
exit $status
