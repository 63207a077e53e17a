"""fragments._C.Rule (a fragment rule parsed once, for the vLLM worker's steps) against the JSON functions it
replaces there, and _layers.rules: which locations the worker gathers at all."""
import json
import unittest

import torch

from fragments import _C
from fragments.vllm import _layers

QKV2 = {"kind": "qkv", "group": "tp", "group_size": 2, "dim": -1, "num_heads": 4, "num_kv_heads": 2,
        "head_size": 8, "v_head_size": 8}
GATE_UP2 = {"kind": "segments", "group": "tp", "group_size": 2, "dim": -1, "segment_sizes": [16, 16],
            "segment_names": ["gate", "up"]}
PSUM2 = {"kind": "partial_sum", "group": "tp", "group_size": 2}
VOCAB1_PADDED = {"kind": "vocab_shard", "group": "tp", "group_size": 1, "dim": -1, "org_vocab": 50,
                 "padded_vocab": 64}


WHOLE = {"qkv": 64, "segments": 32, "partial_sum": 8}  # each rule's whole width


def at_one(rule):
    return dict(rule, group_size=1)


class RuleTest(unittest.TestCase):
    def test_same_answers_as_the_json_functions(self):
        g = torch.Generator().manual_seed(0)
        for rule in (QKV2, GATE_UP2, PSUM2):
            text = json.dumps(rule)
            parsed = _C.Rule(text)
            self.assertEqual(parsed.collective, _C.collective_for(text), rule["kind"])
            width = WHOLE[rule["kind"]] // (2 if parsed.collective == "all_gather" else 1)
            pieces = [torch.randn(3, width, generator=g) for _ in range(2)]
            whole = parsed.whole_from_pieces(pieces)
            self.assertTrue(torch.equal(whole, _C.whole_from_pieces(text, pieces)), rule["kind"])
            for rank in range(2):
                self.assertTrue(torch.equal(parsed.piece_of_whole(whole, rank), _C.piece_of_whole(text, whole, rank)))
            self.assertIn(_C.describe_rule(text), repr(parsed))

    def test_piece_is_whole_only_for_one_rank_with_nothing_to_drop(self):
        for rule in (QKV2, GATE_UP2, PSUM2):
            self.assertFalse(_C.Rule(json.dumps(rule)).piece_is_whole, rule["kind"])
            one = _C.Rule(json.dumps(at_one(rule)))
            self.assertTrue(one.piece_is_whole, rule["kind"])
            piece = torch.randn(3, WHOLE[rule["kind"]])
            self.assertTrue(torch.equal(one.whole_from_pieces([piece]), piece))  # what the worker skips
        padded = _C.Rule(json.dumps(VOCAB1_PADDED))
        self.assertFalse(padded.piece_is_whole)  # one rank, but its pad entries are dropped
        self.assertEqual(list(padded.whole_from_pieces([torch.zeros(2, 64)]).shape), [2, 50])

    def test_bad_rule_is_refused_with_its_reason(self):
        with self.assertRaisesRegex(Exception, "group_size|group size"):
            _C.Rule(json.dumps(dict(QKV2, group_size=0)))
        with self.assertRaises(Exception):
            _C.Rule("{not json")

    def test_layers_rules_keep_only_locations_to_gather(self):
        fragmented = {"a.qkv_proj.output": QKV2, "a.gate_up_proj.output": at_one(GATE_UP2),
                      "a.down_proj.output": PSUM2, "logits": VOCAB1_PADDED}
        rules = _layers.rules(fragmented)
        self.assertEqual(sorted(rules), ["a.down_proj.output", "a.qkv_proj.output", "logits"])
        self.assertEqual(rules["a.down_proj.output"].collective, "all_reduce")
        self.assertEqual(rules["a.qkv_proj.output"].collective, "all_gather")


if __name__ == "__main__":
    unittest.main()
