"""Export: files per rank, the TorchScript attribute contract, determinism, the CLI."""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import fragkit_testutil as U
import torch
from torch import nn

from fragkit.export import export, export_full, load_rank_from_full, shard_model
from fragkit.layers import CONTRACT_ATTRIBUTES, ColumnParallelLinear, RowParallelLinear
from fragkit.models import LlamaConfig, Qwen2MoeConfig, llama_builder, qwen2_moe_builder

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _class_name(scripted):
    """Python class name of a scripted submodule (TorchScript may add ___torch_mangle_N to the path)."""
    return scripted._c._type().qualified_name().split(".")[-1]


def _is_type(v, t):
    if t is bool:
        return type(v) is bool
    if t is int:
        return type(v) is int
    if t is list:
        return isinstance(v, list) and all(type(e) is int for e in v)
    return isinstance(v, t)


class _Tmp(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="fragkit_export_")
        self.addCleanup(shutil.rmtree, self.tmp, True)


class ContractAttributes(_Tmp):
    def _check_all_contract_attrs(self, m):
        seen = set()
        for name, sub in m.named_modules():
            cls = _class_name(sub)
            if cls not in CONTRACT_ATTRIBUTES:
                continue
            seen.add(cls)
            for attr, t in CONTRACT_ATTRIBUTES[cls].items():
                self.assertTrue(sub._c.hasattr(attr), "%s (%s) lacks %s" % (name, cls, attr))
                v = sub._c.getattr(attr)
                self.assertTrue(_is_type(v, t), "%s.%s = %r is not %s" % (name, attr, v, t.__name__))
        return seen

    def test_llama_tp4_kv2(self):
        paths = export(llama_builder(LlamaConfig(num_key_value_heads=2)), 4, self.tmp)
        self.assertEqual([os.path.basename(p) for p in paths], ["rank%d.pt" % r for r in range(4)])
        m = torch.jit.load(paths[1])
        seen = self._check_all_contract_attrs(m)
        self.assertEqual(seen, {"QKVParallelLinear", "RowParallelLinear", "MergedColumnParallelLinear",
                                "VocabParallelEmbedding", "ParallelLMHead", "LogitsProcessor"})
        self.assertEqual((m.tp_size, m.tp_rank), (4, 1))
        qkv = U.submodule(m, "model.layers.0.self_attn.qkv_proj")
        self.assertEqual(qkv.num_kv_head_replicas, 2)
        self.assertEqual((qkv.num_heads, qkv.num_kv_heads, qkv.total_num_heads, qkv.total_num_kv_heads), (2, 1, 8, 2))
        self.assertEqual((qkv.hidden_size, qkv.head_size, qkv.v_head_size), (64, 8, 8))
        self.assertEqual(qkv.output_sizes, [64, 32, 32])
        self.assertEqual((qkv.output_size, qkv.output_size_per_partition), (128, 32))
        self.assertEqual(tuple(qkv.weight.shape), (32, 64))
        self.assertIs(qkv.gather_output, False)
        gate_up = U.submodule(m, "model.layers.1.mlp.gate_up_proj")
        self.assertEqual(gate_up.output_sizes, [128, 128])
        self.assertEqual(tuple(gate_up.weight.shape), (64, 64))
        down = U.submodule(m, "model.layers.1.mlp.down_proj")
        self.assertEqual((down.input_is_parallel, down.reduce_results), (True, True))
        self.assertEqual((down.input_size_per_partition, down.output_size_per_partition), (32, 64))
        emb = U.submodule(m, "model.embed_tokens")
        self.assertEqual((emb.vocab_start_index, emb.vocab_end_index, emb.num_embeddings_padded), (256, 512, 1024))
        head = U.submodule(m, "lm_head")
        self.assertEqual((head.num_embeddings_per_partition, head.embedding_dim, head.org_vocab_size), (256, 64, 1000))
        lp = U.submodule(m, "logits_processor")
        self.assertEqual((lp.vocab_size, lp.org_vocab_size, lp.tp_size), (1000, 1000, 4))
        self.assertIsNone(U.submodule(m, "model.layers.0.self_attn.o_proj").bias)

    def test_qwen2_moe_tp_and_ep(self):
        tp_dir, ep_dir = os.path.join(self.tmp, "tp"), os.path.join(self.tmp, "ep")
        export(qwen2_moe_builder(Qwen2MoeConfig(num_hidden_layers=1)), 2, tp_dir)
        export(qwen2_moe_builder(Qwen2MoeConfig(num_hidden_layers=1), enable_expert_parallel=True), 2, ep_dir)
        m = torch.jit.load(os.path.join(tp_dir, "rank1.pt"))
        seen = self._check_all_contract_attrs(m)
        self.assertIn("FusedMoE", seen)
        self.assertIn("ReplicatedLinear", seen)
        ex = U.submodule(m, "model.layers.0.mlp.experts")
        self.assertEqual((ex.tp_size, ex.tp_rank, ex.ep_size, ex.ep_rank), (2, 1, 1, 0))
        self.assertEqual((ex.num_experts, ex.local_num_experts, ex.expert_start), (4, 4, 0))
        self.assertEqual((ex.intermediate_size, ex.intermediate_size_per_partition), (32, 16))
        self.assertEqual((ex.reduce_results, ex.renormalize, ex.top_k, ex.hidden_size), (False, False, 2, 64))
        self.assertEqual(tuple(ex.w13_weight.shape), (4, 32, 64))
        self.assertEqual(tuple(ex.w2_weight.shape), (4, 64, 16))
        self.assertIsNotNone(U.submodule(m, "model.layers.0.self_attn.qkv_proj").bias)
        self.assertEqual(U.submodule(m, "model.layers.0.mlp.shared_expert.down_proj").reduce_results, False)
        gate = U.submodule(m, "model.layers.0.mlp.gate")
        self.assertEqual((gate.input_size, gate.output_size, gate.output_size_per_partition), (64, 4, 4))
        self.assertEqual(U.submodule(m, "model.layers.0.mlp.shared_expert_gate").output_size, 1)

        e = U.submodule(torch.jit.load(os.path.join(ep_dir, "rank1.pt")), "model.layers.0.mlp.experts")
        self.assertEqual((e.tp_size, e.tp_rank, e.ep_size, e.ep_rank), (1, 0, 2, 1))
        self.assertEqual((e.local_num_experts, e.expert_start, e.intermediate_size_per_partition), (2, 2, 32))
        self.assertEqual(tuple(e.w13_weight.shape), (2, 64, 64))
        self.assertEqual(tuple(e.w2_weight.shape), (2, 64, 32))

    def _qualified_names(self, paths):
        names = []
        for p in paths:
            m = torch.jit.load(p)
            names.append(sorted((n, s._c._type().qualified_name()) for n, s in m.named_modules()))
        return names

    def test_rank_files_share_class_names(self):
        names = self._qualified_names(export(llama_builder(LlamaConfig(num_hidden_layers=1)), 2, self.tmp))
        self.assertEqual(names[0], names[1])
        for _, q in names[0]:
            self.assertTrue(re.match(r"__torch__\.(fragkit|torch)\.", q), q)

    def test_user_classes_without_annotations_not_mangled(self):
        class Base(nn.Module):
            def _init(self, tp_rank, tp_size):
                self.k = tp_size
                self.up = ColumnParallelLinear(6, 8, tp_rank=tp_rank, tp_size=tp_size)

        class UserBlock(Base):  # no annotations of its own: the case Python >= 3.10 trips over
            def __init__(self, tp_rank, tp_size):
                super().__init__()
                self._init(tp_rank, tp_size)

            def forward(self, x):
                return self.up(x)[0]

        names = self._qualified_names(export(lambda r, p: UserBlock(r, p), 2, self.tmp))
        self.assertEqual(names[0], names[1])
        self.assertNotIn("mangle", names[1][0][1])


