"""Python traces replayed from CUDA graphs: bit-identical to eager forwards, at tp 1 and tp 2.

Each round traces an edit, a save at a fragmented location and a logit lens (an ad-hoc call) on two models
of the same file, one eager (cuda_graphs off) and one that replays: a repeated trace keeps its plan
registered (ShardedModel::set_plan) and is captured on its third forward, the lens inside
(frontend_worker.replay_rounds: nine rounds over two plans).

- one GPU: tp 1 (tests/models/llama_tp1); skipped, loudly, where torch sees no GPU.
- tp 2, float32 and bfloat16 (tiny Llamas exported here with tools/export_model.py): on two GPUs over NCCL,
  captured; on a machine with no GPU over Gloo on CPUs, where nothing is captured (the same checks
  otherwise). On a machine with exactly one GPU the tp 2 tests are skipped, loudly: the device build is
  made without Gloo (its CPU ranks cannot meet) and one GPU cannot hold two NCCL ranks. The ranks must agree
  bit for bit and equal tp 1 within the multi-GPU check's tolerance.

Needs tests/models/llama_tp1 under FRAG_TEST_ROOT (default: the working directory), tools/export_model.py,
and `fragments` importable (python/fragments with its built _C).
"""
import os
import subprocess
import sys
import tempfile
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fragments  # noqa: E402
import frontend_worker as worker  # noqa: E402

ROOT = os.environ.get("FRAG_TEST_ROOT", os.getcwd())
TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(HERE))), "tools")  # export_model.py
WIDTH = 64  # the tiny Llama's hidden size
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
IDS = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(0))


class ReplayChecks:
    def check_rounds(self, rounds, where):
        """Every round's replayed values equal the eager model's, bit for bit; the plans moved the logits."""
        for i, (expected, got) in enumerate(rounds):
            for name, a, b in zip(("o_proj input", "lens", "logits"), got, expected):
                self.assertTrue(torch.equal(a, b), f"{where}, round {i}: {name} differs from the eager forward "
                                                   f"(max |diff| {(a.float() - b.float()).abs().max().item():.3g})")
        logits = [got[2] for _, got in rounds]
        self.assertFalse(torch.equal(logits[4], logits[5]), f"{where}: another value changed the logits")
        # (Round 0 is the executor's first run: in fp32 on a GPU it fuses from the second on.)
        self.assertTrue(torch.equal(logits[8], logits[4]), f"{where}: the first plan again computes what it did")

    def check_stats(self, stats, captured, where):
        # Captured: the first plan at round 2, the second at round 7. Replayed: rounds 2-4, 7 and 8.
        expected = {"captures": 2, "replays": 5, "refusals": 0} if captured else \
            {"captures": 0, "replays": 0, "refusals": 0}
        self.assertEqual(stats, expected, where)


@unittest.skipUnless(GPUS >= 1, "needs a CUDA GPU; this machine has none (skipped)")
class OneGpuTest(unittest.TestCase, ReplayChecks):
    def test_a_repeated_trace_replays_what_the_eager_forward_computes(self):
        path = os.path.join(ROOT, "tests", "models", "llama_tp1", "rank0.pt")
        rounds, stats = worker.replay_rounds(0, path, IDS, WIDTH, "cuda:0")
        self.check_rounds(rounds, "tp 1")
        self.check_stats(stats, True, "tp 1")

    def test_decode_graphs_are_bucketed_by_batch_size(self):
        """Rows join one by one up to 6 (max_batch 8): decode steps replay one graph per bucket (1, 2, 4, 8:
        at most 4 captures, not 6) and every row's tokens equal the eager decoder's (cuda_graphs off)."""
        from fragments import _C
        path = os.path.join(ROOT, "tests", "models", "llama_tp1", "rank0.pt")
        prompts = [[1 + r, 2 + r, 3 + r] for r in range(6)]

        def run(graphs):
            model = fragments.load(path, device="cuda:0")
            model._c.cuda_graphs = graphs
            c = model._c
            c.prepare([], [])
            decoder = _C.Decoder(c, 8, 64)
            self.assertEqual(decoder.batch_buckets, [1, 2, 4, 8])
            rows = []
            for prompt in prompts:  # a row joins, then 4 decode steps of every row
                rows.append([int(decoder.prefill([prompt]).argmax(-1)[0])])
                for _ in range(4):
                    last = torch.tensor([r[-1] for r in rows], device="cuda:0")
                    for r, t in zip(rows, decoder.decode(last).argmax(-1).tolist()):
                        r.append(t)
            c.finish(False)
            return rows, c.graph_stats()

        eager, _ = run(False)
        replayed, stats = run(True)
        self.assertEqual(replayed, eager)
        self.assertLessEqual(stats["captures"], 4, stats)
        self.assertGreater(stats["replays"], 0, stats)


