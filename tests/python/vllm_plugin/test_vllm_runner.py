"""fragments/vllm/_runner.py without an engine: how the plugin reads Model Runner V1's and V2's batches, refuses
a runner it cannot read, and steers CUDA-graph dispatch (vLLM's graphs kept for steps without edits; the
PIECEWISE candidate or no graph for steps that edit), and the worker's slots: what captured taps copy. vLLM's own classes where they import on this machine
(CUDAGraphMode, V2's BatchExecutionDescriptor and CudaGraphManager.dispatch), and stand-ins of the runners'
attributes as vLLM 0.24 lays them out (gpu_model_runner.py, gpu/model_runner.py, gpu/input_batch.py). The GPU
machine runs the real thing: gpu_suite.py.

    PYTHONPATH=python python tests/python/vllm_plugin/test_vllm_runner.py
"""
import importlib.util
import sys
import types
import unittest

import numpy as np

MISSING = None if importlib.util.find_spec("vllm") else "vllm is not installed (tools/install_deps.sh installs it)"
if MISSING:
    print(f"SKIPPED vLLM runner tests: {MISSING}", file=sys.stderr)


def ns(**kw):
    return types.SimpleNamespace(**kw)


def v1_runner():
    """A V1 runner mid-step: three requests, a decode (prompt 5, 5 computed), a 4-token prefill chunk of a
    10-token prompt, and a 3-token prompt's whole prefill."""
    batch = ns(req_ids=["a", "b", "c"], num_computed_tokens_cpu=np.array([5, 0, 0]),
               num_prompt_tokens=np.array([5, 10, 3]))
    return ns(input_batch=batch, query_start_loc=ns(np=np.array([0, 1, 5, 8])), vllm_config=ns(),
              requests={"a": ns(sampling_params="params of a")})


class _Manager:
    """V2's CudaGraphManager.dispatch over a FULL decode candidate and a PIECEWISE one (vLLM's own method)."""

    def __init__(self, mixed):
        from vllm.config import CUDAGraphMode
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor, CudaGraphManager
        full = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=8, num_reqs=8, uniform_token_count=1)
        other = BatchExecutionDescriptor(cg_mode=mixed, num_tokens=8, num_reqs=None if mixed != CUDAGraphMode.FULL
                                         else 8)
        self._candidates = {(n, 0): [full, other] for n in range(9)}
        self._graphs_captured = True
        self._lora_dispatch_map = {}
        self.dispatch = types.MethodType(CudaGraphManager.dispatch, self)

    def _resolve_effective_loras(self, n):
        return n


