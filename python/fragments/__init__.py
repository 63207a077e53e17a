"""fragments: read and edit a tensor-parallel model's activations as whole tensors, from Python.

    import fragments
    model = fragments.load("exports/llama_tp2/rank{rank}.pt")
    with model.trace([[1, 2, 3]]):
        h = model.model.layers[0].output.save()
        model.model.layers[1].output[:, -1] += 0.5
        logits = model.output.save()

The package is layered (tests/layering_test.sh keeps it so): fragments.core (what everything shares: errors,
SavedValue, the typed Step, index arithmetic, the executor of Python steps) under fragments.tracing (the one
recorder) under the backends that run a recording: fragments.local (`load`: this process's ranks),
fragments.session (`LanguageModel`: rank processes kept up) and fragments.vllm (inside vLLM's workers).

Importing the package loads the C++ runtime (fragments._C), which registers the frag:: ops: rewritten
rank files then load with plain torch.jit.load.
"""
import sys

import torch  # noqa: F401  (libtorch before the extension that links it)

# fragkit defines the frag:: ops from Python when nothing registered them yet; the C++ registration in _C
# would clash with them (LibTorch aborts the process). So fragkit's definitions go first and the C++ ones,
# a superset, stay the one definition in either import order; fragkit then adds its fake kernels to them.
_fragkit_ops = sys.modules.get("fragkit.ops")
if _fragkit_ops is not None:
    _fragkit_ops.release_python_definitions()

from . import _C  # noqa: E402

if _fragkit_ops is not None:
    _fragkit_ops.adopt_registered()
from ._C import FragError, RankAgreementError  # noqa: E402
from .core.errors import FragmentsError  # noqa: E402
from .core.saved import SavedValue  # noqa: E402
from .local.launch import RankFailed, launch, rank_context  # noqa: E402
from .local.model import Model, load  # noqa: E402
from .local.trace import Trace  # noqa: E402
from .session.language_model import LanguageModel  # noqa: E402  (a model kept loaded on rank processes)
from .tracing.envoy import Envoy as Module  # noqa: E402  (a module of the model, on every backend)
from .tracing.envoy import Location  # noqa: E402

__all__ = ["FragError", "FragmentsError", "LanguageModel", "Location", "Model", "Module", "RankAgreementError",
           "RankFailed", "SavedValue", "Trace", "launch", "load", "rank_context"]
