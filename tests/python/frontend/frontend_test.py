"""The Python front end (python/fragments) at world 1, 2 and 3 over Gloo, on the reference Llama exports.

Each world runs tests/python/frontend/frontend_worker.py's scenarios on launched ranks; every value must
equal on all ranks, equal the tp=1 run of the same scenarios (fp32, <= 1e-5 relative), and a JSON plan
written by hand must give through `frag run` what the same steps give through the Python API.

Needs (else it fails loudly, never skips silently): the exports tests/models/{llama_tp1, llama_tp2,
llama_pad192_tp1, llama_pad192_tp3}, cli/frag, and `fragments` importable (python/ with _C built).
Run from the repository's runfiles (Bazel) or with FRAG_TEST_ROOT pointing at a tree that has them.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fragments  # noqa: E402
import frontend_worker as worker  # noqa: E402

ROOT = os.environ.get("FRAG_TEST_ROOT", os.getcwd())
MODELS = os.path.join(ROOT, "tests", "models")
FRAG = os.path.join(ROOT, "cli", "frag")
TOLERANCE = 1e-5

# world -> (tp=1 export, tp=N export): the pad192 pair has sizes divisible by 3
WORLDS = {1: ("llama_tp1", "llama_tp1"), 2: ("llama_tp1", "llama_tp2"), 3: ("llama_pad192_tp1", "llama_pad192_tp3")}


def relative(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def token_ids(seed):
    return torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(seed))


def read_safetensors(path):
    from safetensors.torch import load_file
    return load_file(path)


class Reference:
    """tp=1 runs in this process (world 1), once per export."""
    cache = {}

    @classmethod
    def of(cls, export):
        if export not in cls.cache:
            model = fragments.load(os.path.join(MODELS, export, "rank0.pt"))
            results = worker.scenarios(model, token_ids(1), token_ids(2))
            hidden = results["resid"].shape[-1]
            results["plan_trace"] = worker.plan_trace(model, token_ids(1), hidden)
            cls.cache[export] = (model, results)
        return cls.cache[export]


class FrontEndTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        missing = [p for p in [FRAG] + [os.path.join(MODELS, e) for pair in WORLDS.values() for e in pair]
                   if not os.path.exists(p)]
        if missing:
            raise RuntimeError(f"frontend_test needs {', '.join(missing)} (run it under Bazel or set FRAG_TEST_ROOT)")

    def check_world(self, world):
        ref_export, export = WORLDS[world]
        _, ref = Reference.of(ref_export)
        hidden = ref["resid"].shape[-1]
        path = os.path.join(MODELS, export, "rank{rank}.pt")
        started = time.monotonic()
        ranks = fragments.launch(worker.rank_main, world=world, backend="gloo",
                                 args=(path, token_ids(1), token_ids(2), hidden), timeout=60)
        print(f"world {world}: {time.monotonic() - started:.1f} s for the launched ranks", file=sys.stderr)
        results0, errors0 = ranks[0]
        # Every rank sees the same whole tensors and the same errors.
        for rank, (results, errors) in enumerate(ranks[1:], start=1):
            for name, value in results0.items():
                if isinstance(value, dict):
                    for k in value:
                        self.assertTrue(torch.equal(results[name][k], value[k]), f"rank {rank}: {name}.{k}")
                else:
                    self.assertTrue(torch.equal(results[name], value), f"rank {rank}: {name} differs from rank 0")
            self.assertEqual(errors, errors0)
        # Against tp=1.
        for name, value in ref.items():
            if name == "python_calls":
                continue
            if isinstance(value, dict):
                for k in value:
                    self.assertEqual(results0[name][k].shape, value[k].shape, f"{name}.{k}")
                    self.assertLessEqual(relative(results0[name][k], value[k]), TOLERANCE, f"{name}.{k} vs tp=1")
            else:
                self.assertEqual(results0[name].shape, value.shape, name)
                self.assertLessEqual(relative(results0[name], value), TOLERANCE, f"{name} vs tp=1")
        # The edits, the patch and the callable moved the logits (else the comparisons above prove little).
        for name in ("edited", "patched", "applied"):
            self.assertGreater(relative(results0[name], results0["logits"]), 1e-3, f"{name} did not change logits")
        self.assertEqual(results0["python_calls"].item(), 1, "a callable runs once per visit")
        self.assertEqual(results0["gen_steps"].tolist(), [3, 4, 1, 1],
                         "one save per step: the prompt's 4 positions, then one token a step (KV cache)")
        self.assertEqual(list(results0["gen_tokens"].shape), [2, 7])
        self.assertTrue(torch.equal(results0["gen_tokens"][:, :4], token_ids(1)[:, :4]))
        self.assertEqual(ref["python_calls"].item(), 1)
        # The lens at the last layer's output is the logits bit for bit? Only the shape is promised here;
        # its values equal tp=1's (above) and a call outside a trace equals the traced call's chain.
        self.assertEqual(results0["lens"].shape, results0["logits"].shape)
        self.assertLessEqual(relative(results0["after_errors"], results0["logits"]), 0.0,
                             "after the errors a plain trace gives the plain logits")
        self.check_heads(results0)
        self.check_repeats(results0)
        self.check_errors(errors0, world)
        self.check_frag_run(world, export, results0["plan_trace"], hidden)

    def check_repeats(self, r):
        """A trace repeated (its plan kept registered), one with another value, the first again, a plain one."""
        self.assertTrue(torch.equal(r["rep_again"], r["rep_a"]), "the same trace again gives the same logits")
        self.assertTrue(torch.equal(r["rep_saved_again"], r["rep_saved_a"]), "and the same saved value")
        self.assertGreater(relative(r["rep_a"], r["logits"]), 1e-3, "the edit moved the logits")
        self.assertGreater(relative(r["rep_b"], r["rep_a"]), 1e-3, "another value is another plan")
        self.assertTrue(torch.equal(r["rep_a_after_b"], r["rep_a"]), "the first plan again, nothing of the second")
        self.assertTrue(torch.equal(r["rep_plain"], r["logits"]), "a plain trace after them: the plain logits")

    def check_heads(self, r):
        """Head views equal the reshaped whole tensor; head edits land where they say."""
        (q0, q1, qd), (k0, k1, kd), (v0, v1, vd) = r["h_layout"].view(3, 3).tolist()
        self.assertEqual((q0, k0, v0), (0, q1, k1))
        self.assertEqual(v1, r["h_whole"].shape[-1])
        whole = r["h_whole"]
        self.assertTrue(torch.equal(r["h_k"], whole[..., k0:k1]))
        self.assertTrue(torch.equal(r["h_k1"], whole[..., k0:k1].unflatten(-1, (-1, kd))[..., 1, :]))
        self.assertTrue(torch.equal(r["h_q_last"], whole[..., q0:q1].unflatten(-1, (-1, qd))[..., -1, :]))
        self.assertTrue(torch.equal(r["h_v0"], whole[..., v0:v1].unflatten(-1, (-1, vd))[..., 0, :]))
        self.assertTrue(torch.equal(r["h_o3"], r["h_o"].unflatten(-1, (-1, vd))[..., 3, :]))
        edited = r["h_edited_qkv"]
        self.assertTrue(torch.equal(edited[..., k0 + kd:k0 + 2 * kd], torch.zeros_like(edited[..., :kd])))
        self.assertTrue(torch.equal(edited[..., :qd], whole[..., :qd] * 0.5))
        self.assertTrue(torch.equal(edited[..., qd:k0 + kd], whole[..., qd:k0 + kd]), "other heads untouched")
        self.assertTrue(torch.equal(edited[..., k0 + 2 * kd:], whole[..., k0 + 2 * kd:]), "other heads untouched")
        self.assertGreater(relative(r["h_edited"], r["logits"]), 1e-3, "head edits did not change logits")

    def check_errors(self, errors, world):
        self.assertIn("did you mean mlp", errors["unknown_attribute"])
        self.assertIn("model.layers[7]: it has 2 modules", errors["unknown_layer"])
        for name in ("wrong_shape", "wrong_full_shape"):
            self.assertIn("model.layers.0.output", errors[name])
        self.assertRegex(errors["wrong_shape"], r"value given in Python of shape \[7\] does not fit the selected "
                                                r"whole of shape \[2, \d+\]")
        self.assertRegex(errors["wrong_full_shape"], r"value given in Python has last dim 5, but the selected whole "
                                                     r"has width \d+")
        self.assertIn("read before its trace ran", errors["early_read"])
        self.assertIn("model.layers.1.output: model.layers.0.output.save() has no value yet", errors["own_trace_value"])
        if world > 1:
            self.assertIn("rank-local", errors["rank_local"])
        else:  # at tp=1 nothing is rank-local: the same edit is fine
            self.assertEqual(errors["rank_local"], "no error")
        self.assertIn("inside `with model.trace(ids):`", errors["outside_trace"])
        self.assertIn("FragError", errors["callable_raises"])  # every rank raises, naming the rank that failed
        self.assertIn("model.layers.1.output: apply#0 raised ValueError: callable failed on purpose",
                      errors["callable_raises"])
        if world > 1:
            self.assertIn(f"rank {world - 1}: ", errors["callable_raises"])
            self.assertIn("different tensors on different ranks", errors["callable_differs"])
        else:
            self.assertEqual(errors["callable_differs"], "no error")  # one rank cannot differ from itself

    def check_frag_run(self, world, export, traced, hidden):
        """The hand-written JSON plan through `frag run` equals the same steps through Python."""
        with tempfile.TemporaryDirectory() as folder:
            from safetensors.torch import save_file
            save_file({"v": worker._vector(hidden, 1)}, os.path.join(folder, "values.safetensors"))
            with open(os.path.join(folder, "plan.json"), "w") as f:
                json.dump(worker.JSON_PLAN, f)
            with open(os.path.join(folder, "ids.txt"), "w") as f:
                for row in token_ids(1).tolist():
                    f.write(" ".join(map(str, row)) + "\n")
            out = os.path.join(folder, "out.safetensors")
            files = [os.path.join(MODELS, export, f"rank{r}.pt") for r in range(world)]
            run = subprocess.run([FRAG, "run", "--world", str(world), *files, "--input", os.path.join(folder, "ids.txt"),
                                  "--plan", os.path.join(folder, "plan.json"), "--out", out, "--timeout", "60"],
                                 capture_output=True, text=True, timeout=300)
            self.assertEqual(run.returncode, 0, run.stderr)
            cli = read_safetensors(out)
        for name, value in traced.items():
            self.assertTrue(torch.equal(cli[name], value), f"{name}: frag run and the Python trace differ "
                                                           f"({relative(value, cli[name]):.1e})")

    def test_world_1(self):
        self.check_world(1)

    def test_world_2(self):
        self.check_world(2)

    def test_world_3(self):
        self.check_world(3)

    def test_patching_moves_logits_as_at_tp1(self):
        model, ref = Reference.of("llama_tp1")
        # Patching with the source's own layer output on the source's ids changes nothing: the patch is exact.
        with model.trace(token_ids(2)):
            model.model.layers[0].output = ref["patch_source"]
            same = model.output.save()
        with model.trace(token_ids(2)):
            plain = model.output.save()
        self.assertTrue(torch.equal(same.value, plain.value))

    def test_launch_failure_is_shown_once_with_rank(self):
        started = time.monotonic()
        with self.assertRaises(fragments.RankFailed) as caught:
            fragments.launch(worker.fail_on_rank, world=2, args=(1, os.path.join(MODELS, "llama_tp2", "rank{rank}.pt")),
                             timeout=5)
        elapsed = time.monotonic() - started
        message = str(caught.exception)
        self.assertEqual(caught.exception.rank, 1)
        self.assertIn("rank 1 of 2 failed", message)
        self.assertIn("KeyError: 'planted failure'", message)
        self.assertIn("fail_on_rank", message)  # the traceback
        self.assertEqual(message.count("Traceback"), 1, message)
        self.assertLess(elapsed, 5 + 30, "the other rank was not ended within the timeout")

    def test_launch_under_torchrun(self):
        model, _ = Reference.of("llama_tp1")
        with model.trace(torch.tensor([[3, 1, 4, 1, 5, 9]])):
            expected = model.output.save()
        with tempfile.TemporaryDirectory() as folder:
            # --log-dir: torch elastic's own folder in ours (by default a torchelastic_* one left in /tmp)
            run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                  "--log-dir", os.path.join(folder, "elastic"), os.path.join(HERE, "torchrun_script.py"),
                                  os.path.join(MODELS, "llama_tp2", "rank{rank}.pt"), folder],
                                 capture_output=True, text=True, timeout=300)
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
            for rank in range(2):
                with open(os.path.join(folder, f"launched{rank}.txt")) as f:
                    self.assertEqual(f.read(), f"[{rank}]", "launch ran this process's rank only")
                logits = torch.load(os.path.join(folder, f"logits{rank}.pt"))
                self.assertLessEqual(relative(logits, expected.value), TOLERANCE, f"rank {rank} vs tp=1")

    def test_a_plan_changed_on_one_rank_fails_both_within_the_timeout(self):
        # A repeated trace keeps its plan registered and skips the ranks' digest exchange, so a rank that
        # changes its plan meets a rank that did not in that exchange, not in a collective: it must fail
        # with the reason, and the other rank's collective must fail too, both within the timeout.
        timeout = 5
        ranks = fragments.launch(worker.plan_changed_on_one_rank, world=2, backend="gloo",
                                 args=(os.path.join(MODELS, "llama_tp2", "rank{rank}.pt"), token_ids(1)),
                                 timeout=timeout)
        (error0, seconds0), (error1, seconds1) = ranks
        self.assertIn("every rank must change its plan alike", error1)
        self.assertIn("FragError", error1)
        self.assertNotEqual(error0, "no error", "rank 0's forward ran against a rank that never joined it")
        for rank, seconds in enumerate((seconds0, seconds1)):
            self.assertLess(seconds, timeout + 20, f"rank {rank} took {seconds:.1f} s to fail")

    def test_rewritten_file_loads_with_plain_jit_load(self):
        with tempfile.TemporaryDirectory() as folder:
            rewritten = os.path.join(folder, "rank0.pt")
            run = subprocess.run([FRAG, "rewrite", os.path.join(MODELS, "llama_tp1", "rank0.pt"), "-o", rewritten],
                                 capture_output=True, text=True)
            self.assertEqual(run.returncode, 0, run.stderr)
            # Without `import fragments` the frag:: ops are unknown to TorchScript.
            plain = subprocess.run([sys.executable, "-c", f"import torch; torch.jit.load({rewritten!r})"],
                                   capture_output=True, text=True)
            self.assertNotEqual(plain.returncode, 0)
            self.assertIn("frag::", plain.stderr)
            module = torch.jit.load(rewritten)  # this process imported fragments
            original = torch.jit.load(os.path.join(MODELS, "llama_tp1", "rank0.pt"))
            ids = token_ids(1)
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            try:
                a, b = module(ids, positions), original(ids, positions)
            except Exception:  # noqa: BLE001 - forward(ids) models
                a, b = module(ids), original(ids)
            self.assertTrue(torch.equal(a, b))

    def test_either_import_order_exports_and_runs_in_one_process(self):
        # fragkit defines the frag:: ops from Python when none exist; `import fragments` afterwards drops
        # them before its C++ ops load (LibTorch would abort on the clash). In either order one process
        # exports a kit model and runs it through fragments, and the ops are fragments' C++ ones.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), ROOT]))
        script = """
