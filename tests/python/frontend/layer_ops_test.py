"""The kit's layer ops (frag::rms_norm, frag::rotary_embedding, frag::silu_and_mul; issue 31 item 1).

- CPU: the C++ reference kernels (runtime/layer_ops.cpp, loaded by `import fragments`) equal fragkit's Python
  definitions (fragkit/ops.py) bit for bit, over float32, bfloat16 and float16, neox and interleaved rotary,
  partial rotary, positions [T] and [B, T], and q/k as strided views of one qkv tensor (as the kit's
  attention passes them). The two must not drift: an export made with fragkit alone and a run in C++ compute
  the same.
- CUDA (skipped, loudly, where torch sees no GPU or the build has no fused kernels): the fused kernels
  (runtime/layer_ops_cuda.cu) against the reference math on the same GPU: rotary and SiLU·mul bit for bit
  (same float32 operations, same rounding), RMSNorm within 2 roundings of the dtype (its reduction order is
  its own: two roundings of the dtype plus 16 float32 ones); the inputs are left untouched (q and k are views into qkv: an in-place rotary would change a
  saved qkv); each kernel captured in a CUDA graph and replayed equals its eager result.
"""
import os
import sys
import unittest

import torch

import fragments  # noqa: F401  (the C++ ops)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from fragkit import ops as kit_ops  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def qkv_views(dtype, device, b=2, t=5, heads=4, kv_heads=2, head_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, t, (heads + 2 * kv_heads) * head_size, generator=g).to(dtype).to(device)
    q = qkv[..., :heads * head_size]
    k = qkv[..., heads * head_size:(heads + kv_heads) * head_size]
    return qkv, q, k


def cos_sin(rotary_dim, positions=64, device="cpu"):
    inv = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def rotary_cases(device):
    """(name, positions, head_size, rotary_dim, is_neox)"""
    b, t = 2, 5
    row_positions = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 9, 40]], device=device)
    for neox in (True, False):
        for rotary_dim in (16, 8):
            yield f"neox={neox} rot={rotary_dim} positions[T]", torch.arange(t, device=device), 16, rotary_dim, neox
            yield f"neox={neox} rot={rotary_dim} positions[B,T]", row_positions[:b], 16, rotary_dim, neox


def inputs(dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, 96, generator=g).to(dtype).to(device) * 3
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype).to(device)
    gate_up = torch.randn(3, 4, 2 * 48, generator=g).to(dtype).to(device) * 4
    return x, w, gate_up


class CpuReferenceTest(unittest.TestCase):
    def assertBits(self, a, b, what):
        self.assertEqual(a.dtype, b.dtype, what)
        self.assertEqual(a.shape, b.shape, what)
        self.assertTrue(torch.equal(a, b), f"{what}: max |diff| {(a.float() - b.float()).abs().max().item()}")

    def test_cpp_reference_equals_python(self):
        for dtype in DTYPES:
            x, w, gate_up = inputs(dtype, "cpu")
            self.assertBits(torch.ops.frag.rms_norm(x, w, 1e-6), kit_ops._rms_norm_impl(x, w, 1e-6), f"rms {dtype}")
            self.assertBits(torch.ops.frag.silu_and_mul(gate_up), kit_ops._silu_and_mul_impl(gate_up),
                            f"silu {dtype}")
            for name, positions, head_size, rot, neox in rotary_cases("cpu"):
                _, q, k = qkv_views(dtype, "cpu")
                cache = cos_sin(rot)
                got = torch.ops.frag.rotary_embedding(positions, q, k, cache, head_size, rot, neox)
                want = kit_ops._rotary_embedding_impl(positions, q, k, cache, head_size, rot, neox)
                self.assertBits(got[0], want[0], f"rotary q {dtype} {name}")
                self.assertBits(got[1], want[1], f"rotary k {dtype} {name}")

    def test_rotary_rotates(self):
        # Not the identity (a kernel that copied its input would pass the equality above on position 0 only).
        _, q, k = qkv_views(torch.float32, "cpu")
        rq, _ = torch.ops.frag.rotary_embedding(torch.arange(5) + 1, q, k, cos_sin(16), 16, 16, True)
        self.assertGreater((rq - q).abs().max().item(), 1e-2)


def cuda_kernels_built():
    """True when frag::rms_norm has a CUDA kernel of its own (not only the composite reference)."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("frag::rms_norm", "CUDA")
    except Exception:
        return False


@unittest.skipUnless(torch.cuda.is_available(), "SKIPPED LOUDLY: no GPU here, the fused CUDA kernels are not run")
class CudaKernelTest(unittest.TestCase):
    def setUp(self):
        if not cuda_kernels_built():
            self.skipTest("SKIPPED LOUDLY: this build of fragments has no fused CUDA kernels "
                          "(FRAG_WITH_CUDA_KERNELS off or no nvcc): the reference serves CUDA")

    def test_rotary_and_silu_bit_identical_to_reference(self):
        for dtype in DTYPES:
            _, _, gate_up = inputs(dtype, "cuda")
            got = torch.ops.frag.silu_and_mul(gate_up)
            want = kit_ops._silu_and_mul_impl(gate_up)
            self.assertTrue(torch.equal(got, want), f"silu {dtype}: {(got.float() - want.float()).abs().max()}")
            for name, positions, head_size, rot, neox in rotary_cases("cuda"):
                qkv, q, k = qkv_views(dtype, "cuda")
                before = qkv.clone()
                cache = cos_sin(rot, device="cuda")
                got = torch.ops.frag.rotary_embedding(positions, q, k, cache, head_size, rot, neox)
                want = kit_ops._rotary_embedding_impl(positions, q, k, cache, head_size, rot, neox)
                for i, part in enumerate("qk"):
                    diff = (got[i].float() - want[i].float()).abs().max().item()
                    self.assertTrue(torch.equal(got[i], want[i]), f"rotary {part} {dtype} {name}: {diff}")
                self.assertTrue(torch.equal(qkv, before), "rotary changed its input (q/k are views into qkv)")

    def test_rms_norm_close_to_reference(self):
        for dtype in DTYPES:
            x, w, _ = inputs(dtype, "cuda")
            got = torch.ops.frag.rms_norm(x, w, 1e-6)
            want = kit_ops._rms_norm_impl(x, w, 1e-6)
            # Two roundings to the dtype (x * r, then * weight) plus the float32 sum's and rsqrt's own error,
            # which the dtype's rounding hides in bf16/fp16 and shows in fp32.
            scale = want.float().abs().clamp_min(1e-3)
            bound = (2 * torch.finfo(dtype).eps + 16 * torch.finfo(torch.float32).eps) * scale
            diff = (got.float() - want.float()).abs()
            self.assertTrue((diff <= bound).all(), f"rms {dtype}: max |diff| {diff.max().item()}")

    def test_captured_equals_eager(self):
        x, w, gate_up = inputs(torch.bfloat16, "cuda")
        _, q, k = qkv_views(torch.bfloat16, "cuda")
        positions = torch.arange(5, device="cuda")
        cache = cos_sin(16, device="cuda")

        def run():
            return (torch.ops.frag.rms_norm(x, w, 1e-6), torch.ops.frag.silu_and_mul(gate_up),
                    *torch.ops.frag.rotary_embedding(positions, q, k, cache, 16, 16, True))
        eager = run()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = run()
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(eager, static):
            self.assertTrue(torch.equal(a, b))


if __name__ == "__main__":
    unittest.main(verbosity=2)
