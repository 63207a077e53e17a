"""Pipeline stages without an engine (python/fragments/vllm/_stages.py; seconds): which stage acts at each
location, one record from every stage's, the digest every rank compares, and saves merged per request.

    PYTHONPATH=python python tests/python/vllm_plugin/test_vllm_stages.py
"""
import unittest

import torch
from safetensors.torch import load, save

from fragments.vllm import _stages

# Module order as vLLM registers it (named_modules), each stage's own modules only. Like Qwen2-MoE, the final
# norm, LM head and logits processor are built whole on both stages; only the last calls them.
S0 = ["model", "model.embed_tokens", "model.layers", "model.layers.0", "model.layers.0.mlp",
      "model.layers.0.mlp.down_proj", "model.norm", "lm_head", "logits_processor"]
S1 = ["model", "model.embed_tokens", "model.layers", "model.layers.1", "model.layers.1.mlp",
      "model.layers.1.mlp.down_proj", "model.norm", "lm_head", "logits_processor"]


def record(order, layers):
    return {"format": "fragments.vllm/1", "tp_size": 1, "modules": sorted(order), "order": list(order),
            "fragmented": {}, "refused": {}, "widths": {f"{p}.output": 8 for p in order if "down" in p},
            "qkv_attributes": {}, "logits_modules": ["logits_processor"], "taps": [],
            "table": {"layers": [{"path": f"model.layers.{i}.mlp.down_proj"} for i in layers]}}


class StagesTest(unittest.TestCase):
    def test_stage_of(self):
        where = _stages.stage_of([S0, S1])
        self.assertEqual(where["model.layers.0.mlp.down_proj.input"], 0)
        self.assertEqual(where["model.layers.1.mlp.down_proj.output"], 1)
        self.assertEqual(where["model.embed_tokens.output"], 0)  # before the first layer: the first stage
        for loc in ("model.norm.output", "lm_head.output", "logits_processor.output"):  # after it: the last
            self.assertEqual(where[loc], 1, loc)
        self.assertEqual((where["model.input"], where["model.output"]), (0, 1))  # a container spanning stages

    def test_merge(self):
        merged = _stages.merge([record(S0, [0]), record(S1, [1])])
        self.assertEqual(merged["pp_size"], 2)
        self.assertIn("model.layers.1.mlp.down_proj", merged["modules"])
        self.assertEqual([e["path"] for e in merged["table"]["layers"]],
                         ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"])
        self.assertEqual([s["layers"] for s in merged["stages"]], [[0, 0], [1, 1]])
        self.assertNotIn("order", merged)
        other = _stages.merge([record(S0, [0]), record(S1[:-1], [1])])  # a stage that classified otherwise
        self.assertNotEqual(_stages.digest(merged), _stages.digest(other))

    def test_merge_takes(self):
        def answer(name, error=None, status="ok"):
            data = save({name: torch.full((2, 3), 1.0)}) if status == "ok" else None
            return {"k": {"status": status, "error": error, "data": data, "bytes": 24 if data else 0}}
        merged = _stages.merge_takes([answer("a"), None, answer("b", "stage 1 failed"), None], ["k"])["k"]
        self.assertEqual(sorted(load(merged["data"])), ["a", "b"])
        self.assertEqual((merged["status"], merged["error"], merged["bytes"]), ("ok", "stage 1 failed", 48))
        gone = _stages.merge_takes([answer("a", "taken", "taken"), answer("b", "taken", "taken")], ["k"])["k"]
        self.assertEqual(gone["status"], "taken")
        capped = _stages.merge_takes([answer("a"), answer("b")], ["k"], cap=30)["k"]  # one 24-byte save fits
        self.assertEqual((sorted(load(capped["data"])), capped["bytes"]), (["a"], 24))
        self.assertIn("FRAGMENTS_VLLM_MAX_SAVE_BYTES", capped["error"])
        one = answer("a")
        self.assertIs(_stages.merge_takes([one, None], ["k"]), one)  # pp 1: rank 0's answer as it is


if __name__ == "__main__":
    unittest.main()
