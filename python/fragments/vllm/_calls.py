"""Ad-hoc module calls inside vLLM's workers: fragments.vllm.VLLM's logit lens (collective_rpc "fragments_call")."""
from __future__ import annotations

from typing import List, Optional

import torch

from . import _stages


def run(state, modules: List[str], data: bytes) -> Optional[dict]:
    """Runs `modules` in turn on a whole tensor (safetensors bytes, "x") after a forward: the logit lens
    of fragments.vllm.VLLM. Replicated modules run as they are; the LM head through the model's logits
    processor (vLLM's own gather and scaling). Every rank of the stage holding the modules runs it (the
    head's collective; at pp > 1 the caller's value was sent to every worker and the last stage's run
    the lens); that stage's rank 0 answers {"error", "data"} ("y"), the others None."""
    from safetensors.torch import load, save
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    elsewhere, answer = _stages.route_call(state.stage_of, state.stage, modules)
    if elsewhere:  # another stage holds the modules (pp > 1), or they span stages: refused alike everywhere
        return answer if state.rank == 0 else None
    try:
        x = load(data)["x"].to(state.device)
        with torch.no_grad(), set_current_vllm_config(state.runner.vllm_config):
            for path in modules:
                module = state.modules.get(path)
                if module is None:
                    raise ValueError(f"{path} is not a module of this model")
                if isinstance(module, ParallelLMHead) and state.logits_modules:
                    x = state.modules[state.logits_modules[0]](module, x)
                elif f"{path}.input" in state.fragmented or f"{path}.output" in state.fragmented:
                    raise ValueError(f"{path} holds one rank's piece of its weights; only replicated modules "
                                     "and the LM head can be called on a whole value")
                else:
                    out = module(x)
                    x = out[0] if isinstance(out, tuple) else out
        answer = {"error": None, "data": save({"y": x.contiguous().cpu()}) if x is not None else None}
    except (RuntimeError, ValueError, TypeError) as e:
        answer = {"error": f"fragments: {'('.join(modules[::-1])}(...): {e}", "data": None}
    return answer if state.rank == 0 else None
