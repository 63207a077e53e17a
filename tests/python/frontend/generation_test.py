"""Cached generation through the Python API (fragments.local.generate) on the reference exports.

The ground truth is the uncached forward at tp=1 (the whole sequence again for every token): a ragged batch's
greedy tokens must equal each prompt's own recomputed run, at tp 1 and on launched ranks at tp 2 (Llama and
Qwen2-MoE; tp 4 too with FRAG_SLOW=1), with logits within 1e-4 relative; an edit from step 3 on leaves the
tokens before step 3 alone and changes step 3; an edit of row 1 leaves rows 0 and 2 alone; saves are per step
([B, T, W] at the prefill, [B, 1, W] after); sampling is reproducible by seed; EOS stops a row; model.stream
yields every step. An old-style rank file (forward(input_ids) only) still generates (recomputing), and refuses
ragged prompts in words. Needs tests/models/{llama,moe}_tp{1,2} (Bazel provides them).
"""
import os
import shutil
import sys
import tempfile
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fragments  # noqa: E402
import generation_worker as worker  # noqa: E402

ROOT = os.environ.get("FRAG_TEST_ROOT", os.getcwd())
MODELS = os.path.join(ROOT, "tests", "models")
SLOW = os.environ.get("FRAG_SLOW") == "1"
TPS = (2, 4) if SLOW else (2,)


def relative(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


class GenerationTest(unittest.TestCase):
    def check_family(self, family):
        model = fragments.load(os.path.join(MODELS, f"{family}_tp1", "rank0.pt"))
        truth = [worker.recomputed(model, p, worker.STEPS) for p in worker.PROMPTS]
        ref = worker.scenarios(model)
        results = {1: ref}
        for tp in TPS:
            ranks = fragments.launch(worker.rank_main, world=tp, backend="gloo",
                                     args=(os.path.join(MODELS, f"{family}_tp{tp}", "rank{rank}.pt"),), timeout=120)
            for r in ranks[1:]:
                self.assertEqual(r["batch"], ranks[0]["batch"], "every rank generates the same tokens")
                self.assertEqual(r["sampled"], ranks[0]["sampled"], "every rank samples the same tokens")
            results[tp] = ranks[0]
        for tp, out in results.items():
            with self.subTest(family=family, tp=tp):
                for b, (tokens, logits) in enumerate(truth):
                    self.assertEqual(out["batch"][b], tokens, f"row {b} vs its uncached run")
                    self.assertEqual(out["alone"][b], tokens, f"prompt {b} alone")
                    self.assertLessEqual(relative(out["batch_logits"][:, b], logits), 1e-4)
                self.assertEqual(out["save_shapes"][0][:2], [3, 8])
                self.assertEqual([s[:2] for s in out["save_shapes"][1:]], [[3, 1]] * (worker.STEPS - 1))
                for b in range(3):
                    self.assertEqual(out["tokens_output"][b], worker.PROMPTS[b] + truth[b][0])
                edited = out["edited_from_3"]
                for b in range(3):
                    self.assertEqual(edited[b][:3], truth[b][0][:3], f"row {b}: steps before 3 unchanged")
                self.assertTrue(any(edited[b][3] != truth[b][0][3] for b in range(3)), "step 3 must change")
                row = out["edited_row_1"]
                self.assertEqual(row[0], truth[0][0])
                self.assertEqual(row[2], truth[2][0])
                self.assertNotEqual(row[1], truth[1][0], "the edit of row 1 must change row 1")
                self.assertEqual((out["prefill_saves"], out["decode_saves"]), (1, worker.STEPS - 1))
                self.assertEqual(out["sampled"][0], out["sampled"][1], "the same seed samples the same")
                self.assertNotEqual(out["sampled"][0], out["sampled"][2], "another seed samples otherwise")
                self.assertEqual(out["top_p_tiny"], [t for t, _ in truth], "top_p ~ 0 keeps the argmax")
                self.assertEqual(out["eos"][0], truth[0][0][:3], "row 0 stops at its EOS")
                self.assertEqual([len(s[1]) for s in out["streamed"]], [3] * worker.STEPS)
                self.assertEqual([[s[1][b] for s in out["streamed"]] for b in range(3)], [t for t, _ in truth])
        # tp=N equals tp=1 token for token, sampled included.
        for tp in TPS:
            self.assertEqual(results[tp]["sampled"], ref["sampled"], f"tp={tp} samples as tp=1")

    def test_llama(self):
        self.check_family("llama")

    def test_qwen2_moe(self):
        self.check_family("moe")

    def test_old_rank_file_still_generates(self):
        """A rank file whose forward takes token ids only (made before the cache) recomputes, as before."""
        import subprocess
        folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, folder, True)
        script = ("import sys, torch\nsys.path.insert(0, '.')\nfrom fragkit import models\n"
                  "from fragkit.export import export\n"
                  "class Old(models.LlamaForCausalLM):\n"
                  "    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:\n"
                  "        return self.logits_processor(self.lm_head(self.model(input_ids)))\n"
                  "    kv_cache_shape = None\n"
                  "    new_kv_cache = None\n"
                  "    max_positions = None\n"
                  "export(lambda r, p: Old(models.LlamaConfig(), r, p), 1, sys.argv[1])\n")
        with open(os.path.join(folder, "make_old.py"), "w") as f:  # TorchScript reads the class's source
            f.write(script)
        subprocess.run([sys.executable, os.path.join(folder, "make_old.py"), folder], check=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH="."))
        old = fragments.load(os.path.join(folder, "rank0.pt"))
        self.assertFalse(old._c.has_kv_cache)
        new = fragments.load(os.path.join(MODELS, "llama_tp1", "rank0.pt"))
        with old.generate([worker.PROMPTS[0]], max_new_tokens=4) as a:
            pass
        with new.generate([worker.PROMPTS[0]], max_new_tokens=4) as b:
            pass
        self.assertEqual(a.new_tokens, b.new_tokens, "the same weights (seed 0) generate alike either way")
        with self.assertRaisesRegex(fragments.FragError, "takes no KV cache"):
            with old.generate(worker.PROMPTS, max_new_tokens=2):
                pass


if __name__ == "__main__":
    unittest.main()
