"""Does a tap at a biased linear layer's output change Inductor's float32 code, and does _addmm's pass undo it?
No vLLM needed: `fragments::tap` and the pass are loaded from their files.

    python tools/probes/addmm_tap_probe.py [--device cuda]

For a few shapes, `y = linear(x, w, b); out = y + r` (GPT-NeoX's dense layer and its residual sum) compiled by
Inductor three ways: without a tap (plain vLLM's code), with a tap at y, and with a tap at y and the pass
(python/fragments/vllm/_addmm.py) as Inductor's post_grad_custom_pre_pass. Prints, per shape, whether each
tapped result is bit-identical to the untapped one and whether its post-grad graph kept `addmm`. On a GPU
Inductor unfuses an untapped float32 addmm (mm, then the bias inside the sum's kernel); on the CPU it does not,
so there every way keeps addmm (the pass runs with gpu_only off there).
"""
import argparse
import importlib.util
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES = [(5, 256, 256), (64, 1024, 1024), (7, 512, 2048), (128, 4096, 4096)]


def load(name):
    path = os.path.join(ROOT, "python", "fragments", "vllm", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"fragments_probe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    load("_tap")  # registers fragments::tap (its body does nothing here)
    addmm = load("_addmm")
    torch.backends.cuda.matmul.allow_tf32 = False

    def plain(x, w, b, r):
        return torch.nn.functional.linear(x, w, b) + r

    def tapped(x, w, b, r):
        y = torch.nn.functional.linear(x, w, b)
        torch.ops.fragments.tap(y, "dense.output")
        return y + r

    def compiled(fn, inputs, rewrite=None):
        """fn's compiled result, and whether the post-grad graph still has addmm after Inductor's patterns."""
        graphs = []

        class Seen(addmm.UnfuseTappedAddmm):  # after Inductor's patterns: what it compiles
            def __call__(self, graph):
                graphs.append(str(graph))
        torch._dynamo.reset()
        with torch._inductor.config.patch(post_grad_custom_pre_pass=rewrite, post_grad_custom_post_pass=Seen(),
                                          fx_graph_cache=False):
            out = torch.compile(fn, backend="inductor", fullgraph=True)(*inputs)
        return out, "aten.addmm" in graphs[-1]

    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}")
    for m, k, n in SHAPES:
        g = torch.Generator().manual_seed(m * k + n)
        inputs = [torch.randn(*s, generator=g).to(args.device) for s in ((m, k), (n, k), (n,), (m, n))]
        base, base_addmm = compiled(plain, inputs)
        tap, tap_addmm = compiled(tapped, inputs)
        fixed, fixed_addmm = compiled(tapped, inputs, addmm.UnfuseTappedAddmm(gpu_only=args.device == "cuda"))
        ulp = lambda a: (a - base).abs().max().item()  # noqa: E731
        print(f"[{m}x{k}]·[{k}x{n}]: untapped addmm kept {base_addmm}; tapped: addmm kept {tap_addmm}, "
              f"bit-identical {torch.equal(tap, base)} (max diff {ulp(tap):.3g}); tapped with the pass: addmm kept "
              f"{fixed_addmm}, bit-identical {torch.equal(fixed, base)} (max diff {ulp(fixed):.3g})", flush=True)


if __name__ == "__main__":
    main()
