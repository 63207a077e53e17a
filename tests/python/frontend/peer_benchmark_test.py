"""bench/peer_benchmark.py on the CPU (issue 31 item 3): a smoke test of its logic, not a measurement.

Runs the benchmark with --device cpu on the tiny Llama (tests/models/llama_tp1, float32) and on a bfloat16
one exported here, and reads its --json: the plain PyTorch model and HF transformers' LlamaForCausalLM, built
on the rank file's weights, give the kit model's logits within the tolerance (the checks the benchmark prints
and exits on); the captured columns are skipped with a message; every eager column and the copy probe have
times. A plain model whose weights differ a little (one layer's o_proj scaled by 1.05) fails its check and
the exit status. Needs tests/models/llama_tp1 under the working directory, tools/export_model.py, bench/, fragkit/, and `fragments`
importable (python/fragments with its built _C); ~1 min on 2 cores.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
TOOLS = os.path.join(ROOT, "tools")
BENCH = os.path.join(ROOT, "bench", "peer_benchmark.py")
TINY = ["--device", "cpu", "--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "8",
        "--kv-heads", "4", "--head-dim", "8", "--vocab", "1000", "--tokens", "12", "--iterations", "2"]
# The same run with the plain model's weights a little off: its check must fail.
PERTURBED = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
import peer_models, torch
load = peer_models.PlainLlama.load_kit
def off(self, sd, vocab):
    load(self, sd, vocab)
    with torch.no_grad():
        self.layers[0].o.weight.mul_(1.05)
    return self
peer_models.PlainLlama.load_kit = off
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerBenchmarkCpuTest(unittest.TestCase):
    def run_bench(self, rank_file, dtype, out, prefix=()):
        env = dict(os.environ, MASTER_PORT=str(free_port() - 1), PYTHONDONTWRITEBYTECODE="1")
        env.pop("RANK", None), env.pop("WORLD_SIZE", None)
        cmd = [sys.executable, *prefix, BENCH, rank_file, *TINY, "--dtype", dtype, "--json", out]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        print(proc.stdout, proc.stderr, sep="\n")
        return proc

    def check_run(self, rank_file, dtype):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "peer.json")
            proc = self.run_bench(rank_file, dtype, out)
            self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
            with open(out) as f:
                data = json.load(f)
        self.assertEqual(data["dtype"], dtype)
        checks = {c["what"]: c for c in data["checks"]}
        for what in ("plain PyTorch eager vs kit model eager",
                     "HF transformers LlamaForCausalLM eager vs kit model eager"):
            self.assertIn(what, checks)
            self.assertTrue(checks[what]["ok"], checks[what])
            # The tolerance is far below the logits' spread: a wrong weight would not pass.
            self.assertLess(checks[what]["tolerance"], 0.2 * data["logits_std"])
        for name, col in data["columns"].items():
            self.assertGreater(col["eager_ms"], 0, name)
            self.assertIsNone(col["captured_ms"], name)  # no CUDA graphs on the CPU
        self.assertIn("captured columns (torch.cuda.CUDAGraph, fragments' graph cache): skipped on the CPU",
                      data["skipped"])
        self.assertIn("skipped on the CPU", proc.stdout)
        self.assertGreater(data["copy"]["bytes_per_s"], 0)
        self.assertGreater(data["floor_ms"], 0)
        self.assertIsNotNone(data["ratios"]["fragments eager / plain eager (target <= 1.3)"])
        # The saves column runs the fastest path (a plan recorded once, run per call) and changes nothing.
        self.assertEqual(data["saves_path"], "model.plan() recorded once, plan.run(ids) per forward")
        saves = {what: c for what, c in checks.items() if what.startswith("fragments, saves at")}
        self.assertEqual(len(saves), 1, saves)  # eager only, on the CPU
        (what, check), = saves.items()
        self.assertTrue(what.endswith(" eager vs nothing registered (bit for bit)"), what)
        self.assertTrue(check["ok"], check)
        return data

    def test_float32(self):
        data = self.check_run("tests/models/llama_tp1/rank{rank}.pt", "float32")
        # fragments with nothing registered is the kit export: equal to the kit model's logits
        self.assertEqual(data["columns"]["fragments, nothing registered"]["eager_max_abs_diff"], 0.0)

    def test_bfloat16(self):
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, os.path.join(TOOLS, "export_model.py"), "--model", "llama", "--tp", "1",
                            "--dtype", "bfloat16", "--out", tmp], check=True, stdout=subprocess.DEVNULL,
                           env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
            self.check_run(os.path.join(tmp, "rank{rank}.pt"), "bfloat16")

    def test_perturbed_plain_model_fails_its_check(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "peer.json")
            proc = self.run_bench("tests/models/llama_tp1/rank{rank}.pt", "float32", out,
                                  prefix=("-c", PERTURBED, os.path.join(ROOT, "bench")))
            self.assertEqual(proc.returncode, 1, proc.stderr[-2000:])
            with open(out) as f:
                checks = {c["what"]: c["ok"] for c in json.load(f)["checks"]}
        self.assertFalse(checks["plain PyTorch eager vs kit model eager"])
        self.assertTrue(checks["HF transformers LlamaForCausalLM eager vs kit model eager"])
        self.assertIn("check plain PyTorch eager vs kit model eager", proc.stdout)
        self.assertIn("FAILED", proc.stdout)


if __name__ == "__main__":
    unittest.main()