# One GPU: two ranks would need Gloo CPU ranks, which the device build (CMake on the GPU machine) has not.
ONE_GPU_SKIP = ("SKIPPED: tp 2 needs 2 GPUs (NCCL, captured) or none (Gloo on CPUs); this machine has exactly "
                "one GPU. Run it on the two-GPU kind (tools/device/README.md, \"Two GPUs\")")


@unittest.skipIf(GPUS == 1, ONE_GPU_SKIP)
class TwoRanksTest(unittest.TestCase, ReplayChecks):
    @classmethod
    def setUpClass(cls):
        cls.folder = tempfile.TemporaryDirectory()
        if GPUS == 0:
            print("gpu_trace_test: no GPU: tp 2 runs over Gloo on CPUs, nothing captured "
                  "(the captured tp 2 path needs a machine with 2 GPUs)", file=sys.stderr)

    @classmethod
    def tearDownClass(cls):
        cls.folder.cleanup()

    def export(self, tp, dtype):
        out = os.path.join(self.folder.name, f"llama_{dtype}_tp{tp}")
        if not os.path.exists(os.path.join(out, f"rank{tp - 1}.pt")):
            subprocess.run([sys.executable, os.path.join(TOOLS, "export_model.py"), "--model", "llama", "--tp",
                            str(tp), "--dtype", dtype, "--out", out], check=True, capture_output=True, timeout=600)
        return os.path.join(out, "rank{rank}.pt")

    def check_tp2(self, dtype):
        on_gpus = GPUS >= 2
        device = "cuda:{rank}" if on_gpus else "cpu"
        reference, _ = worker.replay_rounds(0, self.export(1, dtype).format(rank=0), IDS, WIDTH,
                                            "cuda:0" if on_gpus else "cpu")
        ranks = fragments.launch(worker.replay_rounds, world=2, backend="nccl" if on_gpus else "gloo",
                                 args=(self.export(2, dtype), IDS, WIDTH, device), timeout=120)
        for rank, (rounds, stats) in enumerate(ranks):
            self.check_rounds(rounds, f"tp 2 {dtype}, rank {rank}")
            self.check_stats(stats, on_gpus, f"tp 2 {dtype}, rank {rank}")
        for (_, got0), (_, got1) in zip(ranks[0][0], ranks[1][0]):
            for a, b in zip(got0, got1):
                self.assertTrue(torch.equal(a, b), f"tp 2 {dtype}: the ranks' whole values differ")
        # Against tp 1: multi_gpu_check's tolerances (float32 1e-4; bfloat16 8 roundings of the largest value).
        for i, ((_, got), (ref, _)) in enumerate(zip(ranks[0][0], reference)):
            for name, a, b in zip(("o_proj input", "lens", "logits"), got, ref):
                scale = max(1.0, b.float().abs().max().item())
                bound = 1e-4 * scale if dtype == "float32" else 0.03125 * scale
                diff = (a.float() - b.float()).abs().max().item()
                self.assertLessEqual(diff, bound, f"tp 2 {dtype}, round {i}: {name} vs tp 1")

    def test_tp2_float32(self):
        self.check_tp2("float32")

    def test_tp2_bfloat16(self):
        self.check_tp2("bfloat16")


if __name__ == "__main__":
    if GPUS == 1:
        print("gpu_trace_test: " + ONE_GPU_SKIP, file=sys.stderr)
    unittest.main(verbosity=2)
