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
MODELS="${FRAG_PEER_MODELS:-$HOME/peer_models}/l8b_pos1024_tp1"
source tools/device/bench_common.sh

export_bench_model "$MODELS" 1 --max-positions 1024
build_python_extension decode_build.log
echo "== decode benchmark"
FRAGMENTS_BACKEND=nccl PYTHONPATH="$BUILD/python:." "$PY" bench/gpu_decode_benchmark.py \
  "$MODELS/rank0.pt" "${shape[@]}" --max-positions 1024 --cache 512 --prompt 64 --batches 1 32 \
  2>&1 | tee "$BUILD/decode_run.log"
[ -n "${OUT:-}" ] && cp "$BUILD/decode_run.log" "$OUT/" || true
