"""Synthetic big checkpoints: a Hugging Face-format folder shaped like a real model, seeded random weights.

    python3 -m fragkit.synthetic --like llama3-8b|llama3-70b|llama3-405b|mixtral-8x7b|qwen2-moe-a14b
                                 [--layers N] [--seed S] [--dtype bfloat16|float32] [--shard-gb G] --out DIR

writes DIR/config.json, DIR/model-0000k-of-0000n.safetensors and DIR/model.safetensors.index.json, as
``save_pretrained`` lays them out (hub tensor names, shards of at most G GB, default 5), for benchmarks and
tests of imports of models larger than memory. Streaming: each shard's header is written first (the
shapes are known), then each tensor is generated and written in chunks of 32 MB, so memory stays small
whatever the model's size. The values are uniform with the variance of the usual initialisation (linear
weights 1/fan_in, embeddings 0.02², norms 1 ± 0.1), drawn from a generator seeded per tensor (the seed
and the tensor's name), so a folder is reproducible and a tensor's values do not depend on the others.
"""
import argparse
import hashlib
import json
import math
import os
import struct
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch

# Hugging Face configs of the real models (public config.json files), without their tokenizer ids.
LIKE: Dict[str, dict] = {
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                      hidden_act="silu", tie_word_embeddings=False, attention_bias=False, mlp_bias=False),
    "llama3-70b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192,
                       intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                       hidden_act="silu", tie_word_embeddings=False, attention_bias=False, mlp_bias=False),
    "llama3-405b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=16384,
                        intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                        rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
                        attention_bias=False, mlp_bias=False,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, hidden_act="silu",
                         tie_word_embeddings=False, sliding_window=None),
    "qwen2-moe-a14b": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", hidden_size=3584,
                           intermediate_size=18944, moe_intermediate_size=2560,
                           shared_expert_intermediate_size=20480, num_experts=64, num_experts_per_tok=8,
                           num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=151936,
                           max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                           hidden_act="silu", tie_word_embeddings=False, norm_topk_prob=False,
                           decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                           sliding_window=32768, max_window_layers=28),
}

DTYPES = {"bfloat16": (torch.bfloat16, "BF16"), "float32": (torch.float32, "F32"), "float16": (torch.float16, "F16")}
CHUNK_BYTES = 32 << 20  # fixed: the values depend on it


def like_config(name: str, layers: Optional[int] = None, dtype: str = "bfloat16") -> dict:
    if name not in LIKE:
        raise ValueError("--like %r: one of %s" % (name, ", ".join(sorted(LIKE))))
    cfg = dict(LIKE[name], torch_dtype=dtype)
    if layers is not None:
        if layers < 1:
            raise ValueError("--layers must be >= 1")
        cfg["num_hidden_layers"] = layers
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = layers
    return cfg


