"""bench/gpu_decode_benchmark.py on the CPU (issue 28): a smoke test of its logic, not a measurement.

Runs the benchmark with --device cpu on the tiny Llama (tests/models/llama_tp1, float32) without transformers
and reads its --json: the independent plain PyTorch model with a static KV cache (bench/peer_models.py
PlainLlama.decode) gives the kit model's logits within 1e-4 of their scale over a ragged prefill and 4 decode
steps, every row has a time, the ratio against the independent model and the saves' ratio to nothing
registered are printed, and the attention it names is the rank file's (the kit's SDPA over the cache, as
tests/models exports it now). The same run with the
plain model's weights a little off (one layer's o_proj scaled by 1.05) fails its check and exits 1.
Needs tests/models/llama_tp1, bench/, fragkit/ and `fragments` importable (python/fragments with its _C).
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
BENCH = os.path.join(ROOT, "bench", "gpu_decode_benchmark.py")
TINY = ["--device", "cpu", "--dtype", "float32", "--layers", "2", "--hidden", "64", "--intermediate", "128",
        "--heads", "8", "--kv-heads", "4", "--head-dim", "8", "--vocab", "1000", "--prompt", "8", "--cache", "32",
        "--iterations", "3", "--max-positions", "512", "--batches", "1", "3", "--skip-transformers"]
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


class DecodeBenchmarkCpuTest(unittest.TestCase):
    def run_bench(self, out, prefix=()):
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        cmd = [sys.executable, *prefix, BENCH, "tests/models/llama_tp1/rank0.pt", *TINY, "--json", out]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        print(proc.stdout, proc.stderr, sep="\n")
        return proc

    def test_independent_model_matches_and_is_timed(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "decode.json")
            proc = self.run_bench(out)
            self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
            with open(out) as f:
                data = json.load(f)
        (check,) = data["checks"]
        self.assertTrue(check["ok"], check)
        self.assertLess(check["max_abs_diff"], check["tolerance"])
        for batch in ("1", "3"):
            times = data["batches"][batch]["ms_per_step"]
            self.assertGreater(times["independent plain PyTorch, static cache, CUDA graph"], 0)
            self.assertGreater(times["fragments, nothing registered"], 0)
            self.assertGreater(data["batches"][batch]["fragments_over_independent"], 0)
            self.assertGreater(data["batches"][batch]["saves_over_nothing"], 0)
        self.assertIn("fragments step / independent plain captured step", proc.stdout)
        self.assertIn("saves at 4 locations / nothing registered", proc.stdout)
        self.assertTrue(data["attention"].startswith("SDPA in the cache's dtype"), data["attention"])
        self.assertIn("attention over the cache in", proc.stdout)

    def test_perturbed_independent_model_fails_its_check(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "decode.json")
            proc = self.run_bench(out, prefix=("-c", PERTURBED, os.path.join(ROOT, "bench")))
            self.assertEqual(proc.returncode, 1, proc.stderr[-2000:])
            with open(out) as f:
                (check,) = json.load(f)["checks"]
        self.assertFalse(check["ok"])
        self.assertIn("FAILED", proc.stdout)


if __name__ == "__main__":
    unittest.main()
