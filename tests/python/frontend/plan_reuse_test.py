"""A trace recorded once and run many times (`model.plan()`, `Trace.run(ids)`): the path a decode loop's
saves take (issue 31: saves add <= 15 % to a captured decode step; a trace's per-call Python recording was
most of their cost).

A plan's run gives bit for bit what a fresh trace of the same steps gives, run after run and on other ids;
a changed plan (another plan run in between, generation's own) is registered again, never wrongly kept;
errors still name the user's file:line; a plan has no ids while it records. Needs tests/models/llama_tp1
and `fragments` importable (python/ with _C built).
"""
import os
import unittest

import torch

import fragments

ROOT = os.environ.get("FRAG_TEST_ROOT", os.getcwd())
RANK0 = os.path.join(ROOT, "tests", "models", "llama_tp1", "rank0.pt")
THIS = os.path.basename(__file__)


def ids(seed, shape=(2, 5)):
    return torch.randint(0, 1000, shape, generator=torch.Generator().manual_seed(seed))


def every_save(model):
    m = model.model
    saves = [m.layers[i].self_attn.qkv_proj.output.save() for i in range(len(m.layers))]
    saves += [m.layers[-1].mlp.down_proj.input.save(), m.layers[0].output.save()]
    return saves + [model.output.save()]


class PlanReuseTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = fragments.load(RANK0)

    def fresh(self, token_ids):
        with self.model.trace(token_ids):
            saves = every_save(self.model)
        return [s.value for s in saves]

    def test_a_plan_run_again_equals_fresh_traces_bit_for_bit(self):
        with self.model.plan() as plan:
            saves = every_save(self.model)
        for seed, shape in [(1, (2, 5)), (1, (2, 5)), (2, (1, 3)), (1, (2, 5))]:
            logits = plan.run(ids(seed, shape))
            got = [s.value for s in saves]
            want = self.fresh(ids(seed, shape))
            self.assertTrue(torch.equal(logits, want[-1]))
            for g, w in zip(got, want):
                self.assertEqual(g.shape, w.shape)
                self.assertTrue(torch.equal(g, w))

    def test_a_trace_runs_again_and_keeps_earlier_values(self):
        with self.model.trace(ids(1)) as tracer:
            h = self.model.model.layers[0].output.save()
        first = h.value
        tracer.run(ids(2))
        self.assertTrue(torch.equal(h.value, self.fresh(ids(2))[-2]))
        self.assertTrue(torch.equal(first, self.fresh(ids(1))[-2]), "a value read before stays")
        self.assertEqual(tracer.lengths, [5, 5])
        tracer.run([[1, 2, 3], [4]])  # ragged: right-padded as a trace pads
        self.assertEqual(tracer.lengths, [3, 1])
        self.assertEqual(list(h.value.shape[:2]), [2, 3])

    def test_a_changed_plan_is_registered_again_not_wrongly_kept(self):
        m = self.model.model
        with self.model.plan() as saving:
            a = m.layers[0].output.save()
        with self.model.plan() as editing:
            m.layers[0].output[..., 0:8] = 0
            b = m.layers[0].output.save()
        plain = saving.run(ids(1))
        edited = editing.run(ids(1))
        self.assertFalse(torch.equal(edited, plain))
        self.assertEqual(b.value[..., 0:8].abs().max().item(), 0)
        self.assertTrue(torch.equal(saving.run(ids(1)), plain), "the edit is gone when the saving plan runs")
        self.assertNotEqual(a.value[..., 0:8].abs().max().item(), 0)
        with self.model.generate(ids(1), max_new_tokens=1):  # generation registers its own plan between
            m.layers[1].output.save()
        self.assertTrue(torch.equal(editing.run(ids(1)), edited))
        self.assertTrue(torch.equal(saving.run(ids(1)), plain))

    def test_a_repeated_plan_is_parsed_once(self):
        with self.model.plan() as plan:
            self.model.model.layers[1].output.save()
        read = self.model._c.steps_read  # steps fragments._C has read into plan steps (runtime::make_step)
        for k in range(3):
            plan.run(ids(k))
        self.assertEqual(self.model._c.steps_read - read, 1, "parsed at the first run only")

    def test_errors_name_the_users_line(self):
        with self.model.plan() as plan:
            self.model.model.layers[0].output[..., 0:8] = torch.zeros(3, dtype=self.model.dtype)
        with self.assertRaises(fragments.FragError) as caught:  # refused in C++, said at the recording line
            plan.run(ids(1))
        self.assertIn(f"{THIS}:", str(caught.exception))
        self.assertIn("model.layers.0.output", str(caught.exception))

    def test_a_plan_has_no_ids_while_it_records(self):
        with self.assertRaises(fragments.FragmentsError) as caught:
            with self.model.plan():
                self.model.model.layers[0].output.shape  # noqa: B018
        self.assertIn(f"{THIS}:", str(caught.exception))
        self.assertIn("model.plan()", str(caught.exception))
        with self.assertRaises(fragments.FragmentsError) as caught:
            with self.model.plan() as plan:
                self.model.model.layers[0].output.save()
                plan.run(ids(1))
        self.assertIn("still open", str(caught.exception))
        with self.model.plan() as plan:
            self.model.model.layers[0].output.save()
        with self.assertRaises(fragments.FragmentsError) as caught:
            with self.model.trace(ids(1)):
                plan.run(ids(1))
        self.assertIn("inside another trace", str(caught.exception))

    def test_the_module_tree_walk_is_cached_and_still_refuses(self):
        m = self.model.model
        self.assertIs(m.layers[0], m.layers[0])
        self.assertIs(m.layers[-1], m.layers[len(m.layers) - 1])
        self.assertIs(self.model.model, m)
        with self.assertRaises(IndexError):
            m.layers[len(m.layers)]  # noqa: B018
        with self.assertRaises(AttributeError):
            m.layers[0].nonesuch  # noqa: B018


if __name__ == "__main__":
    unittest.main(verbosity=2)