@unittest.skipIf(MISSING, MISSING)
class RunnerTest(unittest.TestCase):
    def test_v1_rows_steps_and_logits_rows(self):
        from fragments.vllm import _runner
        view = _runner.adapt(v1_runner())
        self.assertEqual(view.kind, "V1")
        rows = view.rows()
        self.assertEqual([(r.req_id, r.index, r.start, r.stop, r.step, r.samples) for r in rows],
                         [("a", 0, 0, 1, 1, True), ("b", 1, 1, 5, 0, False), ("c", 2, 5, 8, 0, True)])
        self.assertEqual(view.sampling_params("a"), "params of a")
        self.assertIsNone(view.sampling_params("z"))

    def test_v2_reads_the_batch_prepare_inputs_built(self):
        from fragments.vllm import _runner
        built = ns(req_ids=["d", "p"], query_start_loc_np=np.array([0, 1, 7]), num_computed_tokens_np=np.array([9, 0]),
                   idx_mapping_np=np.array([3, 0]))
        runner = ns(req_states=ns(prompt_len=ns(np=np.array([6, 0, 0, 7]))), vllm_config=ns(),
                    prepare_inputs=lambda scheduler_output, desc: built)
        view = _runner.adapt(runner)
        self.assertEqual(view.kind, "V2")
        view.begin_step()
        self.assertEqual(view.rows(), [])  # before vLLM builds this step's batch: no rows, no work
        self.assertIs(runner.prepare_inputs("sched", "desc"), built)  # vLLM's call, through the plugin's wrapper
        self.assertEqual([(r.req_id, r.start, r.stop, r.step) for r in view.rows()], [("d", 0, 1, 3), ("p", 1, 7, 0)])

    def test_a_runner_it_cannot_read_is_refused_in_one_line(self):
        from fragments.vllm import _runner
        with self.assertRaises(RuntimeError) as e:
            _runner.adapt(ns(vllm_config=ns()))
        self.assertIn("neither Model Runner V1 nor V2", str(e.exception))
        self.assertNotIn("\n", str(e.exception))
        with self.assertRaises(RuntimeError) as e:
            _runner.adapt(ns(vllm_config=ns(speculative_config=object()), input_batch=1, query_start_loc=1))
        self.assertIn("speculative decoding", str(e.exception))

    def test_v1_dispatch_guard(self):
        """Split taps: a step that edits takes the PIECEWISE graph (its taps run between the pieces); taps in
        slots: it takes no graph (every graph replays its taps as copies only). Either way a read-only step keeps
        vLLM's choice, and the view records what ran."""
        from vllm.config import CUDAGraphMode
        from fragments.vllm import _runner
        for no_graph, editing_mode in ((False, CUDAGraphMode.PIECEWISE), (True, CUDAGraphMode.NONE)):
            seen = []

            def dispatch(num_tokens, uniform_decode=False, has_lora=False, num_active_loras=0, valid_modes=None,
                         invalid_modes=None):  # vLLM's order of preference: FULL, PIECEWISE, NONE
                seen.append(invalid_modes)
                invalid = invalid_modes or set()
                mode = next(m for m in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE)
                            if m not in invalid)
                return mode, f"desc {num_tokens}"
            runner = v1_runner()
            runner.cudagraph_dispatcher = ns(dispatch=dispatch)
            view = _runner.adapt(runner)
            editing = [False]
            view.guard_graphs(lambda: editing[0], no_graph=no_graph)
            view.begin_step()
            self.assertEqual(view.graph, "NONE")
            self.assertEqual(runner.cudagraph_dispatcher.dispatch(8, uniform_decode=True),
                             (CUDAGraphMode.FULL, "desc 8"))
            self.assertEqual(view.graph, "FULL")  # a read-only step keeps vLLM's FULL graph: the slots serve it
            self.assertIsNone(seen[-1])
            editing[0] = True
            self.assertEqual(runner.cudagraph_dispatcher.dispatch(8, uniform_decode=True)[0], editing_mode)
            self.assertEqual(seen[-1], {CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE} if no_graph else
                             {CUDAGraphMode.FULL})
            self.assertEqual(view.graph, editing_mode.name)
            view.begin_step()
            self.assertEqual(view.graph, "NONE")  # each step's own

    def test_v2_dispatch_guard(self):
        from vllm.config import CUDAGraphMode
        from fragments.vllm import _runner
        P, F, N = CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL, CUDAGraphMode.NONE
        for mixed, no_graph, editing_mode in ((P, False, P), (F, False, N), (P, True, N), (F, True, N)):
            runner = ns(req_states=ns(), vllm_config=ns(), prepare_inputs=lambda *a: None, cudagraph_manager=None)
            view = _runner.adapt(runner)
            editing = [False]
            view.guard_graphs(lambda: editing[0], no_graph=no_graph)
            runner.cudagraph_manager = _Manager(mixed)  # vLLM makes it with the KV cache, after load_model
            view.begin_step()
            self.assertEqual(runner.cudagraph_manager.dispatch(4, 4, 1, num_active_loras=0).cg_mode, F)
            self.assertEqual(view.graph, "FULL")
            editing[0] = True
            desc = runner.cudagraph_manager.dispatch(4, 4, 1, num_active_loras=0)
            self.assertEqual(desc.cg_mode, editing_mode, (mixed, no_graph))
            self.assertEqual((desc.num_tokens, desc.num_reqs), (4, 4) if editing_mode == N else (8, None))
            self.assertEqual(view.graph, editing_mode.name)