class ExportBehaviour(_Tmp):
    def test_tp1_scripted_matches_eager_and_seed(self):
        build = llama_builder(LlamaConfig(num_hidden_layers=1))
        p0 = export_full(build, os.path.join(self.tmp, "a"), seed=3)
        p1 = export_full(build, os.path.join(self.tmp, "b"), seed=3)
        p2 = export_full(build, os.path.join(self.tmp, "c"), seed=4)
        self.assertEqual(len(p0), 1)
        full, _ = shard_model(build, 1, seed=3)
        ids = torch.randint(0, 1000, (1, 6))
        with torch.no_grad():
            ref = full(ids)
            a, b, c = (torch.jit.load(p[0])(ids) for p in (p0, p1, p2))
        self.assertTrue(torch.allclose(a, ref, atol=1e-5))
        self.assertTrue(torch.equal(a, b))
        self.assertFalse(torch.allclose(a, c, atol=1e-3))

    def test_ordinary_modules_copied_whole(self):
        full, ranks = shard_model(qwen2_moe_builder(Qwen2MoeConfig(num_hidden_layers=1)), 2, seed=0)
        for name in ("model.norm", "model.layers.0.input_layernorm"):
            for m in ranks:
                self.assertTrue(torch.equal(U.submodule(m, name).weight, U.submodule(full, name).weight))
        self.assertFalse(torch.allclose(full.model.norm.weight, torch.ones(64)))  # not a default value
        for m in ranks:
            self.assertTrue(torch.equal(U.submodule(m, "model.layers.0.mlp.gate").weight,
                                        U.submodule(full, "model.layers.0.mlp.gate").weight))

    def test_custom_model_exports(self):
        class Block(nn.Module):
            def __init__(self, tp_rank, tp_size):
                super().__init__()
                self.norm = nn.LayerNorm(6)
                self.up = ColumnParallelLinear(6, 8, tp_rank=tp_rank, tp_size=tp_size)
                self.down = RowParallelLinear(8, 6, tp_rank=tp_rank, tp_size=tp_size)

            def forward(self, x):
                h, _ = self.up(self.norm(x))
                out, _ = self.down(torch.relu(h))
                return out

        paths = export(lambda r, p: Block(r, p), 2, self.tmp)
        self.assertEqual(len(paths), 2)
        m1 = torch.jit.load(paths[1])
        self.assertEqual(tuple(m1.up.weight.shape), (4, 6))
        self.assertEqual(tuple(m1.norm.weight.shape), (6,))

    def test_mismatched_plain_module_rejected(self):
        class Bad(nn.Module):
            def __init__(self, tp_rank, tp_size):
                super().__init__()
                self.w = nn.Parameter(torch.zeros(4 // tp_size))

        with self.assertRaises(ValueError):
            load_rank_from_full(Bad(1, 2), Bad(0, 1))

    def test_bfloat16(self):
        cfg = Qwen2MoeConfig(num_hidden_layers=1, dtype=torch.bfloat16)
        p = export_full(qwen2_moe_builder(cfg), self.tmp)
        m = torch.jit.load(p[0])
        self.assertEqual(m.lm_head.weight.dtype, torch.bfloat16)
        self.assertEqual(U.submodule(m, "model.layers.0.mlp.experts").w13_weight.dtype, torch.bfloat16)
        ids = torch.randint(0, 1000, (1, 5))
        with torch.no_grad():
            out = m(ids)
            ref = shard_model(qwen2_moe_builder(Qwen2MoeConfig(num_hidden_layers=1)), 1)[0](ids)
        self.assertEqual(out.dtype, torch.bfloat16)
        self.assertTrue(torch.isfinite(out.float()).all())
        # same seed, same init: bf16 logits track the fp32 ones
        self.assertLess((out.float() - ref).abs().max().item(), 0.25)


class DivisibilityErrors(unittest.TestCase):
    """Issue 16: a tp size that does not divide a layer's sizes names the layer's path and class, not just
    "100 is not divisible by 8"."""

    def error(self, builder, tp_size):
        with self.assertRaises(ValueError) as caught:
            builder(0, tp_size)
        return str(caught.exception)

    def test_each_size_names_its_layer(self):
        self.assertEqual(self.error(llama_builder(LlamaConfig(intermediate_size=100)), 8),
                         "model.layers.0.mlp.gate_up_proj (MergedColumnParallelLinear): output_sizes entry 100 "
                         "is not divisible by tp_size 8")
        self.assertEqual(self.error(llama_builder(LlamaConfig(mlp="plain", intermediate_size=100)), 8),
                         "model.layers.0.mlp.up_proj (ColumnParallelLinear): output_size 100 is not divisible "
                         "by tp_size 8")
        self.assertEqual(self.error(llama_builder(LlamaConfig(num_attention_heads=6, num_key_value_heads=6,
                                                              hidden_size=48)), 4),
                         "model.layers.0.self_attn.qkv_proj (QKVParallelLinear): total_num_heads 6 is not "
                         "divisible by tp_size 4")
        self.assertEqual(self.error(llama_builder(LlamaConfig(vocab_size=960, num_attention_heads=6,
                                                              num_key_value_heads=4, hidden_size=48)), 6),
                         "model.layers.0.self_attn.qkv_proj (QKVParallelLinear): tp_size 6 is not a multiple of "
                         "total_num_kv_heads 4 (kv heads are replicated over whole groups of ranks)")
        self.assertEqual(self.error(llama_builder(LlamaConfig()), 3),
                         "model.embed_tokens (VocabParallelEmbedding): padded vocab size 1024 (vocab 1000 padded "
                         "to a multiple of padding_size 64) is not divisible by tp_size 3")
        self.assertEqual(self.error(qwen2_moe_builder(Qwen2MoeConfig(moe_intermediate_size=30)), 4),
                         "model.layers.0.mlp.experts (FusedMoE): intermediate_size 30 is not divisible by tp_size 4")
        with self.assertRaises(ValueError) as caught:
            RowParallelLinear(10, 4, tp_size=4)
        self.assertEqual(str(caught.exception), "RowParallelLinear: input_size 10 is not divisible by tp_size 4")


class CLI(_Tmp):
    def test_export_model_cli(self):
        out = os.path.join(self.tmp, "llama_tp2")
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # the script must find fragkit by itself
        res = subprocess.run([sys.executable, os.path.join(REPO, "tools", "export_model.py"), "--model", "llama",
                              "--tp", "2", "--kv-heads", "2", "--layers", "1", "--seed", "5", "--out", out],
                             env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(res.returncode, 0, res.stderr)
        self.assertTrue(os.path.isfile(os.path.join(out, "rank0.pt")))
        m = torch.jit.load(os.path.join(out, "rank1.pt"))
        self.assertEqual(len(list(m.model.layers.children())), 1)
        self.assertEqual(U.submodule(m, "model.layers.0.self_attn.qkv_proj").total_num_kv_heads, 2)
        self.assertEqual(m.tp_rank, 1)
        bad = subprocess.run([sys.executable, os.path.join(REPO, "tools", "export_model.py"), "--model", "llama",
                              "--tp", "3", "--out", os.path.join(self.tmp, "bad")],
                             env=env, capture_output=True, text=True, timeout=120)
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("model.embed_tokens (VocabParallelEmbedding): padded vocab size 1024", bad.stderr)
        self.assertIn("not divisible by tp_size 3", bad.stderr)


if __name__ == "__main__":
    unittest.main()
