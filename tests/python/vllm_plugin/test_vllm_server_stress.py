"""fragments' OpenAI server under load, hostile bodies and a killed worker (issue 40; docs/vllm.md "The OpenAI
server"; the numbers in bench/README.md). Slow tier only, FRAG_SLOW=1 (skipped loudly otherwise): each case
starts its own `vllm serve` on vLLM's CPU build (tiny Llama, 127.0.0.1):
  faults tp 1, tp 2   server_faults.py: a worker killed under 8 requests in flight, the server started again
  fuzz tp 1           server_fuzz.py --bodies 10000: no 5xx, no hang, the engine serving afterwards
  load tp 2           server_load.py --clients 64 --minutes 5: nothing lost or crossed, memory flat
~15 min on 2 shared cores. The default tier runs the short versions inside test_vllm_server.py (server_check.py
K: 300 fuzzed bodies, 16 clients for 20 s).

    FRAG_SLOW=1 PYTHONPATH=python:tests/python/vllm_plugin python tests/python/vllm_plugin/test_vllm_server_stress.py
"""
import os
import subprocess
import sys
import unittest

import child_output

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_vllm_server import _missing  # noqa: E402

CASES = {
    "faults_tp1": ["server_faults.py", "1"],
    "faults_tp2": ["server_faults.py", "2"],
    "fuzz_tp1": ["server_fuzz.py", "1", "--bodies", "10000"],
    "load_tp2": ["server_load.py", "2", "--clients", "64", "--minutes", "5"],
}


class VllmServerStressTest(unittest.TestCase):
    pass


def _make(argv):
    def test(self):
        if os.environ.get("FRAG_SLOW") != "1":
            print(f"SKIPPED vLLM server stress {' '.join(argv)}: FRAG_SLOW=1 runs it", file=sys.stderr)
            self.skipTest("FRAG_SLOW=1 runs it")
        why = _missing()
        if why:
            print(f"SKIPPED vLLM server stress {' '.join(argv)}: {why}", file=sys.stderr)
            self.skipTest(why)
        proc = subprocess.run([sys.executable, os.path.join(HERE, argv[0]), *argv[1:]], capture_output=True,
                              text=True, timeout=1800)
        lines = [l for l in proc.stdout.splitlines() if l.startswith(("ok", "FAIL", "engine", "{"))]
        print("\n".join(line[:400] for line in lines))
        if proc.returncode != 0:
            print(child_output.excerpt(proc.stderr), file=sys.stderr)
        self.assertEqual(proc.returncode, 0, "; ".join(l[:300] for l in lines if l.startswith("FAIL")))
    return test


for _name, _argv in CASES.items():
    setattr(VllmServerStressTest, f"test_{_name}", _make(_argv))


if __name__ == "__main__":
    unittest.main(verbosity=2)