@unittest.skipIf(MISSING, MISSING)
class GraphWayTest(unittest.TestCase):
    """How taps meet CUDA graphs (FRAGMENTS_VLLM_GRAPH_TAPS): split (taps are splitting ops of vLLM's piecewise
    graphs) or slots (taps stay inside vLLM's pieces, as compiled for plain vLLM, and every captured graph copies
    their values into slots)."""

    def config(self, mode):
        from vllm.config import CUDAGraphMode
        return ns(cudagraph_mode=getattr(CUDAGraphMode, mode), splitting_ops=["vllm::unified_attention"])

    def test_the_way_is_read_once_with_one_line_for_a_bad_word(self):
        from fragments.vllm import _tap
        self.assertEqual(_tap.graph_way({}), "slots")
        self.assertEqual(_tap.graph_way({_tap.GRAPH_TAPS_ENV: " Split "}), "split")
        with self.assertRaises(ValueError) as e:
            _tap.graph_way({_tap.GRAPH_TAPS_ENV: "graphs"})
        self.assertIn("FRAGMENTS_VLLM_GRAPH_TAPS='graphs': expected one of slots, split", str(e.exception))

    def test_split_adds_the_tap_to_vllms_splitting_ops_once(self):
        from fragments.vllm import _tap
        cc = self.config("FULL_AND_PIECEWISE")
        self.assertEqual(_tap.arrange_graphs(cc, "split"), "piecewise")
        self.assertEqual(_tap.arrange_graphs(cc, "split"), "piecewise")
        self.assertEqual(cc.splitting_ops, ["vllm::unified_attention", _tap.OP])
        self.assertEqual(_tap.arrange_graphs(self.config("FULL"), "split"), "eager")

    def test_slots_leave_vllms_pieces_as_they_are(self):
        from fragments.vllm import _tap
        for mode in ("FULL_AND_PIECEWISE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY"):
            cc = self.config(mode)
            self.assertEqual(_tap.arrange_graphs(cc, "slots"), "slots", mode)
            self.assertEqual(cc.splitting_ops, ["vllm::unified_attention"], mode)
        self.assertEqual(_tap.arrange_graphs(self.config("NONE"), "slots"), "none")


@unittest.skipIf(MISSING, MISSING)
class SlotsTest(unittest.TestCase):
    """The worker's slots without a GPU: what a capture records (_slot_copy), which replays are drained
    (end_step), and an opaque tap's fate in each way. WorkerState's methods on a stand-in state."""

    def state(self, graphs, largest=8):
        from collections import Counter
        from fragments.vllm import _durations, _worker
        s = ns(slots={}, graphs=graphs, refused={}, publish=None, _record={"refused": {}}, leading_batch=False,
               runner=ns(vllm_config=ns(compilation_config=ns(max_cudagraph_capture_size=largest))),
               step_counts=Counter(), host_s=Counter(), durations=_durations.StepDurations(), taps=["a.output"],
               tap_calls={"a.output": 0},
               copies=ns(seal=lambda saves: None), saves=None, in_step=True, executing=True, acting=True,
               editing=False, step_work=None, steady=None, draining=None)
        for name in ("_slot_copy", "_token_rows", "_drain_slots", "end_step", "tap_opaque"):
            setattr(s, name, types.MethodType(getattr(_worker.WorkerState, name), s))
        return s

    def test_a_capture_sizes_the_slot_for_vllms_largest_graph_and_copies_its_rows(self):
        import torch
        s = self.state("slots", largest=8)
        s._slot_copy("a.output", torch.ones(2, 3))  # the first capture need not be the largest
        self.assertEqual(tuple(s.slots["a.output"].shape), (8, 3))
        s._slot_copy("a.output", torch.full((8, 3), 2.0))
        s.leading_batch = True  # vLLM's Transformers backend: transformers' modules see [1, tokens, width]
        s._slot_copy("a.output", torch.full((1, 1, 3), 5.0))
        self.assertEqual(s.slots["a.output"][:, 0].tolist(), [5.0] + [2.0] * 7)
        with self.assertRaises(RuntimeError) as e:
            s._slot_copy("a.output", torch.ones(2, 4))
        self.assertIn("a.output", str(e.exception))
        self.assertNotIn("\n", str(e.exception))

    def test_which_replays_are_drained(self):
        for graphs, drained in (("slots", {"FULL", "PIECEWISE"}), ("piecewise", {"FULL"})):
            for graph in ("NONE", "PIECEWISE", "FULL"):
                s = self.state(graphs)
                s.view = ns(graph=graph)
                ran = []
                s._drain_slots = lambda: ran.append(graph)
                s.end_step()
                self.assertEqual(ran, [graph] if graph in drained else [], (graphs, graph))
                self.assertFalse(s.in_step)

    def test_a_drain_counts_each_slotted_tap_once_and_acts_on_its_rows(self):
        import torch
        s = self.state("slots")
        s._slot_copy("a.output", torch.arange(6.0).view(2, 3))
        seen = []
        s._work = lambda: {"a.output": ["work"]}
        s._act = lambda loc, rows, work: seen.append((loc, rows[:2].tolist(), work))
        s._drain_slots()
        self.assertEqual(s.tap_calls, {"a.output": 1})
        self.assertEqual(seen, [("a.output", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], ["work"])])

    def test_an_opaque_tap_is_refused_only_where_taps_split_the_graphs(self):
        s = self.state("slots")
        s.tap_opaque("m.shared_expert.output")
        self.assertEqual(s.refused, {})  # its capture recorded its slot copy like every other tap's
        s = self.state("piecewise")
        s.tap_opaque("m.shared_expert.output")
        self.assertIn("opaque", s.refused["m.shared_expert.output"])