def tensor_shapes(cfg: dict) -> List[Tuple[str, Tuple[int, ...]]]:
    """(hub name, shape) of every tensor, in the order save_pretrained writes a model's state dict."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    kind = cfg["model_type"]
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % i
        bias = kind in ("qwen2", "qwen2_moe") or cfg.get("attention_bias", False)
        for proj, rows in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
            out.append((p + "self_attn.%s_proj.weight" % proj, (rows, h)))
            if bias:
                out.append((p + "self_attn.%s_proj.bias" % proj, (rows,)))
        out.append((p + "self_attn.o_proj.weight", (h, heads * hd)))
        if kind == "mixtral":
            out.append((p + "block_sparse_moe.gate.weight", (cfg["num_local_experts"], h)))
            inter = cfg["intermediate_size"]
            for e in range(cfg["num_local_experts"]):
                q = p + "block_sparse_moe.experts.%d." % e
                out += [(q + "w1.weight", (inter, h)), (q + "w2.weight", (h, inter)), (q + "w3.weight", (inter, h))]
        elif kind == "qwen2_moe":
            out.append((p + "mlp.gate.weight", (cfg["num_experts"], h)))
            inter = cfg["moe_intermediate_size"]
            for e in range(cfg["num_experts"]):
                q = p + "mlp.experts.%d." % e
                out += [(q + "gate_proj.weight", (inter, h)), (q + "up_proj.weight", (inter, h)),
                        (q + "down_proj.weight", (h, inter))]
            s = cfg["shared_expert_intermediate_size"]
            q = p + "mlp.shared_expert."
            out += [(q + "gate_proj.weight", (s, h)), (q + "up_proj.weight", (s, h)), (q + "down_proj.weight", (h, s)),
                    (p + "mlp.shared_expert_gate.weight", (1, h))]
        else:
            inter = cfg["intermediate_size"]
            out += [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                    (p + "mlp.down_proj.weight", (h, inter))]
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, h)))
    return out


def _numel(shape: Sequence[int]) -> int:
    return int(math.prod(shape))


def _init_range(name: str, shape: Sequence[int]) -> Tuple[float, float]:
    """(low, high) of the uniform draw: the mean and variance of the usual initialisation."""
    if name.endswith("norm.weight"):
        return 0.9, 1.1
    if name.endswith(".bias"):
        return -0.02 * math.sqrt(3), 0.02 * math.sqrt(3)
    if name == "model.embed_tokens.weight":
        a = 0.02 * math.sqrt(3)
    else:
        a = math.sqrt(3.0 / shape[-1])  # variance 1 / fan_in
    return -a, a


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(("%d:%s" % (seed, name)).encode()).digest()[:8], "little") >> 1


def shard_plan(shapes: List[Tuple[str, Tuple[int, ...]]], itemsize: int, shard_bytes: int) -> List[List[int]]:
    """Indices of the tensors in each shard: in order, a new shard when the next tensor would overflow."""
    shards, current, size = [], [], 0
    for i, (_, shape) in enumerate(shapes):
        n = _numel(shape) * itemsize
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        shards.append(current)
    return shards


def write_synthetic(cfg: dict, out_dir: str, seed: int = 0, dtype: str = "bfloat16", shard_gb: float = 5.0,
                    progress: bool = False) -> List[str]:
    """Write the folder; returns the shard paths. Files are written under .tmp names and renamed at the end."""
    torch_dtype, code = DTYPES[dtype]
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    shapes = tensor_shapes(cfg)
    shards = shard_plan(shapes, itemsize, int(shard_gb * 1e9))
    total = sum(_numel(s) for _, s in shapes) * itemsize
    os.makedirs(out_dir, exist_ok=True)
    names = ["model-%05d-of-%05d.safetensors" % (k + 1, len(shards)) for k in range(len(shards))]
    weight_map = {}
    written = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="synthetic", file=sys.stderr)
    try:
        for shard, name in zip(shards, names):
            path = os.path.join(out_dir, name)
            written.append(path + ".tmp")
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for i in shard:
                tname, shape = shapes[i]
                n = _numel(shape) * itemsize
                header[tname] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
                offset += n
                weight_map[tname] = name
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)  # the format's 8-byte alignment of the data
            with open(path + ".tmp", "wb") as f:
                f.write(struct.pack("<Q", len(text)))
                f.write(text)
                for i in shard:
                    tname, shape = shapes[i]
                    _write_tensor(f, tname, shape, torch_dtype, seed, bar)
        with open(os.path.join(out_dir, "model.safetensors.index.json.tmp"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        written.append(os.path.join(out_dir, "model.safetensors.index.json.tmp"))
        with open(os.path.join(out_dir, "config.json.tmp"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
        written.append(os.path.join(out_dir, "config.json.tmp"))
        for tmp in written:
            os.replace(tmp, tmp[:-4])
        written = []
    finally:
        if bar is not None:
            bar.close()
        for tmp in written:
            if os.path.exists(tmp):
                os.remove(tmp)
    return [os.path.join(out_dir, n) for n in names]


def _write_tensor(f, name: str, shape, dtype: torch.dtype, seed: int, bar) -> None:
    low, high = _init_range(name, shape)
    g = torch.Generator().manual_seed(_seed(seed, name))
    numel = _numel(shape)
    step = max(1, CHUNK_BYTES // torch.empty(0, dtype=dtype).element_size())
    chunk = torch.empty(min(step, numel), dtype=dtype)
    for start in range(0, numel, step):
        n = min(step, numel - start)
        part = chunk[:n]
        part.uniform_(low, high, generator=g)
        f.write(part.view(torch.uint8).numpy().data)
        if bar is not None:
            bar.update(part.numel() * part.element_size())


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m fragkit.synthetic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", required=True, choices=sorted(LIKE))
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the real model's)")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--shard-gb", type=float, default=5.0)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    try:
        cfg = like_config(args.like, args.layers, args.dtype)
    except ValueError as e:
        print("fragkit.synthetic: error: %s" % e, file=sys.stderr)
        return 2
    total = sum(_numel(s) for _, s in tensor_shapes(cfg)) * torch.empty(0, dtype=DTYPES[args.dtype][0]).element_size()
    os.makedirs(args.out, exist_ok=True)
    free = __import__("shutil").disk_usage(args.out).free
    if free < total + (64 << 20):
        print("fragkit.synthetic: error: %s: the checkpoint is %.2f GB, the device has %.2f GB free"
              % (args.out, total / 1e9, free / 1e9), file=sys.stderr)
        return 2
    for path in write_synthetic(cfg, args.out, args.seed, args.dtype, args.shard_gb,
                                progress=not args.quiet and sys.stderr.isatty()):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
