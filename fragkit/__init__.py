"""fragkit: export kit for fragments (tensor-parallel TorchScript models laid out like vLLM's)."""
from . import ops  # noqa: F401  (registers frag::all_reduce / frag::all_gather)
from .ops import OP_SCHEMAS
from .distributed import (
    expert_parallel_all_reduce,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from .layers import (
    CONTRACT_ATTRIBUTES,
    KIT_LAYERS,
    ColumnParallelLinear,
    FusedMoE,
    LogitsProcessor,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    pad_vocab_size,
)
from .export import export, export_full, load_rank_from_full, shard_model

__all__ = [
    "OP_SCHEMAS", "CONTRACT_ATTRIBUTES", "KIT_LAYERS",
    "tensor_model_parallel_all_reduce", "tensor_model_parallel_all_gather", "expert_parallel_all_reduce",
    "ReplicatedLinear", "ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
    "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead", "LogitsProcessor", "FusedMoE",
    "pad_vocab_size", "export", "export_full", "load_rank_from_full", "shard_model",
]
