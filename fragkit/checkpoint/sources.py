"""Checkpoint readers: a Hugging Face model folder or a GGUF file, seen through one interface.

Both give a Hugging Face style ``config`` dict and tensors by their Hugging Face (hub) names, so one mapping
(families.py) turns either into the kit's modules: ``get(name)`` reads a whole tensor as float32 (the
materializing import); ``view(name)`` is a lazy view (views.py) that reads only the slices asked for, in the
checkpoint's own dtype (quantized GGUF tensors: dequantized to float32), for the streaming import:

- ``HFFolder``: ``config.json`` + ``*.safetensors`` (with ``model.safetensors.index.json`` when sharded),
  read with the ``safetensors`` package.
- ``GGUFFile``: read with the ``gguf`` package (``GGUFReader``; quantized tensors dequantized with
  ``gguf.quants.dequantize``). Its metadata becomes the config; tensor names are translated from GGUF's
  (``blk.N.attn_q``) to Hugging Face's through gguf's own tensor-name tables; llama.cpp's Q/K row order
  (rotary pairs interleaved, done by its converter for the llama architecture) is undone; stacked expert
  tensors are split per expert.
"""
import glob
import json
import os
import shutil
import struct
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .views import FnView, View, as_slices

# Files of a Hugging Face tokenizer, copied as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


class CheckpointError(ValueError):
    """A checkpoint that cannot be imported: the message names the file and what was expected and found."""


class Source:
    """What the importer reads: ``path``, ``kind``, ``config`` (a Hugging Face config dict), tensors by name."""

    path: str
    kind: str
    config: dict

    def names(self) -> List[str]:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (Hugging Face naming), float32, in Hugging Face's layout."""
        raise NotImplementedError

    def view(self, name: str) -> View:
        """A lazy view of ``name`` in the checkpoint's own dtype (quantized tensors: dequantized float32)."""
        raise NotImplementedError

    def own_dtype(self) -> torch.dtype:
        """The dtype most of the checkpoint's bytes are in (as ``view`` gives them)."""
        by_dtype: Dict[torch.dtype, int] = {}
        for name in self.names():
            v = self.view(name)
            by_dtype[v.dtype] = by_dtype.get(v.dtype, 0) + v.nbytes
        return max(sorted(by_dtype.items(), key=str), key=lambda kv: kv[1])[0]

    def files(self) -> List[Tuple[str, int, int]]:
        """(path, size, mtime_ns) of each file read: part of the export id."""
        raise NotImplementedError

    def save_tokenizer(self, out_dir: str) -> Optional[str]:
        """Write the tokenizer into ``out_dir`` (a Hugging Face tokenizer folder); None if there is none."""
        raise NotImplementedError


# ----------------------------------------------------------------------------------------------------------
# Hugging Face folders

