# Sourced by tools/device/peer_run.sh and decode_run.sh: the 8B-shaped 4-layer Llama they benchmark, its
# export (kept between calls) and the CMake build of the Python extension they run it with.
PY="${FRAG_PYTHON:-$(command -v python3)}"
BUILD="${FRAG_BUILD_DIR:-build/device}"
shape=(--layers 4 --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 --head-dim 128 --vocab 32000)

# kit_stamp ARGS…: a hash of the kit's code (fragkit/*.py, tools/export_model.py) and the export's arguments:
# what a rank file kept between calls was exported by.
kit_stamp() {
  { cat fragkit/*.py tools/export_model.py; printf '%s\n' "$@"; } | sha256sum | cut -d' ' -f1
}

# export_bench_model DIR TP [ARGS…]: the bf16 model (ARGS may say --dtype float16) at tp TP in DIR, unless its
# last rank file is there and DIR/kit.stamp says it was exported by the kit's code as it is now (a change to
# the kit, e.g. its attention, must reach the GPU run: a stale export would measure the old code).
export_bench_model() {
  local dir=$1 tp=$2
  shift 2
  local stamp
  stamp=$(kit_stamp "$tp" "${shape[@]}" "$@")
  if [ -f "$dir/rank$((tp - 1)).pt" ] && [ "$(cat "$dir/kit.stamp" 2>/dev/null)" = "$stamp" ]; then
    return 0
  fi
  local why="none yet"
  [ -f "$dir/rank$((tp - 1)).pt" ] && why="made by other kit code than this checkout's"
  echo "== export ($dir: $why)"
  rm -f "$dir"/rank*.pt "$dir/kit.stamp"
  PYTHONPATH=. "$PY" tools/export_model.py --model llama --tp "$tp" "${shape[@]}" --dtype bfloat16 "$@" \
    --out "$dir" > /dev/null
  echo "$stamp" > "$dir/kit.stamp"
}

# build_python_extension LOG: fragments_python in $BUILD (configured by build_and_test.sh if it is not yet,
# NCCL on; its Python sources are copied beside it); on failure the log's tail, and exit.
build_python_extension() {
  local log=$1
  if [ ! -f "$BUILD/build.ninja" ] || ! grep -q "FRAG_BUILD_PYTHON:BOOL=ON" "$BUILD/CMakeCache.txt"; then
    FRAG_BUILD_DIR="$BUILD" FRAG_BUILD_TARGETS="fragments_python" CTEST_ARGS="-R none" \
      bash tools/device/build_and_test.sh -DFRAG_WITH_NCCL=ON -DFRAG_BUILD_PYTHON=ON > /dev/null || true
  fi
  echo "== build fragments_python"
  cmake --build "$BUILD" -j "$(nproc)" --target fragments_python > "$BUILD/$log" 2>&1 ||
    { tail -30 "$BUILD/$log"; exit 1; }
}
