"""The kit's attention over a KV cache (fragkit.models.Attention._cached): SDPA in the cache's dtype with a
boolean mask, against an explicit float64 reference written here (each row's own tokens only, causal).

- a ragged batch: rows of 5, 2 and 7 tokens right-padded to 7 (pads hold random k/v), a cache whose slots and
  spare row start as random garbage, then decode steps at each row's own position; only real positions are
  compared, and they must not see a pad, a stale slot or another row;
- multi-head (8 kv heads), GQA (2 kv heads for 8 query heads) and one kv head (a replicated kv head as a rank
  holds it at tp > kv heads), attended over the whole cache and over the first cache_len slots;
- float32 (within 1e-5 relative) and bfloat16 (within 1e-2 relative: bf16 inputs and output, float32
  accumulation inside SDPA), and in bf16 no op makes a float32 copy of anything of the cache's storage;
- the scripted module (TorchScript, as rank files are exported) gives the eager module's outputs, and the
  cached .pt2 export (torch.export, as --kv-cache exports it) keeps SDPA and gives the eager model's logits;
- the whole model, fp32: cached prefill and decode steps within 1e-5 of the uncached forward of the same tokens.
"""
import unittest

import fragkit_testutil as U  # noqa: F401  (puts the repository root on sys.path)
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fragkit.export import export_program
from fragkit.models import Attention, LlamaConfig, LlamaForCausalLM

