#!/usr/bin/env bash
# On the GPU machine (PyTorch pip wheel with CUDA, CMake + Ninja, no Bazel, no
# network): configures the CMake build against the wheel's LibTorch, builds it
# with all cores, runs ctest and prints a summary. Needs .deps/ from
# tools/device/stage_deps.sh (carried with the working tree).
#
# Usage: tools/device/build_and_test.sh [extra cmake -D arguments...]
# Environment:
#   FRAG_PYTHON     Python with torch (default: python3 on PATH)
#   FRAG_BUILD_DIR  build folder (default: build/device)
#   FRAG_DEPS_DIR   dependency copies (default: .deps)
#   CTEST_ARGS      extra ctest arguments, e.g. "-R frag_run" (default: none)
#   FRAG_BUILD_TARGETS  build only these targets (space-separated; default: all)
#   OUT             where logs are copied when set (the device tool's output folder)
# Exit status: 0 when configure, build and every test pass.
set -uo pipefail
cd "$(dirname "$0")/../.."
root="$(pwd)"

PY="${FRAG_PYTHON:-$(command -v python3)}"
BUILD="${FRAG_BUILD_DIR:-build/device}"
DEPS="${FRAG_DEPS_DIR:-.deps}"
JOBS="$(nproc)"
mkdir -p "$BUILD"
LOGS="$BUILD/logs"
mkdir -p "$LOGS"

save_logs() {
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/logs"
    cp -f "$LOGS"/*.log "$OUT/logs/" 2> /dev/null || true
    cp -f "$BUILD/Testing/Temporary/LastTest.log" "$OUT/logs/ctest_last.log" 2> /dev/null || true
  fi
}
fail() {
  echo "build_and_test: $*" >&2
  save_logs
  exit 1
}

echo "== environment"
echo "host $(hostname), $(nproc) cores; python $PY"
"$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' ||
  fail "$PY cannot import torch (set FRAG_PYTHON)"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -8
cmake --version | head -1
ninja --version 2> /dev/null | sed 's/^/ninja /' || fail "ninja not found"
[ -d "$DEPS" ] || echo "build_and_test: warning: $DEPS is missing (run tools/device/stage_deps.sh where the packages are)" >&2

prefix="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')"

# The wheel's CMake config enables CUDA itself (nvcc from the toolkit).
if [ -d /usr/local/cuda/bin ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
# Skip Caffe2's GPU-architecture probing; torch's CMake config turns this list into the -gencode flags of
# the one CUDA file the build compiles (runtime/layer_ops_cuda.cu: sm_90a for 9.0).
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"

args=(
  -G Ninja
  -DCMAKE_BUILD_TYPE=Release
  "-DCMAKE_PREFIX_PATH=$prefix"
  "-DFRAG_PYTHON=$PY"
)
[ -d "$DEPS" ] && args+=("-DFRAG_DEPS_DIR=$root/$DEPS")
if [ -x "$CUDA_HOME/bin/nvcc" ]; then
  args+=("-DCMAKE_CUDA_COMPILER=$CUDA_HOME/bin/nvcc" "-DCMAKE_CUDA_ARCHITECTURES=${FRAG_CUDA_ARCHITECTURES:-90}")
fi

echo "== configure ($BUILD)"
if ! cmake -S . -B "$BUILD" "${args[@]}" "$@" > "$LOGS/configure.log" 2>&1; then
  tail -60 "$LOGS/configure.log"
  fail "configure failed (log: $LOGS/configure.log)"
fi
sed -n '/fragments configuration:/,/FRAG_WITH_C10_CUDA/p' "$LOGS/configure.log"
grep -A10 'CMake Warning' "$LOGS/configure.log" | head -40

echo "== build (-j$JOBS)"
start=$(date +%s)
targets=()
# shellcheck disable=SC2206
[ -n "${FRAG_BUILD_TARGETS:-}" ] && targets=(--target ${FRAG_BUILD_TARGETS})
if ! cmake --build "$BUILD" -j "$JOBS" "${targets[@]}" > "$LOGS/build.log" 2>&1; then
  grep -n -E 'error|FAILED' "$LOGS/build.log" | head -40
  tail -30 "$LOGS/build.log"
  fail "build failed (log: $LOGS/build.log)"
fi
echo "built in $(( $(date +%s) - start )) s; $(grep -c 'warning:' "$LOGS/build.log") compiler warnings"

echo "== ctest"
# shellcheck disable=SC2086
(cd "$BUILD" && ctest --output-on-failure ${CTEST_ARGS:-}) > "$LOGS/ctest.log" 2>&1
ctest_rc=$?
grep -E '^ *[0-9]+/[0-9]+ Test|tests passed|Total Test time' "$LOGS/ctest.log"

echo "== summary"
"$PY" - "$BUILD/Testing/Temporary/LastTest.log" <<'EOF'
"""Per ctest entry: status and test cases (GoogleTest or unittest), then one total line."""
import re
import sys

try:
    text = open(sys.argv[1], errors="replace").read()
except OSError:
    print("no ctest log"); sys.exit(0)
totals = [0, 0, 0]
for block in re.split(r"\n(?=\d+/\d+ Testing: )", text):
    m = re.match(r"\d+/\d+ Testing: (\S+)", block)
    if not m:
        continue
    name = m.group(1)
    passed_entry = "Test Passed." in block
    p = f = s = 0
    found = False
    for x in re.findall(r"^\[  PASSED  \] (\d+) tests?", block, re.M): p += int(x); found = True
    for x in re.findall(r"^\[  FAILED  \] (\d+) tests?,", block, re.M): f += int(x); found = True
    for x in re.findall(r"^\[  SKIPPED \] (\d+) tests?,", block, re.M): s += int(x); found = True
    ran = re.search(r"^Ran (\d+) tests? in", block, re.M)
    if ran:
        found = True
        bad = sum(int(x) for x in re.findall(r"(?:failures|errors)=(\d+)", block))
        skip = sum(int(x) for x in re.findall(r"skipped=(\d+)", block))
        p += int(ran.group(1)) - bad - skip; f += bad; s += skip
    if not found or (not passed_entry and f == 0):
        f += 1  # crashed, timed out or did not start
    totals[0] += p; totals[1] += f; totals[2] += s
    failed_cases = re.findall(r"^\[  FAILED  \] (\S+)", block, re.M)
    failed_cases = sorted(set(c for c in failed_cases if not re.match(r"\d+$", c)))
    print("%-44s %-4s %4d passed, %d failed, %d skipped%s" % (
        name, "PASS" if passed_entry else "FAIL", p, f, s,
        ("  [" + ", ".join(failed_cases[:8]) + (" ..." if len(failed_cases) > 8 else "") + "]") if failed_cases else ""))
print("%d passed, %d failed, %d skipped" % tuple(totals))
EOF
save_logs
exit $ctest_rc
