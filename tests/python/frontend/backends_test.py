"""One behaviour across the backends (issue 41, item 5): fragments.load's model at tp 2 (launched ranks) and a
LanguageModel over the same export at tp 2, through the recorder they share:

  - the module tree in `repr` (one line per module, a ModuleList's equal members once) and in `dir()` (what a
    notebook completes);
  - `locations()` on both, equal (rank 0's `frag inspect --json`);
  - generation with the same sampling options (temperature, top_p, seed, eos_token_id, scopes) gives the same
    tokens and saves;
  - the same mistake reads the same, at the user's file:line: a rank-local location saved, an unknown module,
    model.output edited, an in-place edit assigned elsewhere.

fragments.vllm.VLLM shares the same recorder (its checks: tests/python/vllm_plugin). Needs tests/models/llama_tp2
under FRAG_TEST_ROOT (default: the working directory) and `fragments` importable (python/ with _C built).
"""
import os
import re
import sys
import unittest

import torch

import fragments

ROOT = os.environ.get("FRAG_TEST_ROOT", os.getcwd())
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from process_watch import wait_gone  # noqa: E402
TP2 = os.path.join(ROOT, "tests", "models", "llama_tp2")
IDS = [[5, 17, 30, 42, 9, 7]]
THIS = os.path.basename(__file__)
RANK_LOCAL = "model.layers.0.mlp.act_fn.output"


def generate(model):
    """Sampled generation with a steering edit at decode steps only; the tokens and the per-step saves."""
    with model.generate(IDS, max_new_tokens=4, temperature=0.9, top_p=0.8, seed=3, eos_token_id=999) as gen:
        with gen.decode():
            model.model.layers[0].output[:] += 0.25
        saved = model.model.layers[1].output.save()
        tokens = model.output.save()
    return tokens.value, saved.value


def mistakes(model, trace):
    """What each mistake says, with the file:line taken out (and where it was)."""
    said = {}

    def catch(name, fn):
        try:
            fn()
            said[name] = ("no error", None)
        except Exception as e:  # noqa: BLE001 - the message is what the test compares
            text = str(e)
            line = re.match(r"^(\S+?:\d+): ", text)
            said[name] = (text[line.end():] if line else text, line.group(1) if line else None)

    def rank_local():
        with trace():
            getattr(model.model.layers[0].mlp.act_fn, "output").save()

    def logits_edited():
        with trace():
            model.output[..., 0] = 0

    def elsewhere():
        with trace():
            h = model.model.layers[0].output
            h += 1
            model.model.layers[1].output = h

    catch("rank_local", rank_local)
    catch("unknown_module", lambda: model.model.layers[0].mlpp)
    catch("logits_edited", logits_edited)
    catch("assigned_elsewhere", elsewhere)
    return said


def local_rank(rank, path):
    model = fragments.load(path)
    out = {"repr": repr(model), "dir": dir(model.model.layers[0]), "locations": model.locations(),
           "generated": generate(model), "mistakes": mistakes(model, lambda: model.trace(IDS))}
    return out if rank == 0 else None


class BackendsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.local = fragments.launch(local_rank, world=2, args=(os.path.join(TP2, "rank{rank}.pt"),))[0]
        with fragments.LanguageModel(TP2, tp=2) as model:
            cls.session = {"repr": repr(model), "dir": dir(model.model.layers[0]), "locations": model.locations(),
                           "generated": generate(model), "mistakes": mistakes(model, lambda: model.trace(IDS))}
            pids = model.pids
        assert wait_gone(pids) == []

    def test_the_module_tree_in_repr_and_dir(self):
        for backend in (self.local, self.session):
            tree = backend["repr"].splitlines()
            self.assertIn("(0-1: 2 x) LlamaDecoderLayer  [.input, .output]", [line.strip() for line in tree])
            self.assertIn("(qkv_proj) QKVParallelLinear  [.input, .output]", [line.strip() for line in tree])
            for name in ("self_attn", "mlp", "input", "output", "inputs"):
                self.assertIn(name, backend["dir"])
        self.assertEqual(self.local["repr"].splitlines()[1:], self.session["repr"].splitlines()[1:])

    def test_locations_everywhere(self):
        local, session = self.local["locations"], self.session["locations"]
        self.assertEqual(local["format"], "fragments.inspect/1")
        self.assertEqual({k: v for k, v in local.items() if k != "files"},
                         {k: v for k, v in session.items() if k != "files"})

    def test_the_same_generation_options(self):
        (tokens, saved), (tokens_s, saved_s) = self.local["generated"], self.session["generated"]
        self.assertTrue(torch.equal(tokens, tokens_s), f"{tokens} vs {tokens_s}")
        self.assertEqual(len(saved), len(saved_s))
        for a, b in zip(saved, saved_s):
            self.assertTrue(torch.equal(a, b))

    def test_the_same_mistake_reads_the_same(self):
        for name, (text, line) in self.local["mistakes"].items():
            text_s, line_s = self.session["mistakes"][name]
            self.assertEqual(text, text_s, name)
            if name != "unknown_module":  # (an attribute error has no step, so no line)
                self.assertTrue(line and line.rsplit(":", 1)[0].endswith(THIS), f"{name}: {line}")
                self.assertTrue(line_s and line_s.rsplit(":", 1)[0].endswith(THIS), f"{name}: {line_s}")
        self.assertIn(f"{RANK_LOCAL} is rank-local", self.local["mistakes"]["rank_local"][0])
        self.assertIn("whole at model.layers.0.mlp.down_proj.input", self.local["mistakes"]["rank_local"][0])
        self.assertIn("did you mean mlp", self.local["mistakes"]["unknown_module"][0])
        self.assertIn("cannot be edited", self.local["mistakes"]["logits_edited"][0])
        self.assertIn("must assign back to where it read", self.local["mistakes"]["assigned_elsewhere"][0])


if __name__ == "__main__":
    unittest.main(verbosity=2)
