"""What a compiled engine's worker reports about compilation (fragments_compile_stats): the forwards in which a
plan acted, each tap's body calls in them, and Dynamo's and vLLM's compile counters (a recompile shows as a new
Dynamo graph or compile)."""
from __future__ import annotations

from typing import List

_dynamo_compiles: List[str] = []
_dynamo_watched = False


def _code_name(code) -> str:
    return f"{code.co_name} {code.co_filename}:{code.co_firstlineno}"


def watch_dynamo() -> None:
    """Records every frame Dynamo compiles in this process (a bytecode hook; it changes nothing): the model's
    forward must be among them once and never again, whatever the plans (vLLM also compiles small helpers of
    its own, e.g. the sampler's logprob ranks, on first use)."""
    global _dynamo_watched
    if not _dynamo_watched:
        import torch._dynamo.convert_frame
        torch._dynamo.convert_frame.register_bytecode_hook(lambda old, new: _dynamo_compiles.append(_code_name(old)))
        _dynamo_watched = True


def stats(state) -> dict:
    """Per rank. `forwards` counts the forwards in which a plan acted (on a GPU the others may replay a FULL
    CUDA graph, where taps do not run); `tap_calls` counts each tap's body calls in those forwards."""
    from torch._dynamo.utils import counters
    from vllm.compilation.counter import compilation_counter as cc
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    model_code = sorted({_code_name(m.original_code_object()) for m in state.modules.values()
                         if isinstance(m, TorchCompileWithNoGuardsWrapper)})
    return {"rank": state.rank, "compiled": state.compiled, "runner": state.view.kind, "graphs": state.graphs,
            "forwards": state.forwards, "tap_calls": dict(state.tap_calls), "model_code": model_code,
            # host seconds by phase: "act" location by location (a tap's body in the forward, or after a graph's
            # replay where no SlotDrain serves), "drain" a steady batch's SlotDrain (its gathers, copies and puts);
            # both also inside "end_step" where they follow a replay, "drain" inside "begin_step" or "take_saves"
            # where those send its steps on (_drain.settle)
            "host_s": dict(state.host_s), "steps": dict(state.step_counts),
            "step_s": state.durations.report(),  # begin_step's and end_step's last calls, each (_durations.py)
            "dynamo_compiles": list(_dynamo_compiles),  # every frame Dynamo compiled here, in order
            "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
            "vllm_compiles": {k: int(getattr(cc, k)) for k in ("num_aot_compiles", "num_aot_artifacts_loaded",
                                                                "num_backend_compilations",
                                                                "num_inductor_compiles")}}
