"""SmolLM2's bfloat16 values against its float32 model's rounding envelope (docs/vllm.md, "The bfloat16 bound").

    FRAG_VLLM_DTYPE=bfloat16 python tests/python/vllm_plugin/smollm2_check.py 1 --values /tmp/vllm_bf16.safetensors
    PYTHONPATH=python python tools/probes/bf16_envelope.py /tmp/vllm_bf16.safetensors [--seeds 8]

On the CPU (2026-12-07): bench/results/issue39/cpu/bf16_envelope_smollm2_cpu.txt.

For each of the 181 saved locations (the prompt's rows): vLLM's bfloat16 deviation from transformers' float32
value, transformers' own bfloat16 deviation, and the envelope (the largest deviation over --seeds runs of the
float32 model with one simulated bfloat16 rounding at every module's output, layer output and projection input:
tests/python/vllm_plugin/families.rounding_envelope). Prints the locations where vLLM is furthest past the
envelope, the median ratios, and how many locations each bound would fail.
"""
import argparse
import copy
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests", "python", "vllm_plugin"), ROOT]

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import families  # noqa: E402
from smollm2_check import PROMPT, hf_folder  # noqa: E402
from vllm_check import rel  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("values", help="smollm2_check.py --values's file (bfloat16 engine)")
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bf16-envelope-") as folder:
        hf32, tok = hf_folder(folder)
    cfg = hf32.config
    reader = families.Reader("llama", cfg)
    locs = reader.locations(layers=range(cfg.num_hidden_layers))
    modules = sorted({m for spec in locs.values() for m in (spec[1] if isinstance(spec[1], list) else [spec[1]])})
    prompt = tok(PROMPT).input_ids
    ids, n = torch.tensor([prompt]), len(prompt)
    with torch.no_grad():
        truth, _ = families.capture(hf32, modules, lambda: hf32(ids).logits[0])
        hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
        cap16, _ = families.capture(hf16, modules, lambda: hf16(ids).logits[0])
        runs = families.rounding_envelope(hf32, modules, lambda: hf32(ids).logits[0], seeds=args.seeds)
    vals = load_file(args.values)
    u = families.BF16_UNIT_ROUNDOFF
    rows = []
    for loc, spec in locs.items():
        t = reader.read(spec, truth)[:n]
        devs = sorted(rel(reader.read(spec, c)[:n], t) for c, _ in runs)
        rows.append((loc, rel(vals[loc].float(), t), rel(reader.read(spec, cap16)[:n].float(), t), devs[-1],
                     devs[len(devs) // 2]))
    print(f"{len(rows)} locations, {args.seeds} seeds")
    print(f"bound 2 x transformers' bfloat16 deviation + u: {sum(v > 2 * h + u for _, v, h, _, _ in rows)} past it")
    print(f"bound 2 x max(envelope, transformers') + u: {sum(v > 2 * max(e, h) + u for _, v, h, e, _ in rows)} past it")
    print("vLLM furthest past the envelope:")
    for loc, v, h, e, m in sorted(rows, key=lambda r: -r[1] / max(r[3], 1e-12))[:8]:
        print(f"  {loc}: vLLM {v:.3e}  transformers bf16 {h:.3e}  envelope {e:.3e}  ratio {v / e:.2f}")
    print(f"median vLLM / envelope median {statistics.median(v / m for _, v, _, _, m in rows):.2f}; "
          f"transformers bf16 / envelope median {statistics.median(h / m for _, _, h, _, m in rows):.2f}")


if __name__ == "__main__":
    main()
