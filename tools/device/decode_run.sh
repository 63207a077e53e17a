#!/usr/bin/env bash
# On the GPU machine: the decode benchmark of issue 28 (bench/gpu_decode_benchmark.py) in one go.
# Builds the Python extension with the CMake build (as peer_run.sh does), exports the 8B-shaped 4-layer bf16
# Llama at tp 1 with 1,024 positions (kept in FRAG_PEER_MODELS between calls) and runs the benchmark at batch
# 1 and 32: fragments' CUDA-graph decode step with a static 512-token cache, with nothing registered and with
# 4 saves, a plain PyTorch captured step, transformers' generate with its dynamic and its static cache.
#
# Usage: tools/device/decode_run.sh
# Environment: FRAG_BUILD_DIR (default build/device), FRAG_PEER_MODELS (default $HOME/peer_models),
#              FRAG_PYTHON (default python3), OUT (the log copied there).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${FRAG_PYTHON:-$(command -v python3)}"
BUILD="${FRAG_BUILD_DIR:-build/device}"
MODELS="${FRAG_PEER_MODELS:-$HOME/peer_models}/l8b_pos1024_tp1"
shape=(--layers 4 --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 --head-dim 128 --vocab 32000)

if [ ! -f "$MODELS/rank0.pt" ]; then
  echo "== export ($MODELS)"
  PYTHONPATH=. "$PY" tools/export_model.py --model llama --tp 1 "${shape[@]}" --max-positions 1024 \
    --dtype bfloat16 --out "$MODELS" > /dev/null
fi
if [ ! -f "$BUILD/build.ninja" ] || ! grep -q "FRAG_BUILD_PYTHON:BOOL=ON" "$BUILD/CMakeCache.txt"; then
  FRAG_BUILD_DIR="$BUILD" FRAG_BUILD_TARGETS="fragments_python" CTEST_ARGS="-R none" \
    bash tools/device/build_and_test.sh -DFRAG_WITH_NCCL=ON -DFRAG_BUILD_PYTHON=ON > /dev/null || true
fi
echo "== build fragments_python"
cmake --build "$BUILD" -j "$(nproc)" --target fragments_python > "$BUILD/decode_build.log" 2>&1 ||
  { tail -30 "$BUILD/decode_build.log"; exit 1; }
echo "== decode benchmark"
FRAGMENTS_BACKEND=nccl PYTHONPATH="$BUILD/python:." "$PY" bench/gpu_decode_benchmark.py \
  "$MODELS/rank0.pt" "${shape[@]}" --max-positions 1024 --cache 512 --prompt 64 --batches 1 32 \
  2>&1 | tee "$BUILD/decode_run.log"
[ -n "${OUT:-}" ] && cp "$BUILD/decode_run.log" "$OUT/" || true
