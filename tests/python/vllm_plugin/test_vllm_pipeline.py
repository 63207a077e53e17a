"""Pipeline stages and nodes through vLLM's own mp executor, on vLLM's CPU build against transformers (issue 42;
docs/vllm.md "Stages and nodes"). Each case is one engine in its own process.

Default tier (~2 min on 2 shared cores): Llama at pp 2 through plans (vllm_check.py --pp 2: every saved
location, logits, edits against transformers, read-only plans leaving tokens and logprobs identical, bad plans
refused) and a 4-layer Llama at pp 2 through tracing (pp_check.py: the stage map, every layer's output and the
logit lens at every layer, an edit on stage 0 carried into stage 1).
FRAG_SLOW=1 adds Qwen2-MoE and GPT-NeoX at pp 2, tp 2 x pp 2 (4 workers on 2 cores) through plans and tracing,
a compiled engine at pp 2 (taps over both stages),
two local "nodes" (--nnodes 2: tp 2 across them, and pp 2 across them), the OpenAI server at pp 2
(server_check.py --pp 2) and nnsight's VLLM on the same pp 2 engine (nnsight_compare.py --pp 2: fragments'
values are asserted; nnsight's outcome is printed).

    PYTHONPATH=python:tests/python/vllm_plugin python tests/python/vllm_plugin/test_vllm_pipeline.py
"""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_vllm_plugin import _run_script  # noqa: E402

SLOW = os.environ.get("FRAG_SLOW") == "1"
DEFAULT = [("llama_pp2", "vllm_check.py", ["llama", 1, "--pp", 2]),
           ("trace_pp2", "pp_check.py", [1, 2])]
SLOW_CASES = [("qwen2_moe_pp2", "vllm_check.py", ["qwen2_moe", 1, "--pp", 2]),
              ("gpt_neox_pp2", "vllm_check.py", ["gpt_neox", 1, "--pp", 2]),
              ("llama_tp2_pp2", "vllm_check.py", ["llama", 2, "--pp", 2]),
              ("trace_tp2_pp2", "pp_check.py", [2, 2]),
              ("compiled_pp2", "pp_check.py", [1, 2, "--compiled"]),
              ("nodes_tp2", "pp_check.py", [2, 1, "--nnodes", 2]),
              ("nodes_pp2", "pp_check.py", [1, 2, "--nnodes", 2]),
              ("server_pp2", "server_check.py", [1, "--pp", 2]),
              ("nnsight_pp2", "nnsight_compare.py", ["llama", 1, "--pp", 2])]


class VllmPipelineTest(unittest.TestCase):
    pass


def _make(name, script, args):
    def test(self):
        _run_script(self, script, args, f"vLLM pipeline test {name}", timeout=1200, shown=("lens", "nnsight"))
    return test


for _name, _script, _args in DEFAULT + (SLOW_CASES if SLOW else []):
    setattr(VllmPipelineTest, f"test_{_name}", _make(_name, _script, _args))


if __name__ == "__main__":
    unittest.main()