HEADS, HEAD_SIZE, LAYERS, LAYER, MAX_BATCH, MAX_LEN = 8, 8, 2, 1, 4, 24
LENGTHS = [5, 2, 7]
DECODE_STEPS = 3
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def relative(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def reference(q, history_k, history_v, positions, num_kv_heads, scale):
    """float64 attention of one row: q [t, HEADS*HEAD_SIZE] at `positions` over that row's own tokens
    history_k/v [len, num_kv_heads*HEAD_SIZE] (slot p = the row's token at position p)."""
    t = q.shape[0]
    qh = q.double().view(t, HEADS, HEAD_SIZE)
    kh = history_k.double().view(-1, num_kv_heads, HEAD_SIZE)
    vh = history_v.double().view(-1, num_kv_heads, HEAD_SIZE)
    rep = HEADS // num_kv_heads
    out = torch.empty(t, HEADS, HEAD_SIZE, dtype=torch.float64)
    for i, p in enumerate(positions):
        for h in range(HEADS):
            keys, values = kh[:p + 1, h // rep], vh[:p + 1, h // rep]
            weights = torch.softmax(keys @ qh[i, h] * scale, dim=0)
            out[i, h] = weights @ values
    return out.view(t, -1)


class StorageFloat32Copies(TorchDispatchMode):
    """Records ops that read a tensor of `storage` and return a float32 tensor of at least `numel` elements (a
    copy of what is attended; SDPA's float32 logsumexp per query is far smaller), and every op's name."""

    def __init__(self, storage, numel):
        super().__init__()
        self.storage, self.numel, self.copies, self.ops = storage, numel, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        flat = list(args) + list((kwargs or {}).values())
        reads = any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.storage for a in flat)
        outs = out if isinstance(out, (tuple, list)) else [out]
        if reads and any(isinstance(o, torch.Tensor) and o.dtype == torch.float32 and o.numel() >= self.numel
                         for o in outs):
            self.copies.append(str(func))
        return out


class CachedAttentionTest(unittest.TestCase):
    def run_ragged(self, num_kv_heads, dtype, cache_len_of, module=None):
        """Prefill of LENGTHS then DECODE_STEPS decode steps. Returns [(got, want)] per real position, and the
        cache."""
        gen = torch.Generator().manual_seed(num_kv_heads)
        scale = HEAD_SIZE ** -0.5
        attn = module or Attention(HEADS, HEAD_SIZE, scale, num_kv_heads, layer_idx=LAYER)
        rows, longest = len(LENGTHS), max(LENGTHS)
        total = longest + DECODE_STEPS
        q_width, kv_width = HEADS * HEAD_SIZE, num_kv_heads * HEAD_SIZE

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)

        # Every row's tokens for all its positions; a prefill's pads (positions >= length) hold other values.
        q, k, v = rand(rows, total, q_width), rand(rows, total, kv_width), rand(rows, total, kv_width)
        pad_k, pad_v = rand(rows, longest, kv_width), rand(rows, longest, kv_width)
        cache = rand(LAYERS, 2, MAX_BATCH, num_kv_heads, MAX_LEN, HEAD_SIZE) * 100  # stale slots: garbage
        spare_row = cache[:, :, rows:].clone()
        k_in, v_in = pad_k.clone(), pad_v.clone()
        for b, n in enumerate(LENGTHS):
            k_in[b, :n], v_in[b, :n] = k[b, :n], v[b, :n]
        positions = torch.arange(longest).unsqueeze(0).expand(rows, longest).contiguous()
        pairs = []
        with torch.no_grad():
            out = attn(q[:, :longest], k_in, v_in, positions, cache, cache_len_of(positions))
            for b, n in enumerate(LENGTHS):
                want = reference(q[b, :n], k[b, :n], v[b, :n], range(n), num_kv_heads, scale)
                pairs.append((out[b, :n], want))
            lengths = list(LENGTHS)
            for _ in range(DECODE_STEPS):
                pos = torch.tensor(lengths).unsqueeze(1)
                idx = pos.view(rows, 1, 1).expand(rows, 1, q_width)
                kv_idx = pos.view(rows, 1, 1).expand(rows, 1, kv_width)
                out = attn(q.gather(1, idx), k.gather(1, kv_idx), v.gather(1, kv_idx), pos, cache, cache_len_of(pos))
                for b, n in enumerate(lengths):
                    want = reference(q[b, n:n + 1], k[b, :n + 1], v[b, :n + 1], [n], num_kv_heads, scale)
                    pairs.append((out[b], want))
                lengths = [n + 1 for n in lengths]
        self.assertEqual(out.dtype, dtype)
        # The cache holds each row's k/v at its positions, and the spare row is untouched.
        for b, n in enumerate(lengths):
            written = cache[LAYER, 0, b, :, :n].transpose(0, 1).reshape(n, kv_width)
            self.assertTrue(torch.equal(written, k[b, :n]), f"row {b}: the cache's k")
        self.assertTrue(torch.equal(cache[:, :, rows:], spare_row), "a row past the batch was written")
        return pairs

    def test_ragged_prefill_then_decode_against_float64(self):
        whole = lambda positions: 0  # noqa: E731  (the whole cache, as a GPU's captured decode step)
        longest = lambda positions: int(positions.max()) + 1  # noqa: E731  (a CPU's: the longest row's slots)
        for dtype in (torch.float32, torch.bfloat16):
            for num_kv_heads in (HEADS, 2, 1):
                for name, cache_len_of in (("whole cache", whole), ("cache_len", longest)):
                    with self.subTest(dtype=dtype, kv_heads=num_kv_heads, span=name):
                        for i, (got, want) in enumerate(self.run_ragged(num_kv_heads, dtype, cache_len_of)):
                            self.assertLessEqual(relative(got, want), TOLERANCE[dtype], f"output {i}")

    def test_scripted_equals_eager(self):
        # Rank files are TorchScript: the scripted attention (SDPA included) computes what the eager one does.
        for dtype in (torch.float32, torch.bfloat16):
            eager = self.run_ragged(2, dtype, lambda p: 0)
            scripted = torch.jit.script(Attention(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, 2, layer_idx=LAYER))
            self.assertIn("scaled_dot_product_attention", scripted._cached.code)
            for (a, _), (b, _) in zip(eager, self.run_ragged(2, dtype, lambda p: 0, module=scripted)):
                self.assertTrue(torch.equal(a, b), dtype)

    def test_no_float32_copy_of_a_bf16_cache(self):
        attn = Attention(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, 2, layer_idx=LAYER)
        cache = torch.randn(LAYERS, 2, MAX_BATCH, 2, MAX_LEN, HEAD_SIZE).to(torch.bfloat16)
        q = torch.randn(3, 1, HEADS * HEAD_SIZE).to(torch.bfloat16)
        k = torch.randn(3, 1, 2 * HEAD_SIZE).to(torch.bfloat16)
        positions = torch.tensor([[4], [1], [6]])
        attended = 3 * 2 * MAX_LEN * HEAD_SIZE  # one layer's k of the batch's rows over the whole cache
        with torch.no_grad(), StorageFloat32Copies(cache.untyped_storage().data_ptr(), attended) as seen:
            attn(q, k, k.clone(), positions, cache, 0)
        self.assertTrue(any("scaled_dot_product" in op for op in seen.ops), seen.ops)
        self.assertEqual(seen.copies, [], "an op read the cache and made float32")

    def tiny_model(self):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=2)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2)
        return model

    def test_model_cached_steps_within_1e5_of_the_uncached_forward(self):
        # fp32: SDPA sums in another order than the uncached forward's explicit matmul/softmax, so cached
        # logits are no longer bit-identical to it; 1e-5 relative is float32 rounding over 2 layers.
        model = self.tiny_model()
        ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            full = model(ids)
            cache = model.new_kv_cache(2, 16)
            steps = [model(ids[:, :6], torch.arange(6).expand(2, 6).contiguous(), cache, 0)]
            for p in range(6, 9):
                steps.append(model(ids[:, p:p + 1], torch.full((2, 1), p), cache, 0))
        self.assertLessEqual(relative(torch.cat(steps, 1), full), 1e-5)

    def test_cached_pt2_export_keeps_sdpa(self):
        model = self.tiny_model()
        program = export_program(model, 1, kv_cache=True)
        targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
        self.assertIn("aten.scaled_dot_product_attention.default", targets)
        module = program.module(check_guards=False)
        ids = torch.randint(0, 1000, (3, 6), generator=torch.Generator().manual_seed(2))
        positions = torch.arange(6).expand(3, 6).contiguous()
        a, b = model.new_kv_cache(3, 10), model.new_kv_cache(3, 10)
        with torch.no_grad():
            for step_ids, pos in ((ids, positions), (ids[:, :1], torch.full((3, 1), 6))):
                want, got = model(step_ids, pos, a, 0), module(step_ids, pos, b, 0)
                self.assertLessEqual(relative(got, want), 1e-6)
        self.assertTrue(torch.equal(a, b), "the exported program writes the cache as the eager model does")


if __name__ == "__main__":
    unittest.main()
