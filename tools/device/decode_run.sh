#!/usr/bin/env bash
# On the GPU machine: the decode benchmark of issue 28 (bench/gpu_decode_benchmark.py) in one go.
# Builds the Python extension with the CMake build (as peer_run.sh does), exports the 8B-shaped 4-layer bf16
# Llama at tp 1 with 1,024 positions (kept in FRAG_PEER_MODELS between calls) and runs the benchmark at batch
# 1 and 32: fragments' CUDA-graph decode step with a static 512-token cache, with nothing registered and with
# 4 saves, a plain PyTorch captured step (the kit's module, and bench/peer_models.py's independent model with a
# static cache of the same layout, whose logits the benchmark checks first), transformers' generate with its
# dynamic and its static cache. Then the bucketed decode graphs (program/decoder.h): rows joining one by one
# replay one graph per batch bucket, tokens equal to the eager decoder's (gpu_trace_test.py); and the KV cache
# refused before allocation when it is larger than the GPU's free memory.
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
echo "== bucketed decode graphs and the KV cache's memory check"
ROOT_DIR="$(mktemp -d)"
"$PY" tools/export_model.py --model llama --tp 1 --out "$ROOT_DIR/tests/models/llama_tp1" > /dev/null
FRAG_TEST_ROOT="$ROOT_DIR" PYTHONPATH="$BUILD/python:." "$PY" tests/python/frontend/gpu_trace_test.py -v \
  OneGpuTest.test_decode_graphs_are_bucketed_by_batch_size 2>&1 | tee -a "$BUILD/decode_run.log"
PYTHONPATH="$BUILD/python:." "$PY" - "$ROOT_DIR/tests/models/llama_tp1/rank0.pt" <<'PY' 2>&1 | tee -a "$BUILD/decode_run.log"
import sys, fragments
from fragments import _C
model = fragments.load(sys.argv[1], device="cuda:0")
try:
    _C.Decoder(model._c, 1 << 22, 512)  # 4M rows x 512 tokens: TiBs, past any GPU
    print("KV cache check: FAILED (no error)")
except Exception as e:
    line = str(e)
    ok = "free on cuda" in line and "\n" not in line.strip()
    print("KV cache check: %s: %s" % ("ok" if ok else "FAILED", line.strip()))
PY
rm -rf "$ROOT_DIR"
[ -n "${OUT:-}" ] && cp "$BUILD/decode_run.log" "$OUT/" || true
