"""Llama with a plain (GPT-NeoX style) MLP: up_proj is a ColumnParallelLinear whose output stays S(-1).

The exports come from tools/export_model.py --mlp plain (the flags of tests/models/BUILD's
llama_plain_mlp_tp{1,2,4}). fragment-rules.md: a ColumnParallelLinear rank r holds weight rows
[r*N/P, (r+1)*N/P) and its output is S(-1) when gather_output=False; a RowParallelLinear rank r holds
columns [r*K/P, (r+1)*K/P).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import zipfile

import fragkit_testutil as U
import torch

from fragkit.export import export, shard_model
from fragkit.models import LlamaConfig, llama_builder

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
INTERMEDIATE, HIDDEN, LAYERS = 128, 64, 2  # LlamaConfig's defaults


def _export_info(path):
    with zipfile.ZipFile(path) as z:
        name = [n for n in z.namelist() if n.endswith("extra/fragkit.json")][0]
        return json.loads(z.read(name).decode())


def _state(path):
    return {k: v.clone() for k, v in torch.jit.load(path).state_dict().items()}


class PlainMlpExport(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="fragkit_plain_mlp_")
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # the script must find fragkit by itself
        cls.files = {}
        for tp in (1, 2, 4):
            out = os.path.join(cls.tmp, "llama_plain_mlp_tp%d" % tp)
            res = subprocess.run([sys.executable, os.path.join(REPO, "tools", "export_model.py"), "--model", "llama",
                                  "--tp", str(tp), "--mlp", "plain", "--out", out],
                                 env=env, capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                raise RuntimeError("export_model.py --mlp plain --tp %d failed: %s" % (tp, res.stderr))
            cls.files[tp] = [os.path.join(out, "rank%d.pt" % r) for r in range(tp)]
        cls.whole = _state(cls.files[1][0])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_up_proj_weights_are_the_row_blocks_of_the_tp1_weight(self):
        for layer in range(LAYERS):
            key = "model.layers.%d.mlp.up_proj.weight" % layer
            whole = self.whole[key]
            self.assertEqual(tuple(whole.shape), (INTERMEDIATE, HIDDEN))
            for tp in (2, 4):
                n = INTERMEDIATE // tp
                pieces = [_state(f)[key] for f in self.files[tp]]
                for r, piece in enumerate(pieces):
                    with self.subTest(layer=layer, tp=tp, rank=r):
                        self.assertEqual(tuple(piece.shape), (n, HIDDEN))
                        self.assertTrue(torch.equal(piece, whole[r * n:(r + 1) * n]))
                self.assertTrue(torch.equal(torch.cat(pieces, 0), whole))
                # Not a trivial weight: the blocks differ from each other.
                self.assertFalse(torch.equal(pieces[0], pieces[1]))

    def test_down_proj_weights_are_the_column_blocks_and_the_rest_is_whole(self):
        for tp in (2, 4):
            k = INTERMEDIATE // tp
            for r, f in enumerate(self.files[tp]):
                state = _state(f)
                for layer in range(LAYERS):
                    key = "model.layers.%d.mlp.down_proj.weight" % layer
                    self.assertTrue(torch.equal(state[key], self.whole[key][:, r * k:(r + 1) * k]), (tp, r, key))
                for key in ("model.norm.weight", "model.layers.1.post_attention_layernorm.weight"):
                    self.assertTrue(torch.equal(state[key], self.whole[key]), (tp, r, key))

    def test_contract_attributes_make_up_proj_a_plain_column_layer(self):
        m = torch.jit.load(self.files[2][1])
        for layer in range(LAYERS):
            mlp = U.submodule(m, "model.layers.%d.mlp" % layer)
            up, down = mlp.up_proj, mlp.down_proj
            self.assertEqual(up._c._type().qualified_name().split(".")[-1], "ColumnParallelLinear")
            self.assertIs(up.gather_output, False)
            self.assertEqual((up.tp_size, up.tp_rank), (2, 1))
            self.assertEqual((up.input_size, up.output_size, up.output_size_per_partition),
                             (HIDDEN, INTERMEDIATE, INTERMEDIATE // 2))
            self.assertFalse(up._c.hasattr("output_sizes"))  # not a merged (fused) layer
            self.assertIsNone(up.bias)
            self.assertEqual(down._c._type().qualified_name().split(".")[-1], "RowParallelLinear")
            self.assertEqual((down.input_is_parallel, down.reduce_results), (True, True))
            self.assertEqual(down.input_size_per_partition, INTERMEDIATE // 2)
            self.assertFalse(mlp._c.hasattr("gate_up_proj"))

    def test_inspect_gives_up_proj_output_a_last_dim_shard(self):
        frag = U.frag_binary()
        if frag is None:
            self.skipTest("no frag binary (set FRAG_BIN, or run under Bazel/CMake)")
        for tp in (2, 4):
            res = subprocess.run([frag, "inspect", self.files[tp][0], "--json"], capture_output=True, text=True,
                                 timeout=300)
            self.assertEqual(res.returncode, 0, res.stderr)
            doc = json.loads(res.stdout)
            fragments = {f["location"]: f for f in doc["fragmented"]}
            rank_local = {r["location"]: r["derived_from"] for r in doc["rank_local"]}
            for layer in range(LAYERS):
                mlp = "model.layers.%d.mlp" % layer
                with self.subTest(tp=tp, layer=layer):
                    f = fragments.get(mlp + ".up_proj.output")
                    self.assertIsNotNone(f, "up_proj.output is not fragmented at tp %d" % tp)
                    self.assertEqual(f["class"], "ColumnParallelLinear")
                    self.assertEqual(f["layout"], "shard(-1)")
                    self.assertEqual(f["rule"], {"kind": "shard", "dim": -1, "group": "tp", "group_size": tp})
                    self.assertEqual(f["whole_width"], INTERMEDIATE)
                    self.assertEqual(f["side"], "output")
                    self.assertEqual(fragments[mlp + ".down_proj.input"]["rule"]["kind"], "shard")
                    self.assertNotIn(mlp + ".down_proj.output", fragments)  # reduce_results=True
                    self.assertIn(mlp + ".up_proj.input", doc["whole"])
                    for side in ("input", "output"):  # GELU between the column and the row layer
                        self.assertEqual(rank_local.get(mlp + ".act_fn." + side), mlp + ".up_proj.output")

    def test_scripted_tp1_matches_the_eager_model(self):
        build = llama_builder(LlamaConfig(mlp="plain"))
        full, _ = shard_model(build, 1, seed=0)
        ids = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = full(ids)
            out = torch.jit.load(self.files[1][0])(ids)
        self.assertLess((out - ref).abs().max().item(), 1e-5)
        self.assertEqual(tuple(out.shape), (2, 6, 1000))
        self.assertTrue(0.1 < out.std().item() < 10.0)


class MlpOption(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="fragkit_mlp_option_")
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def _export(self, name, config, tp=2):
        return export(llama_builder(config), tp, os.path.join(self.tmp, name))

    def test_default_is_the_gated_mlp_and_unchanged(self):
        default = self._export("default", LlamaConfig())
        gated = self._export("gated", LlamaConfig(mlp="gated"))
        plain = self._export("plain", LlamaConfig(mlp="plain"))
        self.assertEqual(LlamaConfig().mlp, "gated")
        self.assertEqual(_export_info(default[0])["export_id"], _export_info(gated[0])["export_id"])
        self.assertNotEqual(_export_info(default[0])["export_id"], _export_info(plain[0])["export_id"])
        for a, b in zip(default, gated):
            sa, sb = _state(a), _state(b)
            self.assertEqual(sorted(sa), sorted(sb))
            for k in sa:
                self.assertTrue(torch.equal(sa[k], sb[k]), k)
        keys = set(_state(default[0]))
        self.assertIn("model.layers.0.mlp.gate_up_proj.weight", keys)
        self.assertNotIn("model.layers.0.mlp.up_proj.weight", keys)

    def test_unknown_kind_is_refused(self):
        with self.assertRaises(ValueError):
            llama_builder(LlamaConfig(mlp="swiglu"))(0, 1)
        res = subprocess.run([sys.executable, os.path.join(REPO, "tools", "export_model.py"), "--model", "qwen2_moe",
                              "--tp", "1", "--mlp", "plain", "--out", os.path.join(self.tmp, "moe")],
                             capture_output=True, text=True, timeout=120)
        self.assertNotEqual(res.returncode, 0)
        self.assertIn("--mlp applies to --model llama only", res.stderr)


if __name__ == "__main__":
    unittest.main()
