#!/usr/bin/env bash
# On the GPU machine: the peer benchmark (bench/peer_benchmark.py, issue 17 target (d)) in one go.
# Builds the Python extension with the CMake build (FRAG_BUILD_DIR, NCCL on; tools/device/build_and_test.sh
# must have configured it, or this configures it), exports the 8B-shaped 4-layer bf16 Llama at tp N
# (tools/export_model.py; kept in FRAG_PEER_MODELS between calls) and runs the benchmark for a decode step
# and a 128-token prefill, one process per GPU. At tp 1 the independent peers run too (issue 31 item 3: a
# plain PyTorch model, eager and captured, and HF transformers' LlamaForCausalLM, eager and
# torch.compile(mode="reduce-overhead")), and each run writes its table as JSON, peer_t{1,128}.json.
#
# Usage: tools/device/peer_run.sh [N]     (N GPUs, default 1)
# Environment: FRAG_BUILD_DIR (default build/device), FRAG_PEER_MODELS (default $HOME/peer_models),
#              FRAG_PEER_ITERATIONS (default 30), FRAG_PEER_COMPILE_TIMEOUT (seconds for HF's torch.compile
#              and warm-up, default 150; 0 skips it), FRAG_PYTHON (default python3), OUT (log and JSON
#              copied there).
set -euo pipefail
cd "$(dirname "$0")/../.."
N="${1:-1}"
MODELS="${FRAG_PEER_MODELS:-$HOME/peer_models}/l8b_tp$N"
source tools/device/bench_common.sh

export_bench_model "$MODELS" "$N"
build_python_extension peer_build.log

for tokens in 1 128; do
  echo "== peer benchmark, tp $N, $tokens token(s)"
  args=("$MODELS/rank{rank}.pt" "${shape[@]}" --dtype bfloat16 --tokens "$tokens"
        --iterations "${FRAG_PEER_ITERATIONS:-30}" --compile-timeout "${FRAG_PEER_COMPILE_TIMEOUT:-150}"
        --json "$BUILD/peer_t$tokens.json")
  rm -f "$BUILD/peer_t$tokens.json"
  if [ "$N" = 1 ]; then
    PYTHONPATH="$BUILD/python:." "$PY" bench/peer_benchmark.py "${args[@]}"
  else
    PYTHONPATH="$BUILD/python:." NCCL_NVLS_ENABLE=0 "$PY" -m torch.distributed.run --standalone \
      --nproc-per-node "$N" bench/peer_benchmark.py "${args[@]}"
  fi || echo "== FAILED: the peer benchmark exited $? (a failed logits check or an error, above)"
done 2>&1 | tee "$BUILD/peer_run.log"
# float16 too (issue 31: read-only plans bit-identical with the fused kernels in bf16 and fp16): a decode
# step, without HF's compile. FRAG_PEER_FP16=0 skips it.
if [ "${FRAG_PEER_FP16:-1}" = 1 ] && [ "$N" = 1 ]; then
  export_bench_model "${MODELS}_fp16" 1 --dtype float16
  echo "== peer benchmark, tp 1, 1 token, float16"
  PYTHONPATH="$BUILD/python:." "$PY" bench/peer_benchmark.py "${MODELS}_fp16/rank{rank}.pt" "${shape[@]}" \
    --dtype float16 --tokens 1 --iterations 10 --compile-timeout 0 --json "$BUILD/peer_t1_fp16.json" ||
    echo "== FAILED: the float16 peer benchmark exited $?"
fi 2>&1 | tee -a "$BUILD/peer_run.log"
[ -n "${OUT:-}" ] && cp "$BUILD/peer_run.log" "$BUILD"/peer_t*.json "$OUT/" 2>/dev/null || true
! grep -q "^== FAILED" "$BUILD/peer_run.log"
