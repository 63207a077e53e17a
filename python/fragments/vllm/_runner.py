"""What the plugin reads from vLLM's model runner: the live batch and the CUDA-graph choice of each step.

vLLM 0.24 has two model runners, and vLLM picks one per engine (VllmConfig.use_v2_model_runner):
  V1  vllm/v1/worker/gpu_model_runner.py GPUModelRunner (the CPU build's CPUModelRunner subclasses it): a
      persistent input_batch, query_start_loc (a CpuGpuBuffer: .np on the host), the logits computed in
      execute_model;
  V2  vllm/v1/worker/gpu/model_runner.py GPUModelRunner (Model Runner V2, the GPU default for Llama, Mistral,
      Qwen3, Qwen2-MoE): an InputBatch built per step by prepare_inputs (kept here when it is built: it is a
      local of execute_model), requests ordered decode first, the logits computed in sample_tokens.
Either way a forward's tokens are the batch's requests' rows back to back, and the logits processor sees one
row per request. `Rows` is that, per request, with the engine step it is at (0 = prefill, k = k-th decode step).

CUDA graphs (compiled engines on GPUs; docs/vllm.md "CUDA graphs"): a captured graph replays kernels, never a
Python body. A captured tap copies its value into a slot, which serves read-only plans; a step whose plans edit
may not replay a graph its taps are captured in. `guard_graphs` makes the runner's dispatch avoid those graphs
for such a step (FULL ones where taps split the PIECEWISE ones and run between their pieces; every graph where
taps stay inside the pieces: _tap.arrange_graphs), and records which kind of graph each step replays (`graph`);
other steps keep vLLM's choice.
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional

import numpy as np
import torch

from . import _vllm_api


class Row(NamedTuple):
    req_id: str
    index: int      # the request's place in the batch: its row of the logits
    start: int      # its rows of the forward's tokens: [start, stop)
    stop: int
    computed: int   # tokens of the request computed before this step
    prompt: int     # its prompt's length

    @property
    def step(self) -> int:
        return 0 if self.computed < self.prompt else self.computed - self.prompt + 1

    @property
    def samples(self) -> bool:
        """Whether the request samples at this step (a prefill chunk short of the prompt's end does not)."""
        return self.computed + (self.stop - self.start) >= self.prompt


class Runner:
    """One model runner as the plugin sees it."""
    kind = "?"

    def __init__(self, runner):
        self.runner = runner
        self._guarded = False
        self.graph = "NONE"  # the CUDA graph the step's forward replays: NONE, PIECEWISE or FULL (the dispatch guard)
        self._wants_taps: Optional[Callable[[], bool]] = None  # set by guard_graphs (compiled engines with taps)
        self._no_graph = False  # a step that wants its taps runs without any graph (else: not a FULL one)

    def rows(self) -> List[Row]:
        raise NotImplementedError

    def batch_arrays(self):
        """(request ids, query start offsets [n + 1], tokens computed [n]) as the runner holds them (numpy, not
        copied), for _steady.Steady to tell a batch that follows on from the last; None: not known."""
        return None

    def sampling_params(self, req_id: str):
        """A live request's SamplingParams, for a plan not seen when the request was new (None: unknown)."""
        return None

    def guard_graphs(self, wants_taps: Callable[[], bool], no_graph: bool = False) -> None:
        """`wants_taps()`: whether this step's taps must run their bodies (its plans edit). Such a step replays no
        FULL graph, and with `no_graph` no graph at all."""
        self._wants_taps = wants_taps
        self._no_graph = no_graph
        self._guard()

    def begin_step(self) -> None:
        self.graph = "NONE"
        if self._wants_taps is not None and not self._guarded:
            self._guard()

    def _guard(self) -> None:
        pass


class V1(Runner):
    kind = "V1"

    def rows(self) -> List[Row]:
        batch = self.runner.input_batch
        qsl = self.runner.query_start_loc.np
        return [Row(req_id, i, int(qsl[i]), int(qsl[i + 1]), int(batch.num_computed_tokens_cpu[i]),
                    int(batch.num_prompt_tokens[i])) for i, req_id in enumerate(batch.req_ids)]

    def batch_arrays(self):
        batch = self.runner.input_batch
        n = len(batch.req_ids)
        return batch.req_ids, self.runner.query_start_loc.np[:n + 1], batch.num_computed_tokens_cpu[:n]

    def sampling_params(self, req_id: str):
        state = self.runner.requests.get(req_id)
        return getattr(state, "sampling_params", None) if state is not None else None

    def _guard(self) -> None:
        dispatcher = getattr(self.runner, "cudagraph_dispatcher", None)
        if dispatcher is None:
            return
        from vllm.config import CUDAGraphMode
        original = dispatcher.dispatch

        def dispatch(num_tokens, *args, invalid_modes=None, **kwargs):
            if self._wants_taps():  # captured taps only copy to their slots: not for a step that edits
                avoid = {CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE} if self._no_graph else {CUDAGraphMode.FULL}
                invalid_modes = set(invalid_modes or ()) | avoid
            mode, desc = original(num_tokens, *args, invalid_modes=invalid_modes, **kwargs)
            self.graph = mode.name
            return mode, desc
        dispatcher.dispatch = dispatch
        self._guarded = True


class V2(Runner):
    kind = "V2"

    def __init__(self, runner):
        super().__init__(runner)
        self.batch = None
        original = runner.prepare_inputs

        def prepare_inputs(*args, **kwargs):
            self.batch = original(*args, **kwargs)
            return self.batch
        runner.prepare_inputs = prepare_inputs

    def rows(self) -> List[Row]:
        b = self.batch
        if b is None:
            return []
        qsl, prompt_len = b.query_start_loc_np, self.runner.req_states.prompt_len.np
        return [Row(req_id, i, int(qsl[i]), int(qsl[i + 1]), int(b.num_computed_tokens_np[i]),
                    int(prompt_len[b.idx_mapping_np[i]])) for i, req_id in enumerate(b.req_ids)]

    def batch_arrays(self):
        b = self.batch
        if b is None:
            return None
        n = len(b.req_ids)
        return b.req_ids, b.query_start_loc_np[:n + 1], b.num_computed_tokens_np[:n]

    def begin_step(self) -> None:
        self.batch = None
        super().begin_step()

    def _guard(self) -> None:
        manager = getattr(self.runner, "cudagraph_manager", None)  # made with the KV cache, after load_model
        if manager is None:
            return
        from vllm.config import CUDAGraphMode
        original = manager.dispatch

        def dispatch(num_reqs, num_tokens, uniform_token_count, *args, **kwargs):
            if not self._wants_taps():
                desc = original(num_reqs, num_tokens, uniform_token_count, *args, **kwargs)
            else:  # no uniform count: the decode (FULL) candidates do not match, the PIECEWISE one does
                desc = original(num_reqs, num_tokens, None, *args, **kwargs)
                if desc.cg_mode == CUDAGraphMode.FULL or (self._no_graph and desc.cg_mode != CUDAGraphMode.NONE):
                    desc = _vllm_api.no_graph(desc, num_tokens, num_reqs)  # (FULL: mixed batches captured FULL too)
            self.graph = desc.cg_mode.name
            return desc
        manager.dispatch = dispatch
        self._guarded = True


def adapt(runner) -> Runner:
    """The view of `runner`; a runner the plugin cannot serve stops the engine with one line."""
    config = getattr(runner, "vllm_config", None)
    if getattr(config, "speculative_config", None) is not None:
        raise RuntimeError("fragments: speculative decoding is not supported (a step would sample several tokens "
                           "per request; plan steps count one); start vLLM without speculative_config or without "
                           "the plugin (FRAGMENTS_VLLM=0)")
    if hasattr(runner, "req_states") and hasattr(runner, "prepare_inputs"):
        return V2(runner)
    if hasattr(runner, "input_batch") and hasattr(runner, "query_start_loc"):
        return V1(runner)
    raise RuntimeError(f"fragments: vLLM's model runner {type(runner).__module__}.{type(runner).__qualname__} is "
                       "neither Model Runner V1 nor V2 as vLLM 0.24 has them; the plugin cannot read its batch "
                       "(start vLLM without the plugin: FRAGMENTS_VLLM=0)")


def describe(runner: Optional[Runner]) -> str:
    return runner.kind if runner is not None else "?"


def row_index(spans: List[tuple], device) -> object:
    """The forward's rows a location's work reads (`spans`: sorted disjoint [start, stop)): a range when they are
    one span (a narrow view, no index tensor), else an index tensor on the value's device, sent without waiting
    for the GPU."""
    if len(spans) <= 1:
        return range(*spans[0]) if spans else range(0)
    index = torch.from_numpy(np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in spans]))
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index


def write_rows(target, where, new_piece) -> None:
    """An edit's new piece written back to the forward's rows (`where`: row_index's)."""
    if isinstance(where, range):
        target.narrow(0, where.start, len(where)).copy_(new_piece)
    else:
        target.index_copy_(0, where, new_piece)
