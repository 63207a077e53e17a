"""Per-layer weight layout: each rank's slice sits where fragment-rules.md says (and vLLM puts it)."""
import unittest

import fragkit_testutil as U  # noqa: F401  (sets sys.path)
import torch

from fragkit.layers import (
    ColumnParallelLinear,
    FusedMoE,
    LogitsProcessor,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

rows = lambda w, idx: w[torch.tensor(idx, dtype=torch.long)]  # noqa: E731


class ReplicatedLayout(unittest.TestCase):
    def test_whole_on_every_rank(self):
        full, ranks = U.full_and_ranks(lambda **kw: ReplicatedLinear(3, 5, bias=True, **kw), 2)
        x = torch.randn(4, 3)
        for m in ranks:
            self.assertEqual(tuple(m.weight.shape), (5, 3))
            self.assertTrue(torch.equal(m.weight, full.weight))
            self.assertTrue(torch.equal(m.bias, full.bias))
            self.assertTrue(torch.allclose(m(x)[0], full(x)[0]))
        self.assertEqual((ranks[1].tp_rank, ranks[1].tp_size), (1, 2))
        self.assertEqual(ranks[1].output_size_per_partition, 5)


class ColumnLayout(unittest.TestCase):
    def test_rows_and_bias(self):
        n, k = 8, 3
        for p in (1, 2, 4):
            full, ranks = U.full_and_ranks(lambda **kw: ColumnParallelLinear(k, n, bias=True, **kw), p)
            w = torch.arange(n * k, dtype=torch.float32).view(n, k)
            for r, m in enumerate(ranks):
                self.assertEqual(tuple(m.weight.shape), (n // p, k))
                self.assertEqual(m.output_size_per_partition, n // p)
                self.assertEqual(m.output_size, n)
                self.assertTrue(torch.equal(m.weight, w[r * n // p:(r + 1) * n // p]))
                self.assertTrue(torch.equal(m.bias, 10000 + torch.arange(r * n // p, (r + 1) * n // p).float()))

    def test_explicit_rank1_of_2(self):
        _, ranks = U.full_and_ranks(lambda **kw: ColumnParallelLinear(2, 4, bias=False, **kw), 2)
        self.assertEqual(ranks[1].weight.tolist(), [[4.0, 5.0], [6.0, 7.0]])

    def test_forward_is_s_minus1_shard(self):
        torch.manual_seed(0)
        full, ranks = U.full_and_ranks(lambda **kw: ColumnParallelLinear(6, 8, bias=True, **kw), 4, arange=False)
        x = torch.randn(2, 3, 6)
        whole, _ = full(x)
        outs = [m(x)[0] for m in ranks]
        for r, o in enumerate(outs):
            self.assertTrue(torch.allclose(o, whole[..., 2 * r:2 * r + 2], atol=1e-5))

    def test_skip_bias_add_returns_bias(self):
        full, ranks = U.full_and_ranks(lambda **kw: ColumnParallelLinear(2, 4, skip_bias_add=True, **kw), 2)
        x = torch.ones(1, 2)
        out, b = ranks[1](x)
        self.assertTrue(torch.equal(b, torch.tensor([10002.0, 10003.0])))
        self.assertTrue(torch.equal(out, x @ ranks[1].weight.t()))
        self.assertIsNone(ColumnParallelLinear(2, 4)(x)[1])

    def test_rejects_sharded_source(self):
        src = ColumnParallelLinear(2, 4, tp_rank=0, tp_size=2)
        dst = ColumnParallelLinear(2, 4, tp_rank=1, tp_size=2)
        with self.assertRaises(ValueError):
            dst.load_full_weights(src)
        with self.assertRaises(ValueError):
            ColumnParallelLinear(2, 6, tp_size=4)


class MergedLayout(unittest.TestCase):
    def test_gate_up_rows_per_part(self):
        # output_sizes [4, 8], P=2: rank r holds [gate_r | up_r].
        full, ranks = U.full_and_ranks(
            lambda **kw: MergedColumnParallelLinear(1, [4, 8], bias=True, **kw), 2)
        self.assertEqual(ranks[0].weight.flatten().tolist(), [0, 1, 4, 5, 6, 7])
        self.assertEqual(ranks[1].weight.flatten().tolist(), [2, 3, 8, 9, 10, 11])
        self.assertEqual(ranks[1].bias.tolist(), [10002, 10003, 10008, 10009, 10010, 10011])
        self.assertEqual(ranks[1].output_sizes, [4, 8])
        self.assertEqual(ranks[1].output_size, 12)
        self.assertEqual(ranks[1].output_size_per_partition, 6)

    def test_equal_parts_tp4(self):
        i, p = 8, 4
        _, ranks = U.full_and_ranks(lambda **kw: MergedColumnParallelLinear(1, [i, i], bias=False, **kw), p)
        for r, m in enumerate(ranks):
            g = list(range(r * 2, r * 2 + 2))
            u = list(range(i + r * 2, i + r * 2 + 2))
            self.assertEqual(m.weight.flatten().tolist(), g + u)

    def test_reassembly_rule_and_trap(self):
        torch.manual_seed(1)
        sizes, p = [4, 8], 2
        full, ranks = U.full_and_ranks(lambda **kw: MergedColumnParallelLinear(5, sizes, **kw), p, arange=False)
        x = torch.randn(3, 5)
        whole = full(x)[0]
        blocks = [m(x)[0] for m in ranks]
        subs, off = [], 0
        for s in sizes:
            subs.append(torch.cat([b[..., off // p: off // p + s // p] for b in blocks], -1))
            off += s
        self.assertTrue(torch.allclose(torch.cat(subs, -1), whole, atol=1e-5))
        plain = torch.cat(blocks, -1)  # the interleaved [g0 u0 g1 u1]: right shape, wrong values
        self.assertEqual(plain.shape, whole.shape)
        self.assertFalse(torch.allclose(plain, whole))


class QKVLayout(unittest.TestCase):
    def _layer(self, hq, hkv, hs=2, vs=None, hidden=4, bias=True):
        return lambda **kw: QKVParallelLinear(hidden, hs, hq, hkv, bias=bias, v_head_size=vs, **kw)

    def test_8q_2kv_tp4_replicas(self):
        hs = 2
        full, ranks = U.full_and_ranks(self._layer(8, 2, hs, hidden=1), 4)
        # whole rows: Q 0..15, K 16..19, V 20..23
        expected = {
            0: list(range(0, 4)) + [16, 17] + [20, 21],
            1: list(range(4, 8)) + [16, 17] + [20, 21],
            2: list(range(8, 12)) + [18, 19] + [22, 23],
            3: list(range(12, 16)) + [18, 19] + [22, 23],
        }
        for r, m in enumerate(ranks):
            self.assertEqual(m.weight.flatten().tolist(), expected[r])
            self.assertEqual(m.bias.tolist(), [10000 + i for i in expected[r]])
            self.assertEqual((m.num_heads, m.num_kv_heads, m.num_kv_head_replicas), (2, 1, 2))
            self.assertEqual(m.output_sizes, [16, 8, 8])
            # TRAP: vLLM's output_size counts the replicas: 32, while the whole width is 24.
            self.assertEqual(m.output_size, 32)
            self.assertEqual(m.output_size_per_partition, 8)
            self.assertEqual(full.weight.shape[0], 24)

    def test_8q_2kv_tp2_no_replicas(self):
        _, ranks = U.full_and_ranks(self._layer(8, 2, 2, hidden=1), 2)
        self.assertEqual(ranks[1].weight.flatten().tolist(), list(range(8, 16)) + [18, 19] + [22, 23])
        self.assertEqual(ranks[1].num_kv_head_replicas, 1)
        self.assertEqual(ranks[1].output_size, 24)

    def test_mqa_tp8(self):
        hs = 2
        _, ranks = U.full_and_ranks(self._layer(8, 1, hs, hidden=1), 8)
        for r, m in enumerate(ranks):
            self.assertEqual(m.weight.flatten().tolist(), [2 * r, 2 * r + 1, 16, 17, 18, 19])
            self.assertEqual((m.num_heads, m.num_kv_heads, m.num_kv_head_replicas), (1, 1, 8))
            self.assertEqual(m.output_size, 8 * (2 + 2 + 2))

    def test_v_head_size_differs(self):
        _, ranks = U.full_and_ranks(self._layer(4, 2, hs=2, vs=3, hidden=1), 2)
        # whole: Q 0..7, K 8..11, V 12..17 (two kv heads of 3)
        self.assertEqual(ranks[1].weight.flatten().tolist(), [4, 5, 6, 7, 10, 11, 15, 16, 17])
        self.assertEqual(ranks[1].output_sizes, [8, 4, 6])

    def test_gather_rule_reassembles_whole(self):
        torch.manual_seed(2)
        hq, hkv, hs, p = 8, 2, 2, 4
        full, ranks = U.full_and_ranks(self._layer(hq, hkv, hs, hidden=4), p, arange=False)
        x = torch.randn(3, 4)
        whole = full(x)[0]
        blocks = [m(x)[0] for m in ranks]
        nh, rep = hq // p, p // hkv
        q = torch.cat([b[..., :nh * hs] for b in blocks], -1)
        k = torch.cat([blocks[r][..., nh * hs:nh * hs + hs] for r in range(0, p, rep)], -1)
        v = torch.cat([blocks[r][..., nh * hs + hs:] for r in range(0, p, rep)], -1)
        self.assertTrue(torch.allclose(torch.cat([q, k, v], -1), whole, atol=1e-5))
        # the replicas really are duplicates
        self.assertTrue(torch.equal(blocks[0][..., nh * hs:], blocks[1][..., nh * hs:]))


class RowLayout(unittest.TestCase):
    def test_columns_and_whole_bias(self):
        n, k, p = 3, 8, 4
        full, ranks = U.full_and_ranks(lambda **kw: RowParallelLinear(k, n, bias=True, **kw), p)
        w = torch.arange(n * k, dtype=torch.float32).view(n, k)
        for r, m in enumerate(ranks):
            self.assertEqual(tuple(m.weight.shape), (n, k // p))
            self.assertTrue(torch.equal(m.weight, w[:, 2 * r:2 * r + 2]))
            self.assertTrue(torch.equal(m.bias, full.bias))
            self.assertEqual((m.input_size_per_partition, m.output_size_per_partition), (2, 3))

    def test_partials_sum_and_bias_on_rank0_only(self):
        torch.manual_seed(3)
        full, ranks = U.full_and_ranks(lambda **kw: RowParallelLinear(8, 3, bias=True, reduce_results=False,
                                                                      **kw), 4, arange=False)
        x = torch.randn(2, 8)
        whole = full(x)[0]
        parts = [m(x[:, 2 * r:2 * r + 2])[0] for r, m in enumerate(ranks)]
        self.assertTrue(torch.allclose(sum(parts), whole, atol=1e-5))
        for r in (1, 2, 3):  # no bias on ranks > 0
            self.assertTrue(torch.allclose(parts[r], x[:, 2 * r:2 * r + 2] @ ranks[r].weight.t(), atol=1e-6))
        self.assertTrue(torch.allclose(parts[0], x[:, :2] @ ranks[0].weight.t() + full.bias, atol=1e-6))

    def test_input_not_parallel_and_skip_bias(self):
        torch.manual_seed(4)
        full, ranks = U.full_and_ranks(lambda **kw: RowParallelLinear(8, 3, input_is_parallel=False,
                                                                      skip_bias_add=True, **kw), 2, arange=False)
        x = torch.randn(2, 8)
        whole, wb = full(x)
        outs = [m(x) for m in ranks]
        for _, b in outs:
            self.assertTrue(torch.equal(b, full.bias))
        self.assertTrue(torch.allclose(outs[0][0] + outs[1][0], whole, atol=1e-5))
        self.assertTrue(torch.allclose(whole + wb, x @ full.weight.t() + full.bias, atol=1e-5))


class VocabLayout(unittest.TestCase):
    def test_vocab_1000_tp2(self):
        full, ranks = U.full_and_ranks(lambda **kw: VocabParallelEmbedding(1000, 2, **kw), 2)
        self.assertEqual(full.num_embeddings_padded, 1024)
        self.assertEqual(tuple(full.weight.shape), (1024, 2))
        w = torch.arange(2048, dtype=torch.float32).view(1024, 2)
        for r, m in enumerate(ranks):
            self.assertEqual(tuple(m.weight.shape), (512, 2))
            self.assertEqual((m.vocab_start_index, m.vocab_end_index), (512 * r, 512 * (r + 1)))
            self.assertEqual((m.num_embeddings, m.org_vocab_size, m.num_embeddings_per_partition,
                              m.padding_size, m.embedding_dim), (1000, 1000, 512, 64, 2))
        self.assertTrue(torch.equal(ranks[0].weight, w[:512]))
        self.assertTrue(torch.equal(ranks[1].weight[:488], w[512:1000]))
        self.assertEqual(ranks[1].weight[488:].abs().sum().item(), 0.0)  # 24 zero pad rows

    def test_vocab_32001_tp2(self):
        _, ranks = U.full_and_ranks(lambda **kw: VocabParallelEmbedding(32001, 1, **kw), 2)
        r1 = ranks[1]
        self.assertEqual(r1.num_embeddings_padded, 32064)
        self.assertEqual(r1.num_embeddings_per_partition, 16032)
        self.assertEqual(r1.vocab_start_index, 16032)  # not DTensor's 16001
        self.assertEqual(r1.weight[0, 0].item(), 16032.0)
        self.assertEqual(r1.weight[32000 - 16032, 0].item(), 32000.0)
        self.assertEqual(int((r1.weight[32001 - 16032:] != 0).sum()), 0)
        self.assertEqual(r1.weight.shape[0] - (32001 - 16032), 63)  # 63 pad rows

    def test_masked_psum_forward(self):
        torch.manual_seed(5)
        full, ranks = U.full_and_ranks(lambda **kw: VocabParallelEmbedding(1000, 4, **kw), 2, arange=False)
        ids = torch.tensor([[0, 511, 512, 999], [5, 700, 3, 998]])
        outs = [m(ids) for m in ranks]  # no process group: the all-reduce is the identity here
        self.assertEqual(outs[0][0, 2].abs().sum().item(), 0.0)  # id 512 not on rank 0
        self.assertEqual(outs[1][0, 1].abs().sum().item(), 0.0)  # id 511 not on rank 1
        self.assertTrue(torch.allclose(outs[0] + outs[1], full(ids)))

    def test_lm_head_and_logits_processor(self):
        torch.manual_seed(6)
        full, ranks = U.full_and_ranks(lambda **kw: ParallelLMHead(1000, 4, org_num_embeddings=1000, **kw), 2,
                                       arange=False)
        h = torch.randn(2, 3, 4)
        whole = full(h)
        self.assertEqual(whole.shape[-1], 1024)
        self.assertEqual(whole[..., 1000:].abs().sum().item(), 0.0)  # pad logits are 0
        shards = [m(h) for m in ranks]
        self.assertEqual(tuple(shards[1].shape), (2, 3, 512))
        self.assertTrue(torch.allclose(torch.cat(shards, -1), whole, atol=1e-5))
        lp = LogitsProcessor(1000, 1000)
        self.assertEqual(lp(whole).shape[-1], 1000)
        self.assertTrue(torch.equal(lp(whole), whole[..., :1000]))

    def test_unsupported_added_vocab(self):
        with self.assertRaises(NotImplementedError):
            VocabParallelEmbedding(1010, 4, org_num_embeddings=1000)


class FusedMoELayout(unittest.TestCase):
    E, H, I, K = 4, 3, 4, 2

    def _make(self, e=None, renormalize=False, **extra):
        e = e or self.E

        def make(tp_rank=0, tp_size=1, ep_rank=None, ep_size=1):
            if ep_size > 1:
                return FusedMoE(e, self.K, self.H, self.I, renormalize=renormalize, tp_size=1, ep_size=ep_size,
                                tp_rank=0, ep_rank=tp_rank, **extra)
            return FusedMoE(e, self.K, self.H, self.I, renormalize=renormalize, tp_size=tp_size, tp_rank=tp_rank,
                            **extra)
        return make

    def test_tp_slices_intermediate(self):
        full, ranks = U.full_and_ranks(self._make(), 2)
        w13, w2 = full.w13_weight, full.w2_weight  # [E, 2I, H], [E, H, I]
        for r, m in enumerate(ranks):
            self.assertEqual(tuple(m.w13_weight.shape), (4, 4, 3))
            self.assertEqual(tuple(m.w2_weight.shape), (4, 3, 2))
            gate = w13[:, 2 * r:2 * r + 2]
            up = w13[:, 4 + 2 * r:4 + 2 * r + 2]
            self.assertTrue(torch.equal(m.w13_weight, torch.cat([gate, up], 1)))
            self.assertTrue(torch.equal(m.w2_weight, w2[:, :, 2 * r:2 * r + 2]))
            self.assertEqual((m.local_num_experts, m.expert_start, m.intermediate_size_per_partition), (4, 0, 2))
        # explicit: rank 1, expert 0, first H-row of gate_1 is whole row 2 -> values 6, 7, 8
        self.assertEqual(ranks[1].w13_weight[0, 0].tolist(), [6.0, 7.0, 8.0])
        self.assertEqual(ranks[1].w13_weight[0, 2].tolist(), [18.0, 19.0, 20.0])  # up row 6

    def test_ep_contiguous_blocks_uneven(self):
        full, ranks = U.full_and_ranks(self._make(e=5), 3, ep_size=3)
        self.assertEqual([(m.expert_start, m.local_num_experts) for m in ranks], [(0, 2), (2, 2), (4, 1)])
        for m in ranks:
            self.assertEqual((m.tp_size, m.ep_size, m.intermediate_size_per_partition), (1, 3, self.I))
            s, n = m.expert_start, m.local_num_experts
            self.assertTrue(torch.equal(m.w13_weight, full.w13_weight[s:s + n]))
            self.assertTrue(torch.equal(m.w2_weight, full.w2_weight[s:s + n]))
        self.assertEqual([m.ep_rank for m in ranks], [0, 1, 2])

    def test_partials_sum_to_whole(self):
        for renorm in (False, True):
            for ep in (False, True):
                torch.manual_seed(7)
                kw = {"ep_size": 2} if ep else {}
                full, ranks = U.full_and_ranks(self._make(renormalize=renorm), 2, arange=False, **kw)
                x = torch.randn(6, self.H)
                logits = torch.randn(6, self.E)
                whole = full(x, logits)
                parts = [m(x, logits) for m in ranks]
                self.assertGreater(whole.abs().sum().item(), 0.0)
                self.assertFalse(torch.allclose(parts[0], whole, atol=1e-4))
                self.assertTrue(torch.allclose(parts[0] + parts[1], whole, atol=1e-5), (renorm, ep))

    def test_reference_math(self):
        torch.manual_seed(8)
        m = FusedMoE(4, 2, 3, 4, renormalize=True)
        x, logits = torch.randn(5, 3), torch.randn(5, 4)
        p = torch.softmax(logits, -1)
        w, ids = torch.topk(p, 2, -1)
        w = w / w.sum(-1, keepdim=True)
        ref = torch.zeros(5, 3)
        for t in range(5):
            for j in range(2):
                e = int(ids[t, j])
                gu = m.w13_weight[e] @ x[t]
                ref[t] += w[t, j] * (m.w2_weight[e] @ (torch.nn.functional.silu(gu[:4]) * gu[4:]))
        self.assertTrue(torch.allclose(m(x, logits), ref, atol=1e-5))
        self.assertEqual(tuple(m(x.view(5, 1, 3), logits).shape), (5, 1, 3))


if __name__ == "__main__":
    unittest.main()
