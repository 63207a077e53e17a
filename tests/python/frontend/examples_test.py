"""The examples (examples/*.py) on the reference Llama at tp=2 (world 2, Gloo), checked against tp=1 results
computed here through fragments.load on llama_tp1 with other calls than the examples make (values saved
then called ad hoc, plain index edits instead of `.heads`).

Needs tests/models/{llama_tp1,llama_tp2}, examples/ and `fragments` importable; run from the runfiles root
(Bazel) or with FRAG_TEST_ROOT pointing at a tree that has them.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import torch

import fragments

ROOT = os.environ.get("FRAG_TEST_ROOT", os.getcwd())
MODELS = os.path.join(ROOT, "tests", "models")
TP2 = os.path.join(MODELS, "llama_tp2")
CLEAN = [[11, 22, 33, 44, 55, 66]]      # the examples' default prompts for exports without a tokenizer
CORRUPT = [[11, 22, 99, 44, 55, 66]]
TOLERANCE = 1e-4                        # absolute, on logits and probabilities of order 1 (fp32, tp 2 vs 1)


def run_example(name, *args):
    """Runs examples/<name>.py at world 2; returns (stdout, seconds)."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))  # the script's folder gives `common`
    started = time.monotonic()
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", f"{name}.py"), TP2, "--world", "2", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise AssertionError(f"examples/{name}.py failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    print(f"examples/{name}.py: {seconds:.1f} s", file=sys.stderr)
    return done.stdout


class ExamplesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        missing = [p for p in (TP2, os.path.join(MODELS, "llama_tp1"), os.path.join(ROOT, "examples"))
                   if not os.path.exists(p)]
        if missing:
            raise RuntimeError(f"examples_test needs {', '.join(missing)} (run it under Bazel or set FRAG_TEST_ROOT)")
        cls.model = fragments.load(os.path.join(MODELS, "llama_tp1", "rank0.pt"))
        cls.layers = len(cls.model.model.layers)
        cls.work = tempfile.mkdtemp(prefix="examples_test.")
        cls.addClassCleanup(shutil.rmtree, cls.work, True)

    def last_logits(self, ids, edit=None):
        with self.model.trace(ids):
            if edit:
                edit()
            out = self.model.output.save()
        return out.value[0, -1]

    def test_logit_lens_png_and_table(self):
        png = os.path.join(self.work, "lens.png")
        out = run_example("logit_lens", "--png", png)
        with open(png + ".json") as f:
            table = json.load(f)
        # tp=1 reference: each layer's whole output saved, then norm and lm_head called on it ad hoc.
        m = self.model.model
        with self.model.trace(CLEAN):
            hidden = [layer.output.save() for layer in m.layers]
        probs = torch.stack([self.model.lm_head(m.norm(h.value))[0] for h in hidden]).softmax(-1)
        top, token = probs.max(-1)
        self.assertEqual(table["top_token"], token.tolist())
        self.assertLessEqual((torch.tensor(table["top_probability"]) - top).abs().max().item(), TOLERANCE)
        self.assertEqual(out.count("\nlayer ") + out.startswith("layer "), self.layers, "one printed row per layer")

        from PIL import Image
        with Image.open(png) as image:
            image.load()
            self.assertEqual(image.format, "PNG")
            (cw, ch), (left, upper, right, bottom) = table["cell"], table["margin"]
            positions = len(CLEAN[0])
            self.assertEqual(image.size, (left + positions * cw + right, upper + self.layers * ch + bottom))
            # Each cell's fill (its corner: the token text is centred) darkens as the probability grows.
            shade = {}
            for i in range(self.layers):
                for j in range(positions):
                    shade[i, j] = sum(image.getpixel((left + j * cw + 1, upper + i * ch + 1))[:3])
            for a in shade:
                for b in shade:
                    if top[a].item() > top[b].item() + 0.02:
                        self.assertLess(shade[a], shade[b], f"cell {a} (p={top[a]:.3f}) vs {b} (p={top[b]:.3f})")

    def test_activation_patching(self):
        path = os.path.join(self.work, "patching.json")
        run_example("activation_patching", "--json", path)
        with open(path) as f:
            result = json.load(f)
        clean, corrupt = self.last_logits(CLEAN), self.last_logits(CORRUPT)
        good, bad = int(clean.argmax()), int(corrupt.argmax())
        self.assertEqual((result["position"], result["clean_answer"], result["corrupted_answer"]), (2, good, bad))
        # tp=1: the clean run's whole layer outputs, each patched at position 2 into the corrupted run.
        with self.model.trace(CLEAN):
            sources = [layer.output.save() for layer in self.model.model.layers]
        for i, source in enumerate(sources):
            def edit(i=i, source=source):
                self.model.model.layers[i].output[:, 2] = source.value[:, 2]
            patched = self.last_logits(CORRUPT, edit)
            expected = float(patched[good] - (patched[bad] if bad != good else 0.0))
            self.assertAlmostEqual(result["patched_diff"][i], expected, delta=TOLERANCE, msg=f"layer {i}")
        # Patching the last layer's output there cannot reach the last position's logits (only position 2's).
        self.assertAlmostEqual(result["patched_diff"][-1], result["corrupted_diff"], delta=TOLERANCE)
        self.assertNotAlmostEqual(result["patched_diff"][0], result["corrupted_diff"], delta=1e-3,
                                  msg="patching layer 0 must change the corrupted run")

    def test_head_ablation(self):
        path = os.path.join(self.work, "ablation.json")
        run_example("head_ablation", "--json", path, "--layer", "1")
        with open(path) as f:
            result = json.load(f)
        o_proj = self.model.model.layers[1].self_attn.o_proj
        with self.model.trace(CLEAN):
            o_in = o_proj.input.save()
            out = self.model.output.save()
        clean = out.value[0, -1]
        target = int(clean.argmax())
        self.assertEqual(result["target"], target)
        heads = len(o_proj.input.heads)
        width = o_in.value.shape[-1] // heads
        self.assertEqual(len(result["logit_change"]), heads)
        for h in range(heads):
            def edit(h=h):
                o_proj.input[..., h * width:(h + 1) * width] = 0  # a plain index, not .heads
            logits = self.last_logits(CLEAN, edit)
            self.assertAlmostEqual(result["logit_change"][h], float(logits[target] - clean[target]),
                                   delta=TOLERANCE, msg=f"head {h}")
            self.assertEqual(result["top_after"][h], int(logits.argmax()))
        self.assertGreater(max(abs(x) for x in result["logit_change"]), 1e-3, "an ablation must change something")

    def steering_difference(self, at):
        """The example's direction on the reference model: `at`'s output for token 7 minus for token 8."""
        with self.model.trace([[7]]):
            plus = at.output.save()
        with self.model.trace([[8]]):
            minus = at.output.save()
        return plus.value[0, -1] - minus.value[0, -1]

    def test_steering(self):
        path = os.path.join(self.work, "steering.json")
        run_example("steering", "--json", path, "--layer", "1", "--scale", "4", "--tokens", "6")
        with open(path) as f:
            result = json.load(f)
        at = self.model.model.layers[1]
        direction = 4.0 * self.steering_difference(at)
        prompt = torch.tensor([[11, 22, 33, 44]])
        with self.model.generate(prompt, max_new_tokens=6):
            plain = self.model.output.save()
        with self.model.generate(prompt, max_new_tokens=6):
            at.output[:] += direction
            steered = self.model.output.save()
        self.assertEqual(result["plain"], plain.value[0, 4:].tolist())
        self.assertEqual(result["steered"], steered.value[0, 4:].tolist())
        self.assertEqual(len(result["steered"]), 6)

    def test_steering_by_default_is_relative_to_the_hidden_state(self):
        # Without --scale the direction's norm is --strength (0.5) times the prompt's mean hidden-state norm.
        path = os.path.join(self.work, "steering_strength.json")
        run_example("steering", "--json", path, "--layer", "1", "--tokens", "3")
        with open(path) as f:
            result = json.load(f)
        at = self.model.model.layers[1]
        with self.model.trace([[11, 22, 33, 44]]):
            hidden = at.output.save()
        difference = self.steering_difference(at)
        expected = 0.5 * float(hidden.value[0].norm(dim=-1).mean()) / float(difference.norm())
        self.assertAlmostEqual(result["scale"], expected, delta=1e-5 * expected)
        self.assertEqual(len(result["steered"]), 3)


if __name__ == "__main__":
    unittest.main()
