"""fragments: read and edit a tensor-parallel model's activations as whole tensors, from Python.

    import fragments
    model = fragments.load("exports/llama_tp2/rank{rank}.pt")
    with model.trace([[1, 2, 3]]):
        h = model.model.layers[0].output.save()
        model.model.layers[1].output[:, -1] += 0.5
        logits = model.output.save()

Importing the package loads the C++ runtime (fragments._C), which registers the frag:: ops: rewritten
rank files then load with plain torch.jit.load.
"""
import torch  # noqa: F401  (libtorch before the extension that links it)

from . import _C
from ._C import FragError, RankAgreementError
from ._launch import RankFailed, launch, rank_context
from ._model import FragmentsError, Location, Model, Module, SavedValue, Trace, load

__all__ = ["FragError", "FragmentsError", "Location", "Model", "Module", "RankAgreementError", "RankFailed",
           "SavedValue", "Trace", "launch", "load", "rank_context"]
