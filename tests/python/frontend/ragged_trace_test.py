"""Prompts of different lengths in one trace, values computed in a trace, `.shape`/`.dtype`, `.inputs`, and
`.apply` inside an invoke (issue 29), on the reference Llama export:

- a LanguageModel at tp 1 and tp 2 (several invokes, and one list of prompts given as ids and as texts),
- `fragments.load` at tp 1 in this process and at tp 2 through `fragments.launch` (a list of prompts),

each prompt's values (trimmed to its own tokens) against its own unbatched run with `fragments.load` at
tp 1 (fp32, <= 1e-5 relative); patching a value of one prompt into another of a different length within
one forward against the same patch given as a tensor in a run of that prompt alone.

Needs tests/models/{llama_tp1, llama_tp2} and `fragments` importable (python/ with _C built); run from the
runfiles root (Bazel) or with FRAG_TEST_ROOT pointing at a tree that has them.
"""
import os
import sys
import unittest

import torch

import fragments

ROOT = os.environ.get("FRAG_TEST_ROOT", os.getcwd())
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from process_watch import wait_gone  # noqa: E402
MODELS = os.path.join(ROOT, "tests", "models")
TOLERANCE = 1e-5
A = [5, 17, 300, 42, 9, 77]     # 6 tokens
B = [8, 1, 250, 42]             # 4 tokens: the batch pads it with 2
W = torch.randn(64, 5, generator=torch.Generator().manual_seed(0))


