"""Where the vLLM checks run: vLLM's platform (the CPU build here, CUDA on the GPU machine), the dtype, the
model runner, the bound a saved value must meet against transformers', and the engine settings each needs.

    FRAG_VLLM_DTYPE    float32 (default) or bfloat16
    FRAG_VLLM_RUNNER   v1 or v2: which model runner vLLM uses on a GPU (VLLM_USE_V2_MODEL_RUNNER); unset: vLLM's
                       own choice (V2 for Llama, Mistral, Qwen3 and Qwen2-MoE in vLLM 0.24). The CPU build runs V1.
    FRAG_VLLM_TF32     1: leave vLLM's float32 attention kernels as they are on a GPU (Triton's dot in TF32); by
                       default the checks set TRITON_F32_DEFAULT=ieee, so float32 is float32 throughout
    FRAG_VLLM_GPU_MEM  the fraction of GPU memory an engine may hold (default 0.1: several checks share a GPU)

The bounds (max |a - b| / max |b| per saved location, against transformers on the same device in the same
dtype):
  float32, every op in float32 (CPU; GPU with TRITON_F32_DEFAULT=ieee): 1e-5. The two implementations add in
    different orders (kernels, fused norms, attention), so single roundings of 2^-24 accumulate over the
    reductions of a 2-layer model: measured 1e-6 to 2e-6.
  float32 with vLLM's default GPU attention: Triton's tl.dot rounds float32 inputs to TF32 (10-bit mantissa,
    unit roundoff 2^-11 ≈ 4.9e-4), so every value after the first attention carries that rounding:
    8 · 2^-11 ≈ 3.9e-3 (a few roundings, accumulated over two layers).
  bfloat16: both sides round every op's output to bfloat16 (unit roundoff 2^-8 ≈ 3.9e-3) but in different
    places (fused kernels, attention): 8 · 2^-8 = 0.03125, the bound the multi-GPU check uses.
"""
import os

DTYPE = os.environ.get("FRAG_VLLM_DTYPE", "float32")
RUNNER = os.environ.get("FRAG_VLLM_RUNNER", "").lower()


def _on_gpu() -> bool:
    try:
        from vllm.platforms import current_platform
        return bool(current_platform.is_cuda_alike())
    except Exception:  # noqa: B902 - vLLM absent or broken: the checks skip or fail on their own
        return False


GPU = _on_gpu()
DEVICE = "cuda" if GPU else "cpu"


def tf32_attention() -> bool:
    return GPU and DTYPE == "float32" and os.environ.get("FRAG_VLLM_TF32") == "1"


def bound(family: str = "") -> float:
    if DTYPE == "bfloat16":
        return 8 * 2 ** -8
    if tf32_attention():
        return 8 * 2 ** -11
    if GPU and family == "gemma2" and os.environ.get("FRAG_GEMMA2_SOFTCAP") != "0":
        return GEMMA2_SOFTCAP_GPU
    return 1e-5


# Gemma 2 on a GPU in float32: vLLM's Triton attention caps a score s as c·(e^t − e^−t)/(e^t + e^−t), t = s/c,
# c = 50 (triton_attention_helpers.apply_softcap), where transformers takes c·tanh(t). For the small scores of
# these models the difference e^t − e^−t cancels: each capped score carries an absolute error of about
# c·2^-23 ≈ 6e-6 (measured, tools/probes/softcap_probe.py: 4e-6 to 6e-6 for |s| ≤ 10, in Triton and in torch
# float32 alike), against 2^-24·|s| for tanh. A softmax turns an absolute score error δ into a relative
# probability error δ, and the attention output o = Σ p·v then moves by up to 2δ·max|v|; relative to max|o| that
# is 2δ·max|v|/max|o|, with max|v|/max|o| up to ~40 when a few positions' random values average out. So
# 2 · 6e-6 · 40 ≈ 5e-4 after the first attention, carried on by the next layer: 1e-3. Measured 9e-5 to 2.6e-4
# (bench/results/issue39/run30); the same model without softcapping (FRAG_GEMMA2_SOFTCAP=0) meets 1e-5 (6e-7).
GEMMA2_SOFTCAP_GPU = 1e-3


def torch_dtype():
    import torch
    return getattr(torch, DTYPE)


def setup(tp: int) -> None:
    """The environment of an engine at tensor_parallel_size `tp` (before vLLM starts its processes)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not GPU:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        cores = max(os.cpu_count() or 1, 1)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(tp)) \
            if tp > 1 else f"0-{cores - 1}"
        if tp == 1:  # the same batches in the runs a read-only check compares (below): seen on a loaded CPU too
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return
    if DTYPE == "float32" and not tf32_attention():
        os.environ["TRITON_F32_DEFAULT"] = "ieee"  # vLLM's Triton attention in float32, not TF32
    # vLLM's GPU kernels give a row other bits in another batch, and which requests share a step is decided by
    # when they reach the engine-core process (seen: plain vLLM not bit-reproducible across identical batches).
    # In this process the core steps only once every request of a generate call is in: the same batches in the
    # runs a read-only check compares (the plugin's engine and plain vLLM alike).
    if tp == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if RUNNER in ("v1", "v2"):
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if RUNNER == "v2" else "0"


def engine_kwargs() -> dict:
    """LLM(...) settings beyond the checks' own: on a GPU a share of its memory and a fixed KV cache, so that
    checks run side by side on one GPU (vLLM would otherwise size its cache from what it sees free)."""
    if not GPU:
        return {}
    return {"gpu_memory_utilization": float(os.environ.get("FRAG_VLLM_GPU_MEM", "0.1")),
            "kv_cache_memory_bytes": 256 << 20}


def describe() -> str:
    runner = {"v1": "V1", "v2": "V2"}.get(RUNNER, "vLLM's choice") if GPU else "V1"
    return f"{DEVICE} {DTYPE} runner {runner}" + (" (TF32 attention)" if tf32_attention() else "")
