"""fragments/vllm/_front.py without vLLM: generate asks an engine for its model record (the fragment table,
locations, widths: the client-side check of each plan at submission) once, not at every call; another engine
is asked its own. The record never changes while an engine runs (WorkerState keeps the one it made at load).

    PYTHONPATH=python python tests/python/vllm_plugin/test_front.py
"""
import types
import unittest
from unittest import mock

from fragments.vllm import _front
from fragments.vllm._plan import EXTRA_KEY

RECORD = {"table": None, "qkv_attributes": [], "modules": ["model.norm"], "refused": {}, "logits_modules": []}


class FakeLLM:
    """An engine that answers fragments_model_record (counted) and generates nothing: every plan below is
    refused at submission (an unknown location), so no request runs and nothing is taken."""

    def __init__(self):
        self.asked = 0

    def collective_rpc(self, method, args=()):
        assert method == "fragments_model_record", method
        self.asked += 1
        return [RECORD]

    def generate(self, prompts, params, use_tqdm=False):
        raise AssertionError("no request should run: every plan is refused")


PLAN = [{"at": "model.nowhere.output", "do": "save", "as": "x"}]


def sampling_params(plan=None, **kwargs):  # vLLM's SamplingParams' one field generate reads
    return types.SimpleNamespace(extra_args={EXTRA_KEY: {"interventions": plan, "key": "k"}} if plan else None)


@mock.patch.object(_front, "sampling_params", sampling_params)
class RecordTest(unittest.TestCase):
    def test_an_engine_is_asked_for_its_record_once(self):
        llm = FakeLLM()
        for _ in range(3):
            out = _front.generate(llm, [{"prompt_token_ids": [1, 2]}], [PLAN], max_tokens=1)
            self.assertIsInstance(out[0], _front.Refused)
            self.assertIn("no such location", out[0].fragments_error)
        self.assertEqual(llm.asked, 1)
        other = FakeLLM()  # another engine: its own record
        _front.generate(other, [{"prompt_token_ids": [1]}], [PLAN], max_tokens=1)
        self.assertEqual((llm.asked, other.asked), (1, 1))

    def test_a_trace_and_generate_share_the_record(self):
        llm = FakeLLM()  # fragments.vllm.VLLM asks record_of at its start; its traces' generate calls follow
        self.assertIs(_front.record_of(llm), RECORD)
        _front.generate(llm, [{"prompt_token_ids": [1]}], [PLAN], max_tokens=1)
        self.assertEqual(llm.asked, 1)

    def test_no_plan_asks_nothing(self):
        llm = FakeLLM()
        llm.generate = lambda prompts, params, use_tqdm=False: []
        _front.generate(llm, [], [], max_tokens=1)
        self.assertEqual(llm.asked, 0)

    def test_an_engine_without_weak_references_is_asked_every_time(self):
        class Slotted:
            __slots__ = ("asked",)
            collective_rpc = FakeLLM.collective_rpc
        llm = Slotted()
        llm.asked = 0
        for _ in range(2):
            _front.generate(llm, [{"prompt_token_ids": [1]}], [PLAN], max_tokens=1)
        self.assertEqual(llm.asked, 2)


if __name__ == "__main__":
    unittest.main(verbosity=2)
