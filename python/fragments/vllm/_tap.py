"""Compiled mode: `fragments::tap`, a custom op placed at the tapped locations of vLLM's model.

With enforce_eager=False vLLM compiles the model's forward with torch.compile (CPU: Inductor, fullgraph,
guards dropped: it is traced once). Module hooks registered before that first trace are inlined by Dynamo,
so a hook that only calls `torch.ops.fragments.tap(x, "model.layers.0.mlp.down_proj.input")` leaves one
opaque node per tapped location in the graph; Inductor calls the op at run time, where its Python body
(`WorkerState.tap_body`) sees the live batch and the step's plans — as the eager hooks do.

Why this op's shape:
- It mutates `x` in place (declared: mutates_args=("x",)) and returns nothing: a save reads x, an edit
  writes x's rows. A functional op would have to return a copy at every step even when nothing acts
  (an op's output may not alias its input); the in-place form costs nothing then (Inductor re-inplaces the
  functionalized call onto the layer's own buffer: no clone in the generated code).
- A mutating op is never removed or merged by Inductor (no DCE, no CSE), and the reads and writes after
  it are ordered after it. Its fake kernel does nothing (shapes do not change).
- The location is a constant string argument, not an index: a compiled artifact loaded from vLLM's
  compile cache names its taps by themselves (the cache key covers additional_config, hence the taps).
- The traced hooks read no Python state (no batch, no plan): that would become guards or graph breaks
  under fullgraph. Which locations are tapped is fixed at engine start (additional_config
  {"fragments_taps": [patterns]}), because the graph is fixed once compiled.
"""
from __future__ import annotations

import fnmatch
import os
from typing import Callable, Dict, Iterable, Optional

import torch

TAPS_KEY = "fragments_taps"

# (location, x) -> None; set by the worker (fragments/vllm/_worker.py) once its state exists.
body: Optional[Callable[[str, torch.Tensor], None]] = None
# (location) -> None; set by the worker: a tap's hook ran as Python while a CUDA graph was being captured.
opaque: Optional[Callable[[str], None]] = None


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _ran_as_python(location: str) -> None:
    """A tap's hook runs as Python only where torch.compile did not trace it: outside the compiled forward (the
    logits processor), or inside an op vLLM keeps opaque to it (on a GPU the shared expert of its fused-MoE op).
    There, during a CUDA graph's capture, the graph records the hook's kernels once and replays them without the
    hook: the worker refuses plans at such a location (never a silently skipped tap)."""
    if _capturing() and opaque is not None:
        opaque(location)


OP = "fragments::tap"


@torch.library.custom_op(OP, mutates_args=("x",))
def tap(x: torch.Tensor, location: str) -> None:
    b = body
    if b is not None:
        b(location, x)


@tap.register_fake
def _(x, location):
    return None


def _post_hook(location: str):
    def hook(module, args, kwargs, output):
        value = output[0] if isinstance(output, tuple) else output
        if isinstance(value, torch.Tensor):
            if not torch.compiler.is_compiling():  # Dynamo prunes this branch where it traces the hook
                _ran_as_python(location)
            torch.ops.fragments.tap(value, location)
        return None
    return hook


def _pre_hook(location: str):
    def hook(module, args, kwargs):
        value = args[0] if args else (next(iter(kwargs.values())) if kwargs else None)
        if isinstance(value, torch.Tensor):
            if not torch.compiler.is_compiling():
                _ran_as_python(location)
            torch.ops.fragments.tap(value, location)
        return None
    return hook


def select(patterns, candidates: Iterable[str], refused: Dict[str, str]) -> list:
    """The locations `patterns` (fnmatch globs over '<module path>.input/.output') name among `candidates`.
    Raises ValueError (one message: the pattern, what was expected) for a pattern that matches nothing or
    names a refused (rank-local) location exactly; globs skip refused locations."""
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f'fragments: additional_config["{TAPS_KEY}"] must be a list of location patterns '
                         f'(e.g. ["model.layers.*.mlp.down_proj.input"]), found {patterns!r}')
    candidates = sorted(candidates)
    chosen = set()
    for p in patterns:
        if p in refused:
            raise ValueError(f'fragments: additional_config["{TAPS_KEY}"]: {p} cannot be tapped: {refused[p]}')
        hits = [c for c in candidates if fnmatch.fnmatchcase(c, p) and c not in refused]
        if not hits:
            raise ValueError(f'fragments: additional_config["{TAPS_KEY}"]: pattern {p!r} matches no location of '
                             "this vLLM model; expected <module path>.input or .output, globs allowed (e.g. "
                             f"model.layers.*.self_attn.qkv_proj.output); some locations: {', '.join(candidates[:4])}")
        chosen.update(hits)
    return sorted(chosen)