class HFFolder(Source):
    kind = "huggingface"

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise CheckpointError("%s: no config.json (expected a Hugging Face model folder: config.json and "
                                  "*.safetensors)" % path)
        with open(config_path) as f:
            try:
                self.config = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError("%s: not JSON: %s" % (config_path, e)) from None
        index_path = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            with open(index_path) as f:
                try:
                    index = json.load(f)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise CheckpointError("%s: not JSON: %s" % (index_path, e)) from None
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError("%s: expected a \"weight_map\" of tensor name -> file" % index_path)
            files = sorted(set(weight_map.values()))
            for name in files:
                if not os.path.isfile(os.path.join(path, name)):
                    tensors = sorted(k for k, v in weight_map.items() if v == name)
                    raise CheckpointError("%s maps tensor %s%s to %s, which is not in the folder"
                                          % (index_path, tensors[0], " (and %d more)" % (len(tensors) - 1)
                                             if len(tensors) > 1 else "", name))
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                others = [os.path.basename(p) for p in glob.glob(os.path.join(path, "*.bin"))]
                hint = (" (found %s: PyTorch pickles are not read; convert them to safetensors)" % ", ".join(others)
                        if others else "")
                raise CheckpointError("%s: no *.safetensors files%s" % (path, hint))
        self._where: Dict[str, str] = {}
        self._meta: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
        self._extent: Dict[str, Tuple[str, int, int]] = {}
        for name in files:
            file = os.path.join(path, name)
            try:
                handle = safe_open(file, framework="pt")
            except Exception as e:  # safetensors' own error: truncated, bad header, ...
                raise CheckpointError(_safetensors_problem(file, e)) from None
            self._extent.update(_data_extents(file))
            with handle:
                for key in handle.keys():
                    if key in self._where:
                        raise CheckpointError("%s: tensor %s is in both %s and %s"
                                              % (path, key, self._where[key], name))
                    self._where[key] = name
                    sl = handle.get_slice(key)
                    kind = sl.get_dtype()
                    if kind not in SAFETENSORS_DTYPES:
                        raise CheckpointError("%s: tensor %s has dtype %s; the import reads floating-point weights "
                                              "only (%s)" % (file, key, kind, ", ".join(SAFETENSORS_DTYPES)))
                    self._meta[key] = (tuple(sl.get_shape()), SAFETENSORS_DTYPES[kind])
        if os.path.isfile(index_path):
            absent = sorted(set(weight_map) - set(self._where))
            if absent:
                raise CheckpointError("%s maps tensor %s to %s, which does not hold it"
                                      % (index_path, absent[0], weight_map[absent[0]]))
        declared = self.config.get("torch_dtype", self.config.get("dtype"))
        if isinstance(declared, str) and declared in DECLARED_DTYPES:
            expected = DECLARED_DTYPES[declared]
            for key in sorted(self._meta):
                if self._meta[key][1] != expected and not key.endswith("rotary_emb.inv_freq"):
                    raise CheckpointError("%s: tensor %s is %s, config.json says torch_dtype %s"
                                          % (os.path.join(path, self._where[key]), key,
                                             str(self._meta[key][1]).replace("torch.", ""), declared))

    def names(self) -> List[str]:
        return sorted(self._where)

    def file_of(self, name: str) -> str:
        return os.path.join(self.path, self._where[name])

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.file_of(name), framework="pt") as handle:
            return handle.get_tensor(name).to(torch.float32)

    def view(self, name: str) -> View:
        from safetensors import safe_open

        file = self.file_of(name)
        shape, dtype = self._meta[name]

        def read(bounds):
            # Opened per read (~60 us): the file's memory map goes away with the handle, so pages read
            # for one tensor do not stay in this process's resident memory.
            with safe_open(file, framework="pt") as handle:
                if not shape:
                    return handle.get_tensor(name)
                return handle.get_slice(name)[as_slices(bounds)]

        return FnView(shape, dtype, read, "%s: %s" % (file, name), self._extent.get(name), raw=True)

    def files(self):
        out = []
        for name in sorted(set(self._where.values())):
            st = os.stat(os.path.join(self.path, name))
            out.append((os.path.join(self.path, name), st.st_size, st.st_mtime_ns))
        return out

    def save_tokenizer(self, out_dir: str) -> Optional[str]:
        found = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(self.path, f))]
        if not any(f in found for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            return None
        os.makedirs(out_dir, exist_ok=True)
        for f in found:
            shutil.copyfile(os.path.join(self.path, f), os.path.join(out_dir, f))
        return out_dir


SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
DECLARED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _header(file: str):
    """(header dict, header length) of a safetensors file: 8 bytes of length, then JSON (the format's spec),
    or (None, 0) if it is not one."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length)) if length < (100 << 20) else None
    except (struct.error, ValueError):
        return None, 0
    return (header, length) if isinstance(header, dict) else (None, 0)


def _data_extents(file: str) -> Dict[str, Tuple[str, int, int]]:
    """Tensor name -> (file, first byte, end byte) of its data: where to read ahead (views.FnView.prefetch)."""
    header, length = _header(file)
    if header is None:
        return {}
    return {name: (file, 8 + length + e["data_offsets"][0], 8 + length + e["data_offsets"][1])
            for name, e in header.items() if name != "__metadata__" and isinstance(e, dict) and "data_offsets" in e}


def _safetensors_problem(file: str, error: Exception) -> str:
    """One line for a shard safetensors cannot open: a truncated file names the first tensor it cuts off."""
    size = os.path.getsize(file)
    header, length = _header(file)
    if header is not None:
        cut = sorted((entry["data_offsets"][1], name) for name, entry in header.items()
                     if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry)
        body = size - 8 - length
        for end, name in cut:
            if end > body:
                return ("%s: truncated: tensor %s ends at byte %d of the data, the file holds %d (%d bytes missing)"
                        % (file, name, end, max(body, 0), cut[-1][0] - body))
    return "%s: not a readable safetensors file: %s" % (file, error)


# ----------------------------------------------------------------------------------------------------------
# GGUF files

# GGUF architecture -> Hugging Face model_type (Mixtral is "llama" with experts in GGUF).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen2moe": "qwen2_moe"}


def _gguf_tensor_names(arch: str, n_layers: int) -> Dict[str, str]:
    """GGUF tensor name (without .weight/.bias) -> Hugging Face module path, from gguf's own tables.

    Per-expert Hugging Face names carry an ``{e}`` placeholder: GGUF stores the experts stacked."""
    import gguf

    T = gguf.MODEL_TENSOR
    hf = {
        T.TOKEN_EMBD: "model.embed_tokens",
        T.OUTPUT_NORM: "model.norm",
        T.OUTPUT: "lm_head",
        T.ATTN_NORM: "model.layers.{bid}.input_layernorm",
        T.FFN_NORM: "model.layers.{bid}.post_attention_layernorm",
        T.ATTN_Q: "model.layers.{bid}.self_attn.q_proj",
        T.ATTN_K: "model.layers.{bid}.self_attn.k_proj",
        T.ATTN_V: "model.layers.{bid}.self_attn.v_proj",
        T.ATTN_OUT: "model.layers.{bid}.self_attn.o_proj",
        T.FFN_GATE: "model.layers.{bid}.mlp.gate_proj",
        T.FFN_UP: "model.layers.{bid}.mlp.up_proj",
        T.FFN_DOWN: "model.layers.{bid}.mlp.down_proj",
        T.ROPE_FREQS: "rope_freqs",
    }
    if arch == "qwen2moe":
        hf.update({
            T.FFN_GATE_INP: "model.layers.{bid}.mlp.gate",
            T.FFN_GATE_EXP: "model.layers.{bid}.mlp.experts.{e}.gate_proj",
            T.FFN_UP_EXP: "model.layers.{bid}.mlp.experts.{e}.up_proj",
            T.FFN_DOWN_EXP: "model.layers.{bid}.mlp.experts.{e}.down_proj",
            T.FFN_GATE_INP_SHEXP: "model.layers.{bid}.mlp.shared_expert_gate",
            T.FFN_GATE_SHEXP: "model.layers.{bid}.mlp.shared_expert.gate_proj",
            T.FFN_UP_SHEXP: "model.layers.{bid}.mlp.shared_expert.up_proj",
            T.FFN_DOWN_SHEXP: "model.layers.{bid}.mlp.shared_expert.down_proj",
        })
    else:  # Mixtral in GGUF: architecture llama with experts
        hf.update({
            T.FFN_GATE_INP: "model.layers.{bid}.block_sparse_moe.gate",
            T.FFN_GATE_EXP: "model.layers.{bid}.block_sparse_moe.experts.{e}.w1",
            T.FFN_UP_EXP: "model.layers.{bid}.block_sparse_moe.experts.{e}.w3",
            T.FFN_DOWN_EXP: "model.layers.{bid}.block_sparse_moe.experts.{e}.w2",
        })
    out = {}
    for tensor, hf_name in hf.items():
        gguf_name = gguf.TENSOR_NAMES[tensor]
        if "{bid}" in gguf_name:
            for bid in range(n_layers):
                out[gguf_name.format(bid=bid)] = hf_name.replace("{bid}", str(bid))
        else:
            out[gguf_name] = hf_name
    return out


def unpermute_rotary_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: its converter interleaves each head's two rotary halves
    (rows [h, 2, d/2] -> [h, d/2, 2]) for GGML's rope; Hugging Face keeps the halves apart."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFFile(Source):
    kind = "gguf"

    def __init__(self, path: str):
        import gguf

        self.path = path
        try:
            self._reader = gguf.GGUFReader(path)
        except Exception as e:  # the reader raises ValueError/struct errors on bad files
            raise CheckpointError("%s: not a readable GGUF file: %s" % (path, e)) from None
        arch = self._field("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise CheckpointError("%s: GGUF architecture %r is not supported (supported: %s)"
                                  % (path, arch, ", ".join(sorted(GGUF_ARCHITECTURES))))
        self.arch = arch
        self.config = self._config()
        self._tensors = {t.name: t for t in self._reader.tensors}
        table = _gguf_tensor_names(arch, self.config["num_hidden_layers"])
        self._hf: Dict[str, tuple] = {}  # hf name -> (gguf tensor, expert index or None)
        for name, t in self._tensors.items():
            base, _, suffix = name.rpartition(".")
            if suffix not in ("weight", "bias") or base not in table:
                raise CheckpointError("%s: tensor %s has no place in a %s model" % (path, name, arch))
            hf_base = table[base]
            if "{e}" in hf_base:
                for e in range(int(t.shape[-1])):  # GGUF shapes are innermost-first: experts come last
                    self._hf["%s.%s" % (hf_base.format(e=e), suffix)] = (t, e)
            elif hf_base == "rope_freqs":
                self.config["rope_scaling"] = {"rope_type": "freq_factors",
                                               "factors": self._array(t).tolist()}
            else:
                self._hf["%s.%s" % (hf_base, suffix)] = (t, None)
        if "lm_head.weight" not in self._hf:
            self.config["tie_word_embeddings"] = True

    def _field(self, key: str, default=None):
        field = self._reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def _config(self) -> dict:
        a = self.arch
        f = self._field
        missing = [k for k in ("block_count", "embedding_length", "attention.head_count")
                   if f("%s.%s" % (a, k)) is None]
        if missing:
            raise CheckpointError("%s: GGUF metadata lacks %s" % (self.path, ", ".join("%s.%s" % (a, k)
                                                                                       for k in missing)))
        heads = int(f(a + ".attention.head_count"))
        hidden = int(f(a + ".embedding_length"))
        vocab = f(a + ".vocab_size")
        if vocab is None:
            tokens = self._reader.fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else None
        cfg = {
            "model_type": GGUF_ARCHITECTURES[a],
            "hidden_size": hidden,
            "num_hidden_layers": int(f(a + ".block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(f(a + ".attention.head_count_kv", heads)),
            "head_dim": int(f(a + ".attention.key_length", hidden // heads)),
            "rms_norm_eps": float(f(a + ".attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(f(a + ".rope.freq_base", 10000.0)),
            "max_position_embeddings": int(f(a + ".context_length", 2048)),
            "vocab_size": int(vocab),
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        }
        value_length = f(a + ".attention.value_length")
        if value_length is not None and int(value_length) != cfg["head_dim"]:
            cfg["v_head_dim"] = int(value_length)
        rope_dims = f(a + ".rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != cfg["head_dim"]:
            cfg["partial_rotary_factor"] = int(rope_dims) / cfg["head_dim"]
        scaling = f(a + ".rope.scaling.type")
        if scaling not in (None, "none"):
            cfg["rope_scaling"] = {"rope_type": scaling, "factor": f(a + ".rope.scaling.factor")}
        experts = f(a + ".expert_count")
        if a == "qwen2moe":
            cfg.update(num_experts=int(experts), num_experts_per_tok=int(f(a + ".expert_used_count")),
                       moe_intermediate_size=int(f(a + ".expert_feed_forward_length")),
                       shared_expert_intermediate_size=int(f(a + ".expert_shared_feed_forward_length")),
                       intermediate_size=int(f(a + ".feed_forward_length", 0)),
                       norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])
        elif experts:
            cfg.update(model_type="mixtral", num_local_experts=int(experts),
                       num_experts_per_tok=int(f(a + ".expert_used_count")),
                       intermediate_size=int(f(a + ".feed_forward_length")))
        else:
            cfg["intermediate_size"] = int(f(a + ".feed_forward_length"))
        return cfg

    @staticmethod
    def _array(t) -> np.ndarray:
        import gguf

        data = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(data, dtype=np.float32).reshape(tuple(int(n) for n in reversed(t.shape.tolist())))

    def names(self) -> List[str]:
        return sorted(self._hf)

    def view(self, name: str) -> View:
        import gguf

        t, expert = self._hf[name]
        dims = tuple(int(n) for n in reversed(t.shape.tolist()))
        if expert is not None:
            dims = dims[1:]
        permuted = self.arch == "llama" and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name)
        kind = t.tensor_type
        direct = {gguf.GGMLQuantizationType.F32: torch.float32, gguf.GGMLQuantizationType.F16: torch.float16}
        if kind in direct and not permuted:
            def read(bounds):  # slices of the memory map itself
                array = t.data.reshape(tuple(int(n) for n in reversed(t.shape.tolist())))
                index = ((expert,) if expert is not None else ()) + as_slices(bounds)
                return torch.from_numpy(np.array(array[index]))  # a copy: the map is read-only

            return FnView(dims, direct[kind], read, "%s: %s" % (self.path, t.name))

        def read_whole(bounds):  # quantized or row-permuted: one whole tensor, dequantized
            return self.get(name)[as_slices(bounds)]

        return FnView(dims, torch.float32, read_whole, "%s: %s" % (self.path, t.name))

    def own_dtype(self) -> torch.dtype:
        import gguf

        kinds = {t.tensor_type for t in self._tensors.values() if len(t.shape) > 1}
        if kinds == {gguf.GGMLQuantizationType.BF16}:
            return torch.bfloat16
        if kinds == {gguf.GGMLQuantizationType.F16}:
            return torch.float16
        return torch.float32  # float32, mixed or quantized: dequantized to float32

    def files(self):
        st = os.stat(self.path)
        return [(self.path, st.st_size, st.st_mtime_ns)]

    def get(self, name: str) -> torch.Tensor:
        t, expert = self._hf[name]
        array = self._array(t)
        tensor = torch.from_numpy(array[expert].copy() if expert is not None else array.copy())
        # llama.cpp permutes Q and K rows for the llama architecture only (its LlamaModel converter).
        if self.arch == "llama" and (name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias")):
            tensor = unpermute_rotary_rows(tensor, self.config["num_attention_heads"])
        elif self.arch == "llama" and (name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias")):
            tensor = unpermute_rotary_rows(tensor, self.config["num_key_value_heads"])
        return tensor

    def save_tokenizer(self, out_dir: str) -> Optional[str]:
        if self._reader.fields.get("tokenizer.ggml.model") is None:
            return None
        # transformers builds a Hugging Face (fast) tokenizer from GGUF's tokenizer metadata.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(self.path)),
                                                  gguf_file=os.path.basename(self.path))
        os.makedirs(out_dir, exist_ok=True)
        tokenizer.save_pretrained(out_dir)
        return out_dir


def open_checkpoint(path: str) -> Source:
    if os.path.isdir(path):
        return HFFolder(path)
    if not os.path.exists(path):
        raise CheckpointError("%s: no such file or folder" % path)
    if not os.path.isfile(path):
        raise CheckpointError("%s: not a regular file or a folder" % path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return GGUFFile(path)
    raise CheckpointError("%s: neither a Hugging Face model folder nor a GGUF file (starts with %r, GGUF files "
                          "start with b'GGUF')" % (path, magic))