import os, sys, tempfile, torch
{imports}
from fragkit.export import export
from fragkit import models
assert not fragkit.ops.DEFINED_HERE, "fragkit's Python definitions are still in use"
with tempfile.TemporaryDirectory() as out:
    paths = export(models.llama_builder(), 1, out)
    ids = torch.tensor([[1, 2, 3, 4]])
    model = fragments.load(paths[0])
    with model.trace(ids):
        logits = model.output.save()
    plain = torch.jit.load(paths[0])(ids)
    assert torch.equal(logits.value, plain), "fragments' logits differ from the plain module's"
    print("ok", tuple(logits.value.shape))
"""
        for imports in ("import fragkit, fragkit.ops\nimport fragments", "import fragments\nimport fragkit, fragkit.ops"):
            run = subprocess.run([sys.executable, "-c", script.format(imports=imports)], capture_output=True,
                                 text=True, env=env, timeout=300)
            self.assertEqual(run.returncode, 0, f"{imports!r}: {run.stderr[-2000:]}")
            self.assertIn("ok (1, 4,", run.stdout, imports)

    def test_module_tree_and_locations(self):
        model, _ = Reference.of("llama_tp1")
        self.assertEqual(len(model.model.layers), 2)
        self.assertEqual(model.model.layers[-1]._path, "model.layers.1")
        listed = model.locations()
        self.assertEqual(listed["format"], "fragments.inspect/1")
        cli = subprocess.run([FRAG, "inspect", "--json", os.path.join(MODELS, "llama_tp1", "rank0.pt")],
                             capture_output=True, text=True)
        self.assertEqual(cli.returncode, 0, cli.stderr)
        from_cli = json.loads(cli.stdout)
        self.assertIn("model.layers.0.self_attn.qkv_proj.output", from_cli["heads"])  # there is something to compare
        for key in ("fragmented", "rank_local", "whole", "layers", "tp_size", "heads"):
            self.assertEqual(listed[key], from_cli[key], key)
        with self.assertRaises(AttributeError) as caught:
            model.model.norm.input2  # noqa: B018
        self.assertIn("did you mean input", str(caught.exception))

    def test_cuda_graphs_switch_and_a_cpu_never_captures(self):
        # Capture and replay are tested on a GPU (tests/program/cuda_test.cpp); here the Python switch and
        # its counters: CPU forwards always run op by op, however often a trace repeats.
        model = fragments.load(os.path.join(MODELS, "llama_tp1", "rank0.pt"))
        self.assertTrue(model.cuda_graphs, "on by default")
        for _ in range(4):
            with model.trace(token_ids(1)):
                saved = model.model.layers[0].output.save()
            self.assertEqual(saved.value.shape[0], 2)
        self.assertEqual(model.graph_stats(), {"captures": 0, "replays": 0, "refusals": 0})
        model.cuda_graphs = False
        self.assertFalse(model.cuda_graphs)

    def test_a_repeated_trace_reuses_its_plan_only_while_it_is_registered(self):
        # A trace whose steps equal the last one's is not parsed again (fragments._C counts the steps it reads
        # into plan steps); a registration made in between (here: generation's own plan) makes it register again.
        model = fragments.load(os.path.join(MODELS, "llama_tp1", "rank0.pt"))
        start = model._c.steps_read

        def parsed():
            return model._c.steps_read - start

        def trace(location="output"):
            with model.trace(token_ids(1)):
                saved = getattr(model.model.layers[1], location).save()
            return saved.value

        first = trace()
        self.assertEqual(parsed(), 1)
        self.assertTrue(torch.equal(trace(), first))
        self.assertEqual(parsed(), 1, "the same steps again: not parsed again")
        with model.generate(token_ids(1), max_new_tokens=1):
            model.model.layers[0].output.save()
        self.assertEqual(parsed(), 2)
        again = trace()
        self.assertEqual(parsed(), 3, "registration changed in between: parsed and registered again")
        self.assertTrue(torch.equal(again, first))
        trace("input")
        self.assertEqual(parsed(), 4, "other steps: parsed")
        self.assertTrue(torch.equal(trace(), first))
        self.assertEqual(parsed(), 5)

if __name__ == "__main__":
    unittest.main(verbosity=2)
