#!/usr/bin/env python3
"""Exports the tiny kit model whose IR docs/passes.md shows, at tp 2, in both formats.

    python3 tests/passes/catalogue_model.py OUT_DIR

writes OUT_DIR/pt/rank{0,1}.pt (TorchScript) and OUT_DIR/pt2/rank{0,1}.pt2 (torch.export). The model is
the smallest one with every kind of location: an embedding whose output is whole (its all-reduce), and
Llama's gated MLP (MergedColumnParallelLinear -> SiluAndMul -> RowParallelLinear), with a residual add.
tests/passes/passes_catalogue prints each pass's IR on rank 0 of both."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# In the runfiles and in a checkout alike, the kit (fragkit/) sits two folders up.
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from torch import Tensor, nn  # noqa: E402

from fragkit.export import export  # noqa: E402
from fragkit.layers import VocabParallelEmbedding  # noqa: E402
from fragkit.models import LlamaMLP  # noqa: E402

VOCAB, HIDDEN, INTERMEDIATE = 64, 8, 16


class TinyMlpModel(nn.Module):
    def __init__(self, tp_rank: int, tp_size: int):
        super().__init__()
        self.embed = VocabParallelEmbedding(VOCAB, HIDDEN, padding_size=64, prefix="embed", tp_rank=tp_rank,
                                            tp_size=tp_size)
        self.mlp = LlamaMLP(HIDDEN, INTERMEDIATE, tp_rank, tp_size, prefix="mlp")

    def forward(self, input_ids: Tensor) -> Tensor:
        h = self.embed(input_ids)
        return self.mlp(h) + h


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: catalogue_model.py OUT_DIR", file=sys.stderr)
        return 2
    out = sys.argv[1]
    export(TinyMlpModel, 2, os.path.join(out, "pt"))
    export(TinyMlpModel, 2, os.path.join(out, "pt2"), format="export")
    return 0


if __name__ == "__main__":
    sys.exit(main())
