"""fragments' vLLM plugin on vLLM's CPU build against transformers (vllm_check.py: one engine per case,
each in its own process: vLLM engines do not share a process cleanly).

Default tier (CI): Llama at tp 1 and 2 and Qwen2-MoE at tp 2 (three engine starts, ~2-3 min each on 2
shared cores). FRAG_SLOW=1 adds every family of families.FAMILIES at tp 1 and 2 and Llama at tp 3
(6 heads, 3 kv heads) and Llama at tp 2 with one kv head
(replicated on both ranks). Skipped, loudly, where vLLM or the extension is missing.

    PYTHONPATH=python:tests/python/vllm_plugin python tests/python/vllm_plugin/test_vllm_plugin.py
"""
import importlib.util
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = [("llama", 1, 4, 2), ("llama", 2, 4, 2), ("qwen2_moe", 2, 4, 2)]
SLOW = [(f, tp, 4, 2) for f in ("qwen2", "qwen3", "gemma2", "gpt_neox") for tp in (1, 2)] + \
       [("qwen2_moe", 1, 4, 2), ("llama", 3, 6, 3), ("llama_kv1", 2, 4, 1)]
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
            print(proc.stderr[-6000:], file=sys.stderr)
        self.assertEqual(proc.returncode, 0, f"{family} tp {tp}: " + "; ".join(l for l in lines if l.startswith("FAIL")))
    return test


for _family, _tp, _heads, _kv in CASES:
    setattr(VllmPluginTest, f"test_{_family}_tp{_tp}", _make(_family, _tp, _heads, _kv))


if __name__ == "__main__":
    unittest.main(verbosity=2)
