"""How far vLLM's Triton attention softcap is from tanh, on a GPU (issue 39: Gemma 2's float32 saves differ from
transformers' by ~2e-4 on a GPU, ~1e-6 on the CPU).

    python softcap_probe.py [--cap 50]

vLLM's Triton attention (the float32 path on a GPU) caps a score S as cap · (e^t − e^−t)/(e^t + e^−t), t = S/cap
(vllm/v1/attention/ops/triton_attention_helpers.py, apply_softcap); transformers as cap · tanh(t). For |t| ≪ 1 the
difference e^t − e^−t cancels: its float32 rounding (and that of Triton's exp) is of the order of 2^-24 · e^t, absolute,
so the capped score's absolute error is about cap · 2^-23 whatever S is — against S itself, a relative error that grows
as S shrinks. The probe runs vLLM's own apply_softcap in a Triton kernel over scores of several sizes and prints, per
size, the largest absolute and relative error against tanh in float64, beside torch's float32 tanh and the same
exp formula in torch float32. One JSON line at the end. Needs a GPU, triton and vLLM.
"""
import argparse
import json

import torch
import triton
import triton.language as tl
from vllm.v1.attention.ops.triton_attention_helpers import apply_softcap


@triton.jit
def _capped(s_ptr, out_ptr, n, cap, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(s_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, apply_softcap(s, cap), mask=mask)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cap", type=float, default=50.0)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for size in (1e-3, 1e-2, 1e-1, 1.0, 10.0, 50.0):
        s = (torch.rand(1 << 20, generator=g, device="cuda") * 2 - 1) * size
        out = torch.empty_like(s)
        _capped[(triton.cdiv(s.numel(), 1024),)](s, out, s.numel(), args.cap, BLOCK=1024)
        truth = args.cap * torch.tanh(s.double() / args.cap)
        t = s / args.cap
        formula = args.cap * (torch.exp(t) - torch.exp(-t)) / (torch.exp(t) + torch.exp(-t))
        row = {"scores_up_to": size}
        for name, value in (("triton_vllm", out), ("torch_tanh_fp32", args.cap * torch.tanh(t)),
                            ("torch_formula_fp32", formula)):
            err = (value.double() - truth).abs()
            row[name + "_abs"] = err.max().item()
            row[name + "_rel"] = (err / truth.abs().clamp_min(1e-30)).max().item()
        rows.append(row)
        print(f"|S| <= {size:<6g} vLLM Triton softcap: abs {row['triton_vllm_abs']:.2e} rel {row['triton_vllm_rel']:.2e}"
              f" | torch tanh fp32: abs {row['torch_tanh_fp32_abs']:.2e} rel {row['torch_tanh_fp32_rel']:.2e}"
              f" | exp formula in torch fp32: abs {row['torch_formula_fp32_abs']:.2e}", flush=True)
    print(json.dumps({"cap": args.cap, "rows": rows}))


if __name__ == "__main__":
    main()
