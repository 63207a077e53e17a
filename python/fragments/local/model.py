"""`fragments.load(path)`: this rank's model in this process, and traces that run as one typed plan in the C++
runtime.

The model's attributes mirror the module tree of the rank file (fragments.tracing.envoy). Inside
`with model.trace(ids):` reads (`.save()`), edits (`loc[...] += v`, `loc.output = t`, `*=`), ad-hoc calls
(`model.lm_head(model.model.norm(loc))`) and Python callables (`loc.apply(fn)`) are only recorded
(fragments.tracing.tracer); when the block ends they become one plan (fragments.core.step.Step, read by
fragments._C into runtime::PlanStep: no JSON in between) and one forward runs in C++ with the GIL released.
"""
import json
import os

import torch

from .. import _C
from ..core.errors import FragmentsError
from ..tracing.envoy import TracedModel
from ..tracing.tree import ModelTree, rank_local_reason
from .generate import Generation
from .launch import rank_context
from .pt2_torch_export import Pt2Runner
from .trace import Trace


class Model(TracedModel):
    """One rank of a sharded model (see `load`)."""

    def __init__(self, path, device=None):
        context = rank_context()
        if device is None:  # NCCL ranks run on their GPU (LOCAL_RANK), Gloo ranks on the CPU
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if context.backend == "nccl" else "cpu"
        self.path = path.format(rank=context.rank) if "{rank}" in path else path
        self.device = torch.device(device)
        if _C.is_torch_export_archive(self.path):  # run by torch.export here, its plans by the C++ engine
            self._c = _C.ShardedModel.pt2(context, self.path, device, Pt2Runner)
        else:
            self._c = _C.ShardedModel(context, self.path, device)
        self.rank, self.world_size = context.rank, context.world_size
        self.dtype = self._c.dtype
        self._tree = describe(self._c)
        self._plan_key = None  # the last trace's steps (plan_key), if it ran without tensor values

    def _title(self):
        return f"<fragments.Model {self.path}: rank {self.rank} of {self.world_size}, {self.dtype}>"

    def __call__(self, x):
        raise FragmentsError("call the model inside `with model.trace(ids):`, or call a submodule ad hoc")

    def locations(self):
        """What `frag inspect --json` lists for this rank file (format fragments.inspect/1)."""
        return json.loads(self._c.inspect_json())

    def trace(self, ids):
        """`with model.trace(ids):` records; the block's end runs one forward with it all (`tracer.run(ids)`
        runs it again on other ids)."""
        return Trace(self, ids)

    def plan(self):
        """`with model.plan() as plan:` records as a trace does, without ids and without running; then
        `logits = plan.run(ids)`, as often as wanted: one forward each, its saves refreshed. A decode loop
        records once instead of every step (with the same plan each call, C++ parses nothing again)."""
        return Trace(self, None)

    def generate(self, prompts, max_new_tokens, **options):
        """Generation as a trace (fragments.local.generate.Generation): recorded edits act at every step (narrow
        them with `gen.iter[a:b]`, `gen.prefill()`, `gen.decode()`, `gen.rows(...)`), saves are per-step
        lists, `model.output.save()` is the tokens. Prompts may differ in length (a KV cache batches them).
        Options: temperature, top_p, seed, eos_token_id, stop, tokenizer, on_token, max_len (the cache's
        tokens per row; default: the longest prompt plus max_new_tokens), batch_size (the cache's rows;
        default: the prompts'), batch_buckets (the batch sizes decode steps are padded to, program/decoder.h;
        default: powers of two on a GPU, none on a CPU)."""
        return Generation(self, prompts, max_new_tokens, **options)

    def stream(self, prompts, max_new_tokens, **options):
        """Yields (step, [new token or None per row]) as generation runs (the options of generate)."""
        yield from self.generate(prompts, max_new_tokens, **options)._steps_run()

    def _head_layout(self, location):
        """name -> (start, stop, head_dim) on the last dim of the whole at `location`: q/k/v of a
        QKVParallelLinear's output, or "heads" of the o_proj input beside one; {} elsewhere. The C++
        ir::head_layout computes them, as for JSON plans' "segment"/"heads" and `frag inspect`."""
        return self._tree.head_layout(location)

    def _callable(self, path):
        return self._c.callable(path) or None

    def _call(self, modules, x):
        return self._c.call(list(modules), x)

    @property
    def cuda_graphs(self):
        """Whether traces on a GPU replay CUDA graphs (on by default): a plan and input shape seen twice is
        captured on its third forward and replayed after, bit-identical to running it op by op; ad-hoc calls
        recorded in a trace (a logit lens) replay with it. Traces with Python callables (`.apply`) run eagerly.
        Set False to turn it off."""
        return self._c.cuda_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, on):
        self._c.cuda_graphs = bool(on)

    def graph_stats(self):
        """{"captures", "replays", "refusals"}: CUDA graphs this rank captured, replayed, and could not capture."""
        return self._c.graph_stats()

    @property
    def python_calls(self):
        """How many times Python callables (`.apply`) have run on this rank."""
        return self._c.python_calls


def describe(c):
    """The ModelTree of a rank's C++ model: modules, locations (a rank-local one with why), dtype, head layouts."""
    kinds = {name: kind for name, kind, _ in c.locations()}
    reasons = {}
    if "rank_local" in kinds.values():
        for entry in json.loads(c.inspect_json())["rank_local"]:
            reasons[entry["location"]] = rank_local_reason(entry["location"], entry["derived_from"],
                                                           entry.get("whole_at"))
    return ModelTree(c.modules(), kinds, reasons, c.dtype, heads=c.head_layout)


def load(path, device=None):
    """Loads this rank's file (`"dir/rank{rank}.pt"`: the rank from the launch context) onto `device`
    (default: the CPU, or under backend "nccl" the GPU of LOCAL_RANK). A TorchScript file (.pt) runs in
    C++; a torch.export archive (.pt2, plain or frag rewrite's) runs with torch.export in this process,
    its plans alike (fragments.local.pt2_torch_export)."""
    return Model(path, device)
