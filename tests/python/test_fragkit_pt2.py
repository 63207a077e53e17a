"""torch.export (.pt2) rank files: fragkit.export.export(..., format="export").

The TorchScript export of the same weights is the reference: a .pt2 rank file loads with torch.export.load and
gives the same logits (fp32), at world 1 in this process and at tp 2 on two gloo processes (the kit's ops run
the collectives); each kit layer's config is recorded in the archive's extra/fragkit.json.
"""
import json
import os
import shutil
import tempfile
import unittest
import zipfile

import torch
import torch.multiprocessing as mp

import fragkit_testutil as U
import fragkit_tp_worker
from fragkit.export import LAYERS_FORMAT, export, shard_model
from fragkit.layers import CONTRACT_ATTRIBUTES
from fragkit.models import LlamaConfig, Qwen2MoeConfig, llama_builder, qwen2_moe_builder

RTOL = 1e-5  # fp32, relative to the largest logit
MODELS = {"llama": llama_builder(LlamaConfig()), "qwen2_moe": qwen2_moe_builder(Qwen2MoeConfig())}


def _extra(path, name):
    with zipfile.ZipFile(path) as z:
        return json.loads(z.read([n for n in z.namelist() if n.endswith("extra/" + name)][0]).decode())


class Pt2Export(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="fragkit_pt2_")
        g = torch.Generator().manual_seed(7)
        # Not the traced example's shape (2 x 8): the batch and sequence dims must be dynamic.
        cls.ids = torch.randint(0, 1000, (3, 5), generator=g)
        cls.ids[0, :3] = torch.tensor([0, 511, 999])  # both vocab shards at tp 2
        cls.dirs = {}
        for name, build in MODELS.items():
            for tp, fmt in ((1, "torchscript"), (1, "export"), (2, "export")):
                d = os.path.join(cls.root, "%s_tp%d_%s" % (name, tp, fmt))
                export(build, tp, d, seed=0, format=fmt)
                cls.dirs[name, tp, fmt] = d
        with torch.no_grad():
            cls.reference = {name: torch.jit.load(os.path.join(cls.dirs[name, 1, "torchscript"], "rank0.pt"))(cls.ids)
                             for name in MODELS}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root, ignore_errors=True)

    def assert_close(self, actual, expected, what):
        self.assertEqual(actual.shape, expected.shape, what)
        rel = ((actual - expected).abs().max() / expected.abs().max()).item()
        self.assertLessEqual(rel, RTOL, "%s: max |a - b| / max |b| = %.3g" % (what, rel))

    def test_files_are_pt2_archives_only(self):
        for (name, tp, fmt), d in self.dirs.items():
            if fmt == "export":
                self.assertEqual(sorted(os.listdir(d)), ["rank%d.pt2" % r for r in range(tp)], d)

    def test_world1_pt2_gives_the_torchscript_logits(self):
        for name in MODELS:
            program = torch.export.load(os.path.join(self.dirs[name, 1, "export"], "rank0.pt2"))
            with torch.no_grad():
                logits = program.module()(self.ids)
            self.assert_close(logits, self.reference[name], name)

    def test_collectives_are_the_kits_ops(self):
        program = torch.export.load(os.path.join(self.dirs["llama", 2, "export"], "rank0.pt2"))
        targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
        self.assertIn("frag.all_reduce.default", targets)
        self.assertIn("frag.all_gather.default", targets)  # the LogitsProcessor's vocab gather

    def test_layer_configs_are_recorded(self):
        for name in MODELS:
            path = os.path.join(self.dirs[name, 2, "export"], "rank1.pt2")
            info = _extra(path, "fragkit.json")
            self.assertEqual((info["tp_size"], info["tp_rank"], info["layers_format"]), (2, 1, LAYERS_FORMAT))
            module = shard_model(MODELS[name], 2)[1][1]
            expected = [(p, type(m).__name__) for p, m in module.named_modules()
                        if type(m).__name__ in CONTRACT_ATTRIBUTES]
            self.assertEqual([(l["path"], l["class"]) for l in info["layers"]], expected)
            for layer in info["layers"]:
                sub = module.get_submodule(layer["path"])
                self.assertEqual(set(layer["config"]), set(CONTRACT_ATTRIBUTES[layer["class"]]), layer["path"])
                for attr, value in layer["config"].items():
                    got = getattr(sub, attr)
                    self.assertEqual(value, list(got) if isinstance(got, (list, tuple)) else got,
                                     "%s.%s" % (layer["path"], attr))
                    self.assertEqual(type(value), list if isinstance(got, (list, tuple)) else type(got))
                self.assertEqual(layer["parameters"],
                                 {n: list(p.shape) for n, p in sub.named_parameters(recurse=False)})

    def test_export_ids_equal_the_torchscript_exports(self):
        for name in MODELS:
            pt2 = _extra(os.path.join(self.dirs[name, 1, "export"], "rank0.pt2"), "fragkit.json")
            with zipfile.ZipFile(os.path.join(self.dirs[name, 1, "torchscript"], "rank0.pt")) as z:
                ts = json.loads(z.read([n for n in z.namelist() if n.endswith("extra/fragkit.json")][0]))
            self.assertEqual(pt2["export_id"], ts["export_id"])

    def test_unknown_format_is_refused(self):
        with self.assertRaisesRegex(ValueError, "format"):
            export(MODELS["llama"], 1, os.path.join(self.root, "bad"), format="onnx")
        self.assertFalse(os.path.exists(os.path.join(self.root, "bad")))

    def test_tp2_pt2_ranks_give_the_tp1_logits(self):
        out_dir = os.path.join(self.root, "out")
        os.makedirs(out_dir)
        inputs = os.path.join(self.root, "inputs.pt")
        torch.save([self.ids], inputs)
        cases = [{"name": name, "dir": self.dirs[name, 2, "export"], "inputs": inputs, "format": "export"}
                 for name in MODELS]
        mp.spawn(fragkit_tp_worker.run_rank, nprocs=2, join=True,
                 args=(2, U.free_port(), cases, out_dir, U.KIT_ROOT))
        for name in MODELS:
            for r in range(2):
                logits = torch.load(os.path.join(out_dir, "%s.rank%d.pt" % (name, r)))
                self.assert_close(logits, self.reference[name], "%s rank %d" % (name, r))


if __name__ == "__main__":
    unittest.main()