@unittest.skipIf(MISSING, MISSING or "")
class OpaqueTapTest(unittest.TestCase):
    """A tap's hook that runs as Python while a CUDA graph is captured (inside an op torch.compile does not trace,
    like vLLM's fused-MoE op on a GPU) gets its location refused; a hook torch.compile traced never runs as
    Python, and one outside any capture (the logits processor) is served as it is."""

    def setUp(self):
        import torch
        from unittest import mock
        from fragments.vllm import _tap
        self.torch, self.mock, self.tap = torch, mock, _tap
        self.seen = []
        self.old = (_tap.body, _tap.opaque)
        _tap.body, _tap.opaque = None, self.seen.append

    def tearDown(self):
        self.tap.body, self.tap.opaque = self.old

    def model(self):
        torch = self.torch
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        self.tap.place({"0": m[0], "1": m[1]}, ["0.output", "1.input"])
        return m

    def test_a_hook_run_as_python_during_a_capture_is_reported(self):
        m = self.model()
        with self.mock.patch.object(self.tap, "_capturing", return_value=True):
            m(self.torch.ones(2, 4))
        self.assertEqual(sorted(self.seen), ["0.output", "1.input"])

    def test_outside_a_capture_nothing_is_reported(self):
        self.model()(self.torch.ones(2, 4))
        self.assertEqual(self.seen, [])

    def test_a_hook_that_torch_compile_traced_never_runs_as_python(self):
        torch = self.torch
        torch._dynamo.reset()
        m = torch.compile(self.model(), fullgraph=True, backend="aot_eager")
        with self.mock.patch.object(self.tap, "_capturing", return_value=True):
            m(torch.ones(2, 4))  # traced (the branch pruned), then run as compiled code
            m(torch.ones(2, 4))
        self.assertEqual(self.seen, [])

    def test_the_worker_refuses_the_location_once_and_republishes(self):
        from fragments.vllm import _worker
        published = []
        state = types.SimpleNamespace(refused={}, publish=published.append, _record={"refused": {}},
                                      graphs="piecewise")
        _worker.WorkerState.tap_opaque(state, "model.layers.0.mlp.shared_expert.down_proj.output")
        _worker.WorkerState.tap_opaque(state, "model.layers.0.mlp.shared_expert.down_proj.output")
        why = state.refused["model.layers.0.mlp.shared_expert.down_proj.output"]
        self.assertIn("enforce_eager=True", why)
        self.assertEqual(len(published), 1)
        self.assertEqual(state._record["refused"], state.refused)  # the record plans are checked against


