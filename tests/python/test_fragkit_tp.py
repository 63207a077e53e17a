"""Tensor-parallel equivalence: exported rank modules run on N gloo processes give the tp=1 result."""
import os
import shutil
import socket
import tempfile
import unittest

import fragkit_testutil as U
import torch
import torch.multiprocessing as mp

import fragkit_tp_worker
from fragkit.export import export, shard_model
from fragkit.layers import (
    ColumnParallelLinear,
    FusedMoE,
    MergedColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from fragkit.models import LlamaConfig, Qwen2MoeConfig, llama_builder, qwen2_moe_builder

ATOL = 1e-4


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _World:
    """Exports cases for one world size, runs them all in one spawn, keeps expected and actual outputs."""

    def __init__(self, root, world_size):
        self.root, self.world_size = root, world_size
        self.cases, self.expected, self.inputs = [], {}, {}

    def add(self, name, build, inputs, expected_fn=None, seed=0):
        d = os.path.join(self.root, "w%d_%s" % (self.world_size, name))
        export(build, self.world_size, d, seed=seed)
        inputs_path = os.path.join(d, "inputs.pt")
        torch.save(list(inputs), inputs_path)
        full, ranks = shard_model(build, self.world_size if expected_fn else 1, seed=seed)
        with torch.no_grad():
            self.expected[name] = expected_fn(full, ranks, inputs) if expected_fn else full(*inputs)
        self.inputs[name] = list(inputs)
        self.cases.append({"name": name, "dir": d, "inputs": inputs_path})

    def run(self):
        out_dir = os.path.join(self.root, "out%d" % self.world_size)
        os.makedirs(out_dir)
        cases = self.cases + [{"name": "ops"}]
        mp.spawn(fragkit_tp_worker.run_rank, nprocs=self.world_size, join=True,
                 args=(self.world_size, _free_port(), cases, out_dir, U.KIT_ROOT))
        self.outputs = {c["name"]: [torch.load(os.path.join(out_dir, "%s.rank%d.pt" % (c["name"], r)))
                                    for r in range(self.world_size)] for c in cases}


def _first(x):
    return x[0] if isinstance(x, tuple) else x


class TPEquivalence(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="fragkit_tp_")
        g = torch.Generator().manual_seed(123)
        ids = torch.randint(0, 1000, (2, 7), generator=g)
        ids[0, :4] = torch.tensor([0, 511, 512, 999])  # both vocab shards and the last id
        cls.ids = ids
        h = torch.randn(2, 5, 6, generator=g)

        w2 = _World(cls.root, 2)
        w2.add("llama", llama_builder(LlamaConfig()), [ids])
        w2.add("llama_plain_mlp", llama_builder(LlamaConfig(mlp="plain")), [ids])
        w2.add("qwen2_moe", qwen2_moe_builder(Qwen2MoeConfig()), [ids])
        w2.add("qwen2_moe_ep", qwen2_moe_builder(Qwen2MoeConfig(norm_topk_prob=True), True), [ids])
        w2.add("column_gather",
               lambda r, p: ColumnParallelLinear(6, 8, gather_output=True, tp_rank=r, tp_size=p), [h])
        # vLLM's plain gather of a merged layer is the interleaved [g0 u0 g1 u1]: the expected value is that.
        w2.add("merged_gather",
               lambda r, p: MergedColumnParallelLinear(6, [4, 4], gather_output=True, tp_rank=r, tp_size=p), [h],
               expected_fn=lambda full, ranks, inp: torch.cat([m(*inp)[0] for m in ranks], -1))
        w2.add("row_whole_input",
               lambda r, p: RowParallelLinear(6, 3, bias=True, input_is_parallel=False, tp_rank=r, tp_size=p), [h])
        router = torch.randn(10, 5, generator=g)
        w2.add("moe_tp_reduce",
               lambda r, p: FusedMoE(5, 2, 6, 8, reduce_results=True, tp_size=p, tp_rank=r), [h.view(10, 6), router])
        w2.add("moe_ep_reduce",
               lambda r, p: FusedMoE(5, 2, 6, 8, reduce_results=True, tp_size=1, ep_size=p, ep_rank=r),
               [h.view(10, 6), router])
        w2.add("vocab_embedding", lambda r, p: VocabParallelEmbedding(1000, 4, tp_rank=r, tp_size=p), [ids])
        cls.w2 = w2

        w4 = _World(cls.root, 4)
        w4.add("llama_kv2", llama_builder(LlamaConfig(num_key_value_heads=2)), [ids])
        w4.add("llama_mqa", llama_builder(LlamaConfig(num_key_value_heads=1, num_hidden_layers=1)), [ids])
        w4.add("qwen2_moe", qwen2_moe_builder(Qwen2MoeConfig(num_hidden_layers=1)), [ids])
        w4.add("llama_plain_mlp", llama_builder(LlamaConfig(mlp="plain")), [ids])
        cls.w4 = w4
        w2.run()
        w4.run()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root, ignore_errors=True)

    def _check(self, world, name):
        expected = _first(world.expected[name])
        for r, out in enumerate(world.outputs[name]):
            out = _first(out)
            self.assertEqual(tuple(out.shape), tuple(expected.shape), (name, r))
            err = (out - expected).abs().max().item()
            self.assertLess(err, ATOL, "%s rank %d: max abs diff %g" % (name, r, err))

    def test_llama_tp2(self):
        self._check(self.w2, "llama")
        self.assertEqual(tuple(self.w2.expected["llama"].shape), (2, 7, 1000))
        std = self.w2.expected["llama"].std().item()
        self.assertTrue(0.1 < std < 10.0, std)  # logits O(1)

    def test_llama_plain_mlp_tp2_and_tp4(self):
        # up_proj a plain ColumnParallelLinear (gather_output=False), GELU, down_proj a RowParallelLinear.
        self._check(self.w2, "llama_plain_mlp")
        self._check(self.w4, "llama_plain_mlp")
        self.assertFalse(torch.allclose(self.w2.expected["llama_plain_mlp"], self.w2.expected["llama"], atol=1e-2))

    def test_qwen2_moe_tp2(self):
        self._check(self.w2, "qwen2_moe")

    def test_qwen2_moe_ep_tp2(self):
        self._check(self.w2, "qwen2_moe_ep")

    def test_llama_kv2_tp4_replicas(self):
        self._check(self.w4, "llama_kv2")

    def test_llama_mqa_tp4(self):
        self._check(self.w4, "llama_mqa")

    def test_qwen2_moe_tp4(self):
        self._check(self.w4, "qwen2_moe")

    def test_layer_collectives(self):
        for name in ("column_gather", "merged_gather", "row_whole_input", "moe_tp_reduce", "moe_ep_reduce",
                     "vocab_embedding"):
            with self.subTest(name=name):
                self._check(self.w2, name)

    def test_merged_gather_is_interleaved_not_whole(self):
        # same seed as the export: rebuild the whole layer the export used
        full, _ = shard_model(lambda r, p: MergedColumnParallelLinear(6, [4, 4], gather_output=True,
                                                                      tp_rank=r, tp_size=p), 1)
        h = self.w2.inputs["merged_gather"][0]
        with torch.no_grad():
            whole = full(h)[0]
        self.assertFalse(torch.allclose(_first(self.w2.outputs["merged_gather"][0]), whole, atol=1e-3))

    def test_ops_in_world(self):
        for w in (self.w2, self.w4):
            n = w.world_size
            for r, out in enumerate(w.outputs["ops"]):
                total = n * (n + 1) / 2
                self.assertTrue(torch.equal(out["all_reduce"], torch.full((2, 3), total)))
                self.assertEqual(out["all_reduce_ep_bf16"].dtype, torch.bfloat16)
                self.assertTrue(torch.equal(out["all_reduce_ep_bf16"].float(), torch.full((2, 3), total)))
                self.assertTrue(torch.equal(out["input_unchanged"], torch.full((2, 3), float(r + 1))))
                g0 = torch.cat([torch.full((2, 3), float(i + 1)) for i in range(n)], 0)
                self.assertTrue(torch.equal(out["all_gather_0"], g0))
                gm1 = torch.cat([torch.tensor([[10.0 * (i + 1)], [10.0 * (i + 1) + 1]]) for i in range(n)], -1)
                self.assertTrue(torch.equal(out["all_gather_m1"], gm1))


if __name__ == "__main__":
    unittest.main()
