"""Cached generation from torch.export archives (issue 28): a .pt2 exported with the cached forward
(fragkit.export(..., format="export", kv_cache=True)) runs prefill and decode steps of one archive.

Against the TorchScript exports of the same weights (tests/models/{llama,moe}_tp{1,2}): the Python API's
greedy tokens of a ragged batch are equal and the logits within 1e-5 relative (fp32) at tp 1 and 2 (launched
ranks over Gloo; Qwen2-MoE's tp 2 with FRAG_SLOW=1, for CI time), a steering edit at every decode step gives the same tokens; `frag run --prompt A --prompt B
--generate K` (a word-level tokenizer made here) writes the same new tokens for both formats; an archive
exported without the cache (llama_tp2_pt2) still generates, by recomputing; a logit lens (a plan `call` step)
on the cached archive in a trace and at every generation step equals the TorchScript file's, within 1e-5.
~7 min on 2 busy cores.
"""
import os
import subprocess
import sys
import tempfile
import unittest

import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fragments  # noqa: E402
import generation_worker as worker  # noqa: E402

ROOT = os.environ.get("FRAG_TEST_ROOT", os.getcwd())
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from slow_tier import slow_tier  # noqa: E402

MODELS = os.path.join(ROOT, "tests", "models")
FRAG = os.path.join(ROOT, "cli", "frag")


def relative(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def word_tokenizer(folder):
    """tokenizer.json of a word-level tokenizer: "w0" .. "w999" are ids 0 .. 999."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"w%d" % i: i for i in range(1000)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    return folder


class Pt2GenerationTest(unittest.TestCase):
    def run_ranks(self, fn, name, ext, tp, *args):
        path = os.path.join(MODELS, name, "rank{rank}.%s" % ext)
        if tp == 1:
            return [fn(0, path.format(rank=0), *args)]
        return fragments.launch(fn, world=tp, backend="gloo", args=(path, *args), timeout=180)

    def check_generate(self, family, tp):
        script = self.run_ranks(worker.tokens_and_logits, f"{family}_tp{tp}", "pt", tp)
        exported = self.run_ranks(worker.tokens_and_logits, f"{family}_tp{tp}_pt2_kv", "pt2", tp)
        for r in range(tp):
            self.assertEqual(exported[r][0], script[0][0], f"rank {r}: tokens")
            self.assertLessEqual(relative(exported[r][1], script[0][1]), 1e-5, f"rank {r}: logits")

    def test_python_generate_equals_torchscript(self):
        for family, tp in (("llama", 1), ("llama", 2), ("moe", 1)):
            with self.subTest(family=family, tp=tp):
                self.check_generate(family, tp)

    @slow_tier("cached generation from .pt2 stays in the default tier for Qwen2-MoE at tp 1 and Llama at tp 1 and 2 "
               "(test_python_generate_equals_torchscript)")
    def test_python_generate_equals_torchscript_moe_tp2(self):
        self.check_generate("moe", 2)

    def test_steering_at_decode_steps_equals_torchscript(self):
        script = self.run_ranks(worker.steered_tokens, "llama_tp2", "pt", 2)[0]
        exported = self.run_ranks(worker.steered_tokens, "llama_tp2_pt2_kv", "pt2", 2)[0]
        plain = self.run_ranks(worker.tokens_and_logits, "llama_tp2", "pt", 2)[0][0]
        self.assertNotEqual(script, plain, "the steering must change the tokens")
        self.assertEqual(exported, script)

    def test_logit_lens_on_cached_archive_equals_torchscript(self):
        # A plan `call` step (model.norm then lm_head) runs the archive's own modules (torch.export.unflatten of
        # the cached program): in a trace (the archive's scratch cache) and at every step of cached generation.
        for tp in (1, 2):
            with self.subTest(tp=tp):
                script = self.run_ranks(worker.lens, f"llama_tp{tp}", "pt", tp)
                exported = self.run_ranks(worker.lens, f"llama_tp{tp}_pt2_kv", "pt2", tp)
                for r in range(tp):
                    traced, per_step, tokens = exported[r]
                    self.assertEqual(tokens, script[0][2], f"rank {r}: tokens")
                    self.assertEqual(list(traced.shape), [1, 8, 1000])
                    self.assertLessEqual(relative(traced, script[0][0]), 1e-5, f"rank {r}: the trace's lens")
                    self.assertEqual(len(per_step), 3)
                    self.assertEqual(list(per_step[0].shape), [3, 8, 1000])  # the prefill: [rows, longest, vocab]
                    self.assertEqual(list(per_step[2].shape), [3, 1, 1000])
                    for k, (a, b) in enumerate(zip(per_step, script[0][1])):
                        self.assertLessEqual(relative(a, b), 1e-5, f"rank {r}: step {k}'s lens")

    def test_frag_run_prompts_equal_torchscript(self):
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = word_tokenizer(os.path.join(tmp, "tokenizer"))
            prompts = ["w1 w2 w3 w4 w5", "w7 w8", "w9 w10 w11 w12 w13 w14 w15 w16"]
            outputs = {}
            for name, ext in (("llama_tp2", "pt"), ("llama_tp2_pt2_kv", "pt2")):
                out = os.path.join(tmp, name + ".safetensors")
                cmd = [FRAG, "run", "--world", "2", os.path.join(MODELS, name, "rank{rank}.%s" % ext),
                       "--tokenizer", tokenizer, "--generate", "5", "--out", out, "--timeout", "300"]
                for p in prompts:
                    cmd += ["--prompt", p]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                                      env=dict(os.environ, FRAG_PYTHON=sys.executable))
                self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
                self.assertIn("KV cache:", proc.stdout + proc.stderr)
                outputs[ext] = load_file(out)
            self.assertTrue(torch.equal(outputs["pt2"]["new_tokens"], outputs["pt"]["new_tokens"]))
            self.assertEqual(outputs["pt2"]["prompt_lengths"].tolist(), [5, 2, 8])
            truth = self.run_ranks(worker.tokens_and_logits, "llama_tp1", "pt", 1, None, 5)[0][0]
            self.assertEqual(outputs["pt2"]["new_tokens"].tolist(), truth)

    def test_archive_without_cache_still_generates(self):
        def tokens(name, ext):
            return self.run_ranks(worker.tokens_and_logits, name, ext, 2, [worker.PROMPTS[0]], 3)[0][0]
        self.assertEqual(tokens("llama_tp2_pt2", "pt2"), tokens("llama_tp2", "pt"))


if __name__ == "__main__":
    unittest.main()
