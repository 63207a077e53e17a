"""Tiny Hugging Face checkpoints for the import tests: made with transformers' own model classes (random
weights, seeded), saved as Hugging Face folders, and written as GGUF files the way llama.cpp's converter lays
them out (GGUF tensor names from gguf's tables, llama's Q/K rows permuted, experts stacked)."""
import os
import tempfile
import unittest

import numpy as np
import torch

TINY = dict(vocab_size=1000, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-5,
            hidden_act="silu")


def hf_model(family: str, seed: int = 0, **overrides):
    """(model, config) of a tiny transformers model of ``family`` in eval mode, float32."""
    import transformers

    cfg = dict(TINY)
    if family == "llama":
        config_cls, model_cls = transformers.LlamaConfig, transformers.LlamaForCausalLM
    elif family == "qwen2":
        config_cls, model_cls = transformers.Qwen2Config, transformers.Qwen2ForCausalLM
    elif family == "qwen2_moe":
        config_cls, model_cls = transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[1])
    elif family == "mixtral":
        config_cls, model_cls = transformers.MixtralConfig, transformers.MixtralForCausalLM
        cfg.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    else:
        raise ValueError(family)
    cfg.update(overrides)
    torch.manual_seed(seed)
    config = config_cls(**cfg)
    model = model_cls(config).eval()
    with torch.no_grad():  # transformers initialises norms to ones and biases to zeros: make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return model, config


def save_hf(model, folder: str, shard_size: str = "100KB") -> str:
    """A Hugging Face folder, sharded (model.safetensors.index.json) when the weights exceed ``shard_size``."""
    model.save_pretrained(folder, max_shard_size=shard_size)
    return folder


def _permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp's converter: rows of each head [2, d/2] -> [d/2, 2] (rotary pairs interleaved for GGML).
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def save_gguf(model, config, path: str) -> str:
    """Write ``model`` (a tiny transformers llama/qwen2/qwen2_moe/mixtral) as an F32 GGUF file."""
    import gguf

    model_type = config.model_type
    arch = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen2_moe": "qwen2moe"}[model_type]
    arch_enum = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
                 "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE}[arch]
    names = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    w.add_vocab_size(config.vocab_size)
    if model_type == "qwen2_moe":
        w.add_feed_forward_length(config.intermediate_size)
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    elif model_type == "mixtral":
        w.add_feed_forward_length(config.intermediate_size)
        w.add_expert_count(config.num_local_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
    else:
        w.add_feed_forward_length(config.intermediate_size)

    state = _hub_state_dict(model)
    stacked = {}
    for name, t in state.items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if arch == "llama" and ".q_proj." in name:
            t = _permute(t, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = _permute(t, config.num_key_value_heads)
        if ".experts." in name:  # model.layers.L.<moe>.experts.E.<proj>.weight -> stacked per (L, proj)
            head, rest = name.split(".experts.")
            expert, proj = rest.split(".", 1)
            stacked.setdefault((head, proj), {})[int(expert)] = t
            continue
        if name.endswith("shared_expert_gate.weight"):
            t = t.reshape(-1)  # llama.cpp stores this [1, H] router as [H]
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), t.numpy().astype(np.float32))
    hf_expert = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    for (head, proj), experts in stacked.items():
        base, suffix = proj.rsplit(".", 1)
        base = hf_expert.get(base, base)
        gguf_name = names.get_name("%s.experts.%s.%s" % (head.replace("block_sparse_moe", "mlp"), base, suffix),
                                   try_suffixes=(".weight",))
        w.add_tensor(gguf_name, torch.stack([experts[e] for e in sorted(experts)]).numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _hub_state_dict(model) -> dict:
    """The model's weights by their Hugging Face hub names (per-expert tensors), as save_pretrained writes them."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        state = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                state.update(load_file(os.path.join(d, f)))
    return state


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def relative(a: torch.Tensor, reference: torch.Tensor) -> float:
    a, reference = a.double(), reference.double()
    return float((a - reference).abs().max() / reference.abs().max())


class WorkDirCase(unittest.TestCase):
    """A test case with a fresh temporary folder per test (``self.work``; ``self.path(...)`` inside it)."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.work = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, *parts):
        return os.path.join(self.work, *parts)
