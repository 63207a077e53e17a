#!/usr/bin/env bash
# fragments' vLLM plugin on the GPU machine, after tools/device/vllm_stage.sh has installed vLLM there.
#
#   bash tools/device/vllm_run.sh build            builds fragments._C (CMake, only that target) from a copy of
#                                                  this checkout in $HOME/fsrc into $HOME/fbuild (copy, then
#                                                  compile; the first staging call copies and starts compile in
#                                                  the background)
#   bash tools/device/vllm_run.sh wait             waits for that build, prints its log's end
#   bash tools/device/vllm_run.sh CMD ARGS...      runs CMD with the built package on PYTHONPATH: the checkout's
#                                                  python/fragments (this call's sources) beside the built _C (the
#                                                  checks and benchmarks declare the plugin's entry points
#                                                  themselves: tests/python/vllm_plugin/vllm_check.py plugin_dist)
# e.g.  bash tools/device/vllm_run.sh python3 tests/python/vllm_plugin/gpu_suite.py --jobs 6
set -uo pipefail
cd "$(dirname "$0")/../.."
FBUILD=${FRAG_BUILD_DIR:-$HOME/fbuild}
FSRC=$HOME/fsrc

copy() {
  # the build reads a copy: the checkout here is replaced by every device call (and .deps removed when a call
  # does not carry it)
  rm -rf "$FSRC"; mkdir -p "$FSRC"
  tar --exclude=./build --exclude=./.git -cf - . | (cd "$FSRC" && tar -xf -)
}

compile() {
  cd "$FSRC" && FRAG_BUILD_DIR=$FBUILD FRAG_BUILD_TARGETS=fragments_python CTEST_ARGS="-R ^none$ --no-tests=ignore" \
    bash tools/device/build_and_test.sh -DFRAG_WITH_NCCL=ON -DFRAG_BUILD_PYTHON=ON -DFRAG_BUILD_TESTS=OFF
  echo "vllm_run: build finished, rc $?"
}

build() { copy && compile; }

case "${1:-}" in
build) build ;;
copy) copy ;;
compile) compile ;;
wait)
  log=$FBUILD/background-build.log
  for _ in $(seq 600); do
    grep -q "vllm_run: build finished" "$log" 2>/dev/null && break
    if ! pgrep -f "vllm_run.sh (build|compile)" > /dev/null; then  # never started, or did not outlive its call: build now
      echo "vllm_run: no background build running; building now"
      if [ -d "$FSRC/.deps" ]; then compile > "$log" 2>&1; else build > "$log" 2>&1; fi
      break
    fi
    sleep 1
  done
  grep -E "^(built in|vllm_run:|build_and_test:)" "$log"; tail -3 "$log"
  ls "$FBUILD"/python/fragments/_C*.so > /dev/null 2>&1 || { echo "vllm_run: no fragments._C built"; exit 1; }
  ;;
"") sed -n '2,14p' "$0"; exit 2 ;;
*)
  so=$(ls "$FBUILD"/python/fragments/_C*.so 2>/dev/null | head -1)
  [ -n "$so" ] || { echo "vllm_run: no fragments._C in $FBUILD (bash tools/device/vllm_run.sh build)"; exit 1; }
  pkg=$HOME/fpkg; rm -rf "$pkg"; mkdir -p "$pkg"
  cp -r python/fragments "$pkg/fragments"; cp "$so" "$pkg/fragments/"
  export PYTHONPATH="$pkg:$(pwd):${PYTHONPATH:-}"
  export LD_LIBRARY_PATH="$FBUILD/lib:${LD_LIBRARY_PATH:-}"
  "$@"
  ;;
esac
