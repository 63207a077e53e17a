"""Rewritten torch.export archives (.pt2) run from Python with nothing registered.

`frag rewrite` of a kit export's .pt2 rank files writes archives that `torch.export.load` reads once
`fragments` is imported (it registers the frag:: ops); under `fragments.launch` each rank runs its
archive's `module()` with the model's own collectives on fragments' communicators (Gloo). With no
intervention runtime the fragment ops pass their values through, so every rank's logits must be
bit-identical to the original archive's — for Llama and Qwen2-MoE at tp 2 and 4, kv heads replicated
included — and, for Llama at tp 2, equal to the TorchScript tp=1 export of the same weights (fp32, 1e-5 relative).

Needs tests/models/{llama_tp2_pt2, llama_kv2_tp4_pt2, moe_tp2_pt2, moe_tp4_pt2, llama_tp1}, cli/frag and
`fragments` importable (run_frontend_test.sh sets this up from Bazel's runfiles).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import warnings
import zipfile

import torch

# torch.export.load reads weights from the archive's read-only buffer and warns once per process.
warnings.filterwarnings("ignore", message="The given buffer is not writable")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fragments  # noqa: E402
import frontend_worker as worker  # noqa: E402

ROOT = os.environ.get("FRAG_TEST_ROOT", os.getcwd())
MODELS = os.path.join(ROOT, "tests", "models")
FRAG = os.path.join(ROOT, "cli", "frag")
CASES = [("llama_tp2_pt2", 2), ("llama_kv2_tp4_pt2", 4), ("moe_tp2_pt2", 2), ("moe_tp4_pt2", 4)]
TOLERANCE = 1e-5


def token_ids():
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(3))
    ids[0, :3] = torch.tensor([0, 511, 999])  # both vocab halves at tp 2
    return ids


class RewrittenPt2Test(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.folder = tempfile.mkdtemp(prefix="frag_pt2_run_")
        cls.rewritten = {}
        for name, tp in CASES:
            out = os.path.join(cls.folder, name)
            os.makedirs(out)
            files = [os.path.join(MODELS, name, "rank%d.pt2" % r) for r in range(tp)]
            run = subprocess.run([FRAG, "rewrite", *files, "-o", out], capture_output=True, text=True)
            assert run.returncode == 0, run.stderr
            cls.rewritten[name] = out

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.folder, ignore_errors=True)

    def test_rewritten_archives_hold_the_fragment_ops_and_the_table(self):
        for name, tp in CASES:
            path = os.path.join(self.rewritten[name], "rank0.pt2")
            program = torch.export.load(path)
            targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
            with zipfile.ZipFile(path) as z:
                record = [n for n in z.namelist() if n.endswith("extra/fragments/rules.json")]
                self.assertEqual(len(record), 1, name)
                table = json.loads(z.read(record[0]))
            fragmented = sum((layer["input"] is not None) + (layer["output"] is not None) for layer in table["layers"])
            self.assertGreater(fragmented, 0, name)
            self.assertEqual(targets.count("frag.gather.default"), fragmented, name)
            self.assertEqual(targets.count("frag.split.default"), fragmented, name)
            self.assertEqual(targets.count("frag.intervene.default"), fragmented + len(table["whole"]), name)

    def test_nothing_registered_is_bit_identical_on_every_rank(self):
        ids = token_ids()
        reference = torch.jit.load(os.path.join(MODELS, "llama_tp1", "rank0.pt"))
        with torch.no_grad():
            tp1 = reference(ids)
        for name, tp in CASES:
            ranks = fragments.launch(worker.run_exported_pair, world=tp, backend="gloo",
                                     args=(os.path.join(MODELS, name, "rank{rank}.pt2"),
                                           os.path.join(self.rewritten[name], "rank{rank}.pt2"), ids))
            for rank, (original, rewritten) in enumerate(ranks):
                self.assertTrue(torch.equal(original, rewritten), "%s rank %d: rewritten logits differ" % (name, rank))
                self.assertTrue(torch.equal(original, ranks[0][0]), "%s rank %d differs from rank 0" % (name, rank))
            if name == "llama_tp2_pt2":  # the weights of llama_tp1 (kv2 and MoE are other models)
                rel = ((ranks[0][1] - tp1).abs().max() / tp1.abs().max()).item()
                self.assertLessEqual(rel, TOLERANCE, "%s vs the TorchScript tp=1 export" % name)

    def test_without_fragments_the_rewritten_archive_names_the_missing_ops(self):
        path = os.path.join(self.rewritten["llama_tp2_pt2"], "rank0.pt2")
        run = subprocess.run([sys.executable, "-c", "import torch; torch.export.load(%r)" % path],
                             capture_output=True, text=True)
        self.assertNotEqual(run.returncode, 0)
        self.assertIn("frag", run.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