GRAPH_TAPS_ENV = "FRAGMENTS_VLLM_GRAPH_TAPS"
WAYS = ("slots", "split")


def graph_way(environ=None) -> str:
    """How taps meet CUDA graphs (FRAGMENTS_VLLM_GRAPH_TAPS, read once at engine start): "slots" (the default)
    or "split" (arrange_graphs says what each does). Another word stops the engine with one line."""
    value = (environ if environ is not None else os.environ).get(GRAPH_TAPS_ENV, "slots").strip().lower()
    if value not in WAYS:
        raise ValueError(f"fragments: {GRAPH_TAPS_ENV}={value!r}: expected one of {', '.join(WAYS)}")
    return value


def arrange_graphs(compilation_config, way: str = "slots") -> str:
    """CUDA graphs (GPUs) replay kernels, never a Python body, so a tap inside a captured graph would act once
    (at capture, where no plan acts) and then not at all. At engine start, before vLLM compiles the model:
    - way "slots" (the default): the taps stay inside vLLM's pieces, so Inductor compiles the code plain vLLM
      compiles, plus one opaque call per tap. In every captured graph, PIECEWISE and FULL, a tap records a copy of
      its value into its slot, which the worker reads after the replay for read-only plans; a step whose plans
      edit runs the compiled model without a graph (its taps' bodies run in Inductor's code, as on the CPU).
      Returns "slots". One known difference left (run33): Inductor unfuses a float32 addmm on a GPU (the bias
      add joins the next pointwise kernel) only when every user of its output is pointwise, so a tap at a biased
      linear layer's output keeps cuBLAS's addmm: 1 ulp (GPT-NeoX's dense layers).
    - way "split" (the way before run33): where vLLM captures PIECEWISE graphs, the taps become splitting ops
      too, each run eagerly between two pieces at every replay; a FULL graph's taps copy their values into
      slots; a step whose plans edit never replays a FULL graph (the worker's dispatch guard, _runner.py) but
      takes the PIECEWISE graph of its size. Returns "piecewise", or "eager" where vLLM captures FULL graphs only
      (steps that edit run without a graph). The extra pieces are compiled apart (other fusions, other
      roundings): Qwen3 float32 1 ulp off plain vLLM, SmolLM2 bfloat16's tokens apart at token 5 (run21).
    Steps without plans keep vLLM's graphs either way. "none": no CUDA graphs (the CPU build, cudagraph_mode
    NONE). (The op is not tagged cudagraph_unsafe: the tag changes how Inductor compiles the code around it, and
    read-only plans were then no longer bit-identical to plain compiled vLLM, 1.7e-6 on the CPU; splitting_ops,
    which Inductor's graph partition reads too, says it.)"""
    mode = getattr(compilation_config, "cudagraph_mode", None)
    if mode is None or str(mode).upper().endswith("NONE"):
        return "none"
    if way == "slots":
        return "slots"
    if not mode.has_piecewise_cudagraphs():
        return "eager"
    splitting = compilation_config.splitting_ops
    if splitting is None:
        compilation_config.splitting_ops = splitting = []
    if OP not in splitting:
        splitting.append(OP)
    return "piecewise"


def slotted(graphs: str) -> tuple:
    """The CUDA graphs (vLLM's runtime mode names) whose replays leave the taps' values in their slots, for what
    arrange_graphs returned: every graph with taps in slots, FULL ones where taps split the PIECEWISE graphs."""
    return ("FULL", "PIECEWISE") if graphs == "slots" else ("FULL",)


def place(modules: Dict[str, torch.nn.Module], locations: Iterable[str]) -> list:
    """Registers a tap hook at each location (before vLLM's first forward traces the model). Returns the
    hook handles."""
    handles = []
    for location in locations:
        path, _, side = location.rpartition(".")
        module = modules[path]
        if side == "input":
            handles.append(module.register_forward_pre_hook(_pre_hook(location), with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(_post_hook(location), with_kwargs=True))
    return handles