@unittest.skipIf(MISSING, MISSING or "")
class UnfuseTappedAddmmTest(unittest.TestCase):
    """fragments/vllm/_addmm.py: Inductor's post-grad graph of a biased linear layer whose output is tapped, in,
    the pass, FileCheck out. Inductor unfuses a float32 addmm only on a GPU; here the pass runs with gpu_only off
    on the CPU (what it rewrites is the same graph), and the compiled result is checked against eager."""

    def setUp(self):
        import torch
        from fragments.vllm import _addmm, _tap  # noqa: F401 - _tap registers fragments::tap
        self.torch, self.addmm = torch, _addmm

    def compile(self, fn, args, gpu_only=False):
        """(graph before, graph after, rewrites, result) of fn compiled by Inductor with the pass as its
        post_grad_custom_pre_pass."""
        torch = self.torch
        seen = {}
        rewrite = self.addmm.UnfuseTappedAddmm(gpu_only=gpu_only)

        class Recording(self.addmm.UnfuseTappedAddmm):
            def __call__(self, graph):
                seen["before"] = str(graph)
                rewrite(graph)
                seen["after"] = str(graph)

        class AfterPatterns(self.addmm.UnfuseTappedAddmm):  # what Inductor compiles
            def __call__(self, graph):
                seen["patterns"] = str(graph)

        torch._dynamo.reset()
        with torch._inductor.config.patch(post_grad_custom_pre_pass=Recording(),
                                          post_grad_custom_post_pass=AfterPatterns(), fx_graph_cache=False):
            out = torch.compile(fn, backend="inductor", fullgraph=True)(*args)
        self.after_patterns = seen["patterns"]
        return seen["before"], seen["after"], rewrite.rewritten, out

    def linear_args(self, dtype=None):
        torch = self.torch
        g = torch.Generator().manual_seed(0)
        dtype = dtype or torch.float32
        return [torch.randn(*shape, generator=g).to(dtype) for shape in ((4, 8), (6, 8), (6,), (4, 6))]

    def test_a_tapped_biased_linear_becomes_mm_then_add(self):
        torch = self.torch
        from torch.testing import FileCheck

        def fn(x, w, b, r):
            y = torch.nn.functional.linear(x, w, b)
            torch.ops.fragments.tap(y, "dense.output")
            return torch.relu(y) + r
        args = self.linear_args()
        before, after, n, out = self.compile(fn, args)
        FileCheck().check("aten.addmm.default").check("auto_functionalized").run(before)
        FileCheck().check_not("aten.addmm").check("aten.mm.default").check("aten.neg.default") \
            .check("aten.sub.Tensor").check("auto_functionalized").run(after)
        self.assertEqual(n, 1)
        x, w, b, r = args
        self.assertTrue(torch.equal(out, torch.relu(x @ w.t() + b) + r))  # mm, then the bias, as Inductor unfuses
        # and Inductor's own patterns, which run after, leave it so (its addmm pattern would fold `mm + bias`
        # with a tap among its users back into addmm)
        self.assertNotIn("aten.addmm", self.after_patterns)

    def test_what_inductor_would_not_unfuse_is_left_alone(self):
        torch = self.torch
        from torch.testing import FileCheck

        def untapped(x, w, b, r):
            return torch.relu(torch.nn.functional.linear(x, w, b)) + r

        def tapped_and_multiplied(x, w, b, r):  # a non-pointwise user beside the tap (another mm)
            y = torch.nn.functional.linear(x, w, b)
            torch.ops.fragments.tap(y, "dense.output")
            return y @ r.t()

        def tapped(x, w, b, r):
            y = torch.nn.functional.linear(x, w, b)
            torch.ops.fragments.tap(y, "dense.output")
            return y + r
        for fn, dtype, gpu_only, why in ((untapped, None, False, "no tap: Inductor's own pass decides"),
                                         (tapped_and_multiplied, None, False, "a user that is not pointwise"),
                                         (tapped, torch.bfloat16, False, "bfloat16: Inductor keeps addmm"),
                                         (tapped, None, True, "a CPU tensor, gpu_only: Inductor keeps addmm")):
            before, after, n, _ = self.compile(fn, self.linear_args(dtype), gpu_only=gpu_only)
            self.assertEqual(n, 0, why)
            self.assertEqual(before, after, why)
            FileCheck().check("aten.addmm.default").run(after)

    def test_install_sets_the_pre_pass_once_and_keeps_one_the_user_set(self):
        import torch._inductor.config as inductor_config
        old = inductor_config.post_grad_custom_pre_pass
        try:
            inductor_config.post_grad_custom_pre_pass = None
            self.assertTrue(self.addmm.install())
            mine = inductor_config.post_grad_custom_pre_pass
            self.assertIsInstance(mine, self.addmm.UnfuseTappedAddmm)
            self.assertTrue(self.addmm.install())
            self.assertIs(inductor_config.post_grad_custom_pre_pass, mine)
            theirs = self.addmm.UnfuseTappedAddmm.__new__(type("Theirs", (self.addmm.CustomGraphPass,),
                                                               {"__call__": lambda s, g: None, "uuid": lambda s: 1}))
            inductor_config.post_grad_custom_pre_pass = theirs
            with self.assertLogs("fragments.vllm", "WARNING") as logs:
                self.assertFalse(self.addmm.install())
            self.assertIs(inductor_config.post_grad_custom_pre_pass, theirs)
            self.assertEqual(len(logs.output), 1)
        finally:
            inductor_config.post_grad_custom_pre_pass = old

    def test_a_graph_it_cannot_rewrite_is_left_with_one_warning(self):
        rewrite = self.addmm.UnfuseTappedAddmm(gpu_only=False)
        with self.assertLogs("fragments.vllm", "WARNING") as logs:
            rewrite(object())  # not a graph
        self.assertEqual(rewrite.rewritten, 0)
        self.assertIn("tapped-addmm rewrite skipped", logs.output[0])


if __name__ == "__main__":
    unittest.main(verbosity=2)