def relative(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


class CharTokenizer:
    """A tokenizer of this test: one id per character (the session calls `tokenizer(text)["input_ids"]`)."""

    def __call__(self, text):
        return {"input_ids": [ord(c) % 997 for c in text]}


def own_runs():
    """Each prompt alone, tp 1, plain API: layer 1's output, the logits, layer 0's output, and the
    patched run of B (A's layer-0 value at token 2 put at B's token 3 = its last), and A scaled."""
    model = fragments.load(os.path.join(MODELS, "llama_tp1", "rank0.pt"))
    out = {}
    for name, ids in (("A", A), ("B", B), ("text", [ord(c) % 997 for c in "short"]),
                      ("text_long", [ord(c) % 997 for c in "a longer prompt"])):
        with model.trace([ids]):
            h = model.model.layers[1].output.save()
            h0 = model.model.layers[0].output.save()
            logits = model.output.save()
        out[name] = {"h": h.value[0], "h0": h0.value[0], "logits": logits.value[0]}
    with model.trace([B]):
        model.model.layers[0].output[0, 3] = out["A"]["h0"][2]
        patched_h = model.model.layers[1].output.save()
        patched = model.output.save()
    out["B_patched"], out["B_patched_h"] = patched.value[0], patched_h.value[0]
    with model.trace([A]):
        model.model.layers[1].output *= 0.5
        halved = model.output.save()
    out["A_halved"] = halved.value[0]
    return out


def plain_rank(rank, path):
    """One rank of `fragments.load` (also run under fragments.launch): a ragged batch, expressions."""
    model = fragments.load(path)
    with model.trace([A, B]) as tracer:
        h = model.model.layers[1].output
        shape, dtype = tuple(h.shape), str(h.dtype)
        lens_shape = tuple(model.lm_head(model.model.norm(h))[:, -1].shape)
        hs = h.save()
        norm = (h * 2).norm(dim=-1).save()
        proj = (h[:, 3] @ W).save()
        top = model.lm_head(model.model.norm(h))[:, 3].softmax(-1).topk(5).save()
        soft = torch.softmax(model.output, -1)[1, 3].save()
        logits = model.output.save()
    with model.trace([A, B]):
        model.model.layers[0].output[1, 3] = model.model.layers[0].output[0, 2]   # A into B, one forward
        patched = model.output.save()
    return {"h": tracer.unpad(hs), "logits": tracer.unpad(logits), "norm": norm.value, "proj": proj.value,
            "top": top.value, "soft": soft.value, "patched": patched.value[1, :len(B)], "shape": shape,
            "dtype": dtype, "lens_shape": lens_shape, "lengths": tracer.lengths}


class RaggedTraceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.own = own_runs()

    def near(self, got, want, what):
        self.assertLess(relative(got, want), TOLERANCE, what)

    def check_plain(self, out):
        own = self.own
        self.assertEqual(out["lengths"], [6, 4])
        self.assertEqual(out["shape"], (2, 6, 64))
        self.assertEqual(out["dtype"], "torch.float32")
        self.assertEqual(out["lens_shape"], (2, 1000))
        for i, name in enumerate("AB"):
            self.assertEqual(out["h"][i].shape[0], len(A if name == "A" else B))
            self.near(out["h"][i], own[name]["h"], f"layer 1 of {name}")
            self.near(out["logits"][i], own[name]["logits"], f"logits of {name}")
        self.near(out["norm"][1, :4], (own["B"]["h"] * 2).norm(dim=-1), "norm of B")
        self.near(out["proj"], torch.stack([own["A"]["h"][3], own["B"]["h"][3]]) @ W, "h[:, 3] @ W")
        self.near(out["soft"], torch.softmax(own["B"]["logits"][3], -1), "softmax of B's last token")
        self.near(out["patched"], own["B_patched"], "A patched into B in one forward")

    def test_plain_api_tp1(self):
        self.check_plain(plain_rank(0, os.path.join(MODELS, "llama_tp1", "rank0.pt")))

    def test_plain_api_tp2(self):
        ranks = fragments.launch(plain_rank, world=2, args=(os.path.join(MODELS, "llama_tp2", "rank{rank}.pt"),),
                                 timeout=120)
        for r in ranks:
            self.check_plain(r)
        self.assertTrue(torch.equal(ranks[0]["top"].values, ranks[1]["top"].values))

    def check_session(self, export, tp):
        own = self.own
        with fragments.LanguageModel(os.path.join(MODELS, export), tp=tp, tokenizer=CharTokenizer()) as model:
            with model.trace() as tracer:
                with tracer.invoke([A]):
                    source = model.model.layers[0].output[:, 2]
                    a_shape = tuple(model.model.layers[1].output.shape)
                    h_a = model.model.layers[1].output.save()
                    last_a = model.output[:, -1].save()
                    model.model.layers[1].output.apply(lambda t: t * 0.5 if t.shape[:2] == (1, 6) else 1 / 0)
                    halved = model.output.save()
                with tracer.invoke([B]):
                    b_shape = tuple(model.model.layers[1].output.shape)
                    lens_shape = tuple(model.lm_head(model.model.norm(model.model.layers[1].output))[:, -1].shape)
                    h_b = model.model.layers[1].output.save()
                    last_b = model.output[:, -1].save()
                    model.model.layers[0].output[:, -1] = source      # B's own last token (3), not the pad
                    patched = model.output.save()
            with model.trace([A, B]) as listed:
                h = model.model.layers[1].output.save()
                batch_shape = tuple(model.model.layers[1].output.shape), str(model.output.dtype)
                inputs = model.model.layers[1].inputs
                hidden, positions = inputs[0][0].save(), inputs["positions"].save()
                same = (inputs["hidden_states"] - model.model.layers[1].input).abs().max().save()
                with self.assertRaises(KeyError) as missing:
                    inputs["position_ids"]
            with model.trace(["short", "a longer prompt"]) as texts:
                text_logits = model.output.save()
            pids = model.pids
        self.assertEqual(wait_gone(pids), [])
        self.assertEqual((a_shape, b_shape, lens_shape), ((1, 6, 64), (1, 4, 64), (1, 1000)))
        self.assertEqual(batch_shape, ((2, 6, 64), "torch.float32"))
        self.assertEqual(tuple(h_b.shape), (1, 4, 64))
        self.near(h_a[0], own["A"]["h"], "invoke A, layer 1")
        self.near(h_b[0], own["B_patched_h"], "invoke B, layer 1 (after the patch at layer 0)")
        self.near(last_a[0], own["A_halved"][-1], "invoke A's last token (halved by its .apply)")
        self.near(last_b[0], own["B_patched"][-1], "invoke B's last token (its own 4th, not a pad)")
        self.near(halved[0], own["A_halved"], ".apply inside invoke A")
        self.near(patched[0], own["B_patched"], "A patched into B (different lengths) in one forward")
        for i, name in enumerate("AB"):
            self.near(listed.unpad(h)[i], own[name]["h"], f"listed prompt {name}")
        self.assertEqual(listed.lengths, [6, 4])
        self.assertEqual(texts.lengths, [5, 15])
        self.near(texts.unpad(text_logits)[0], own["text"]["logits"], "text prompt 0")
        self.near(texts.unpad(text_logits)[1], own["text_long"]["logits"], "text prompt 1")
        self.assertEqual(positions.value.tolist(), list(range(6)))
        self.assertEqual(same.value.item(), 0.0)
        self.assertEqual(tuple(hidden.shape), (2, 6, 64))
        message = str(missing.exception)
        self.assertIn("hidden_states, positions", message)
        self.assertIn("did you mean positions", message)

    def test_session_tp1(self):
        self.check_session("llama_tp1", 1)

    def test_session_tp2(self):
        self.check_session("llama_tp2", 2)


if __name__ == "__main__":
    unittest.main(verbosity=2)
