"""Python traces on a GPU: a repeated trace replays its CUDA graph, bit-identical to the eager forward.

Runs where torch sees a CUDA GPU (the device machine: tools/device/README.md); elsewhere every test is
skipped, loudly. The trace holds an edit, saves and a logit lens (an ad-hoc call): the plan stays registered
between traces (ShardedModel::set_plan) and is captured on its third forward with the lens inside.
Needs tests/models/llama_tp1 under FRAG_TEST_ROOT (default: the working directory) and `fragments`
importable (python/fragments with its built _C).
"""
import os
import unittest

import torch

import fragments

ROOT = os.environ.get("FRAG_TEST_ROOT", os.getcwd())
MODEL = os.path.join(ROOT, "tests", "models", "llama_tp1", "rank0.pt")


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA GPU; this machine has none (skipped)")
class GpuTraceTest(unittest.TestCase):
    def trace(self, model, ids, value):
        m = model.model
        with model.trace(ids):
            m.layers[0].output[:, -1] += value
            resid = m.layers[1].self_attn.o_proj.input.save()  # fragmented at tp > 1
            lens = model.lm_head(m.norm(m.layers[0].output)).save()
            logits = model.output.save()
        return resid.value, lens.value, logits.value

    def test_a_repeated_trace_replays_what_the_eager_forward_computes(self):
        eager = fragments.load(MODEL, device="cuda:0")
        eager.cuda_graphs = False
        graphed = fragments.load(MODEL, device="cuda:0")
        self.assertTrue(graphed.cuda_graphs)
        ids = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(0)).cuda()
        first = torch.full((64,), 0.5)
        second = torch.full((64,), -0.5)
        # Five traces of one plan (captured on the third), then another value (another plan: eager twice,
        # then captured), then the first plan again (its graph found in the cache).
        rounds = [first] * 5 + [second] * 3 + [first]
        results = []
        for i, value in enumerate(rounds):
            expected = self.trace(eager, ids, value.clone())
            got = self.trace(graphed, ids, value.clone())  # a new tensor each time, equal bytes
            for name, a, b in zip(("o_proj input", "lens", "logits"), got, expected):
                self.assertTrue(torch.equal(a, b), f"round {i}: {name} differs from the eager forward "
                                                   f"(max |diff| {(a - b).abs().max().item():.3g})")
            results.append(got[2])
        self.assertFalse(torch.equal(results[4], results[5]), "another value changed the logits")
        # (Round 0 is the executor's first run: in fp32 it fuses from the second on, so compare with round 4.)
        self.assertTrue(torch.equal(results[8], results[4]), "the first plan again computes what it did")
        stats = graphed.graph_stats()
        # Captured: the first plan at round 2, the second at round 7. Replayed: rounds 2-4, 7 and 8.
        self.assertEqual(stats, {"captures": 2, "replays": 5, "refusals": 0}, stats)
        self.assertEqual(eager.graph_stats()["captures"], 0)
        # A saved value outlives the next replay (a copy out of the graph's buffer).
        kept = self.trace(graphed, ids, first.clone())[0]
        copy = kept.clone()
        self.trace(graphed, ids, first.clone())
        self.assertTrue(torch.equal(kept, copy))


if __name__ == "__main__":
    unittest.main(verbosity=2)
