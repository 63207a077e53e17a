"""The front end's checks of a request plan without vLLM (python/fragments/vllm/_plan.py): the bounds on a
plan from an untrusted body, widths at submission, the did-you-mean of a location typo. A model record is
made by hand (an empty fragment table from the C++ classification, tp 1), as a worker writes it.

    PYTHONPATH=python python tests/python/vllm_plugin/test_plan_bounds.py
"""
import json
import os
import tempfile
import time
import unittest
from unittest import mock

import torch
from safetensors.torch import save_file

from fragments import _C
from fragments.vllm import _plan

DOWN = "model.layers.1.mlp.down_proj.input"


def record():
    return {"table": json.loads(_C.classify_layers([], "test")), "qkv_attributes": {}, "refused": {},
            "modules": ["model", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "model.norm"],
            "logits_modules": [], "widths": {DOWN: 256, "model.norm.output": 256}}


def parse(plan, **env):
    with mock.patch.dict(os.environ, env):
        return _plan.RequestPlan.parse(plan, "k", record())


class UntrustedBoundsTest(unittest.TestCase):
    def refused(self, spec, word):
        t0 = time.time()
        with self.assertRaises(ValueError) as ctx:
            _plan.load_untrusted(spec)
        message = str(ctx.exception)
        self.assertIn(word, message)
        self.assertNotIn("\n", message)
        self.assertLess(time.time() - t0, 2.0)
        return message

    def test_a_valid_plan_passes_as_text_and_object(self):
        plan = [{"at": DOWN, "do": "scale", "by": 2.0, "step": [0, 1], "heads": [1]}]
        self.assertEqual(_plan.load_untrusted(json.dumps(plan)), {"interventions": plan})
        self.assertEqual(_plan.load_untrusted({"interventions": plan}), {"interventions": plan})

    def test_size_depth_count(self):
        self.refused("[" * 3000 + "]" * 3000, "nested")
        self.refused([[[[[1]]]]], "nests deeper")
        self.refused(json.dumps([{"at": DOWN, "do": "save", "as": "x" * 900}] * 300), "FRAGMENTS_VLLM_MAX_PLAN_BYTES")
        self.refused([{"at": "m", "do": "zero"}] * 1025, "FRAGMENTS_VLLM_MAX_PLAN_STEPS")
        self.refused([{"at": "m" * 1025, "do": "zero"}], "characters")
        self.refused([{"at": DOWN, "do": "zero", "heads": list(range(5000))}], "items")
        with mock.patch.dict(os.environ, {"FRAGMENTS_VLLM_MAX_PLAN_STEPS": "2"}):
            self.refused([{"at": "m", "do": "zero"}] * 3, "over the server's 2")

    def test_numbers(self):
        for text, word in (('[{"at": "m", "do": "scale", "by": NaN}]', "NaN"),
                           ('[{"at": "m", "do": "scale", "by": -Infinity}]', "Infinity"),
                           ('[{"at": "m", "do": "scale", "by": 1e400}]', "finite"),
                           ('[{"at": "m", "do": "zero", "heads": [%d]}]' % 2 ** 70, "2^53"),
                           ('[{"at": "m", "do": "scale", "by": 1e9}]', "scale by less")):
            self.refused(text, word)

    def test_not_a_plan(self):
        self.refused("12", "found int")
        self.refused("[{", "invalid JSON")
        with mock.patch.dict(os.environ, {"FRAGMENTS_VLLM_MAX_PLAN_STEPS": "many"}):
            self.refused([], "FRAGMENTS_VLLM_MAX_PLAN_STEPS='many'")


class SubmissionChecksTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.vectors = os.path.join(self.tmp.name, "v.safetensors")
        save_file({"steer": torch.ones(256), "short": torch.ones(7), "rows": torch.ones(3, 256),
                   "cube": torch.ones(1, 1, 256)}, self.vectors)

    def error(self, step):
        return parse([step], FRAGMENTS_VLLM_VECTORS=self.vectors).error

    def test_a_value_that_cannot_fit_is_refused_with_the_width(self):
        self.assertIsNone(self.error({"at": DOWN, "do": "add", "value": "@steer"}))
        self.assertIsNone(self.error({"at": DOWN, "do": "set", "value": "@rows"}))  # rows: known when it runs
        self.assertIsNone(self.error({"at": DOWN, "do": "add", "value": "@short", "index": "...,0:7"}))
        for step, shape in (({"at": DOWN, "do": "add", "value": "@short"}, "[rows, 256]"),
                            ({"at": DOWN, "do": "add", "value": "@steer", "index": "...,0:7"}, "[rows, 7]"),
                            ({"at": DOWN, "do": "set", "value": "@cube"}, "[rows, 256]")):
            error = self.error(step)
            self.assertIn("does not fit", error or "")
            self.assertIn(shape, error)
            self.assertIn(step["value"], error)  # the name the user wrote, not the server's file

    def test_unknown_width_and_row_indices_are_left_to_run_time(self):
        self.assertIsNone(self.error({"at": "model.layers.0.mlp.down_proj.input", "do": "add", "value": "@short"}))
        self.assertIsNone(self.error({"at": DOWN, "do": "add", "value": "@short", "index": "50,..."}))

    def test_an_index_beyond_the_width_is_refused(self):
        self.assertIn("index", self.error({"at": DOWN, "do": "zero", "index": "...,300"}) or "")

    def test_a_location_typo_gets_the_closest(self):
        error = parse([{"at": "model.layers.1.mlp.down_prj.input", "do": "zero"}]).error
        self.assertIn(f"did you mean {DOWN}", error)
        self.assertNotIn("did you mean", parse([{"at": "nothing.like.it", "do": "zero"}]).error)


class TableReadOnlyForHeadsTest(unittest.TestCase):
    """The fragment table is read only where a step names segments or heads (a worker parses every request's
    plan: run39's profile put the table's parse at ~0.4 ms a plan): a plan of saves parses with a table the
    parser could not read, one naming heads meets it and resolves heads through a real table."""

    QKV = "model.layers.0.self_attn.qkv_proj"

    def qkv_record(self, table):
        described = [{"path": self.QKV, "class": "QKVParallelLinear", "attributes": dict(
            tp_size=1, tp_rank=0, gather_output=False, total_num_heads=4, total_num_kv_heads=2, head_size=8,
            v_head_size=8), "parameters": {"weight": [64, 32]}}]
        attributes = {self.QKV: {k: v for k, v in described[0]["attributes"].items() if not isinstance(v, bool)}}
        return {"table": json.loads(_C.classify_layers(described, "test")) if table is None else table,
                "qkv_attributes": attributes, "refused": {}, "modules": ["model", self.QKV], "logits_modules": [],
                "widths": {}}

    def test_heads_resolved_through_the_table_and_a_plain_plan_never_reads_it(self):
        heads = [{"at": f"{self.QKV}.output", "do": "zero", "segment": "k", "heads": [1]}]
        plan = _plan.RequestPlan.parse(heads, "k", self.qkv_record(None))
        self.assertIsNone(plan.error)
        self.assertEqual(plan.steps[0].step.index, "...,40:48")  # q: 4 heads of 8, then k's head 1
        unreadable = {"format": "not.a.table/0"}
        saves = [{"at": f"{self.QKV}.output", "do": "save", "as": "qkv"}]
        self.assertIsNone(_plan.RequestPlan.parse(saves, "k", self.qkv_record(unreadable)).error)
        error = _plan.RequestPlan.parse(heads, "k", self.qkv_record(unreadable)).error
        self.assertIsNotNone(error)
        self.assertIn("not.a.table/0", error)


if __name__ == "__main__":
    unittest.main(verbosity=2)
