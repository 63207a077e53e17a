"""Model families: a Hugging Face config -> the kit's model and config; checkpoint tensors -> its weights.

Llama (and Mistral without a sliding window), Qwen2, Qwen2-MoE and Mixtral. Every config field is either
honoured (it sets the kit config), known not to change the forward's math (ids, training-only settings), or
refused by name: an import never silently ignores a field.
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import models
from ..layers import DEFAULT_VOCAB_PADDING_SIZE, pad_vocab_size
from .sources import CheckpointError, Source
from .views import Cat, PadRows, Reshape, Stack, TensorView, View, materialize

# Fields that do not change a forward at inference: ids, bookkeeping, training-only settings, generation
# defaults, and the generic fields every Hugging Face config carries.
NO_MATH_FIELDS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "decoder_start_token_id",
    "initializer_range", "use_cache", "attention_dropout", "hidden_dropout", "router_aux_loss_coef",
    "output_router_logits", "router_jitter_noise", "pretraining_tp", "tie_encoder_decoder", "is_decoder",
    "is_encoder_decoder", "add_cross_attention", "id2label", "label2id", "problem_type", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "chunk_size_feed_forward",
    "prefix", "task_specific_params", "finetuning_task", "tokenizer_class", "_attn_implementation_autoset",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "temperature",
    "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "diversity_penalty",
    "cross_attention_hidden_size", "tf_legacy_loss", "pruned_heads", "quantization_config_dequantized",
}


@dataclass
class Family:
    """One checkpoint's model: the kit config and classes, and where each kit weight comes from."""
    name: str                 # "llama" | "qwen2" | "qwen2_moe" | "mixtral"
    config: object            # the kit config (models.LlamaConfig, ...)
    hf_config: dict
    tied: bool
    enable_expert_parallel: bool = False
    notes: List[str] = field(default_factory=list)

    def builder(self) -> Callable[[int, int], nn.Module]:
        if self.name == "llama":
            return models.llama_builder(self.config)
        if self.name == "qwen2":
            return models.qwen2_builder(self.config)
        if self.name == "qwen2_moe":
            return models.qwen2_moe_builder(self.config, self.enable_expert_parallel)
        return models.mixtral_builder(self.config, self.enable_expert_parallel)

    # -- tensor parallelism ------------------------------------------------------------------------------
    def check_tp(self, tp: int) -> None:
        """Refuse a tp the layers cannot be split by, naming the layer and the numbers."""
        c = self.config
        if tp < 1:
            raise CheckpointError("tp must be >= 1 (got %d)" % tp)
        layer = "model.layers.*.self_attn.qkv_proj (QKVParallelLinear)"
        if c.num_attention_heads % tp:
            raise CheckpointError("tp %d does not divide the %d attention heads of %s"
                                  % (tp, c.num_attention_heads, layer))
        kv = c.num_key_value_heads
        if tp >= kv and tp % kv:
            raise CheckpointError("tp %d is neither a divisor nor a multiple of the %d kv heads of %s (kv heads are "
                                  "replicated only when tp is a multiple)" % (tp, kv, layer))
        if tp < kv and kv % tp:
            raise CheckpointError("tp %d does not divide the %d kv heads of %s" % (tp, kv, layer))
        padded = pad_vocab_size(c.vocab_size, DEFAULT_VOCAB_PADDING_SIZE)
        if padded % tp:
            raise CheckpointError("tp %d does not divide the padded vocabulary %d (%d padded to a multiple of %d) of "
                                  "model.embed_tokens (VocabParallelEmbedding) and lm_head (ParallelLMHead)"
                                  % (tp, padded, c.vocab_size, DEFAULT_VOCAB_PADDING_SIZE))
        for size, where in self._column_sizes():
            if size % tp:
                raise CheckpointError("tp %d does not divide the intermediate size %d of %s" % (tp, size, where))
        experts = self._num_experts()
        if experts and self.enable_expert_parallel and tp > experts:
            raise CheckpointError("expert parallelism over %d ranks needs at least %d experts; "
                                  "model.layers.*.%s.experts (FusedMoE) has %d" % (tp, tp, self._moe_module(), experts))
        if experts and self.name == "qwen2_moe" and tp > experts:
            raise CheckpointError("tp %d is greater than the %d experts of model.layers.*.mlp (Qwen2MoeSparseMoeBlock)"
                                  % (tp, experts))

    def _moe_module(self) -> str:
        return "block_sparse_moe" if self.name == "mixtral" else "mlp"

    def _num_experts(self) -> int:
        return getattr(self.config, "num_experts", 0) or getattr(self.config, "num_local_experts", 0)

    def _column_sizes(self) -> List[Tuple[int, str]]:
        c = self.config
        mlp = "model.layers.*.mlp.gate_up_proj (MergedColumnParallelLinear)"
        if self.name in ("llama", "qwen2"):
            return [(c.intermediate_size, mlp)]
        moe = [] if self.enable_expert_parallel else [
            (c.moe_intermediate_size if self.name == "qwen2_moe" else c.intermediate_size,
             "model.layers.*.%s.experts (FusedMoE)" % self._moe_module())]
        if self.name == "qwen2_moe":
            moe.append((c.shared_expert_intermediate_size,
                        "model.layers.*.mlp.shared_expert.gate_up_proj (MergedColumnParallelLinear)"))
            if _dense_layers(c):
                moe.append((c.intermediate_size, mlp))
        return moe

    # -- weights -----------------------------------------------------------------------------------------
    def weight_sources(self) -> Dict[str, Tuple[List[str], Callable]]:
        """kit parameter name (of the tp=1 model) -> (checkpoint tensor names, how to combine their views into
        the kit's whole tensor: views.py, lazy for the streaming import, over whole tensors for the other)."""
        c = self.config
        cat0 = Cat
        one = lambda ts: ts[0]  # noqa: E731
        padded = pad_vocab_size(c.vocab_size, DEFAULT_VOCAB_PADDING_SIZE)

        def pad_rows(ts):  # vocab rows padded with zeros, as vLLM's padded vocab holds them
            return PadRows(ts[0], padded)

        out = {"model.embed_tokens.weight": (["model.embed_tokens.weight"], pad_rows),
               "model.norm.weight": (["model.norm.weight"], one),
               "lm_head.weight": (["model.embed_tokens.weight" if self.tied else "lm_head.weight"], pad_rows)}
        for i in range(c.num_hidden_layers):
            hf, kit = "model.layers.%d." % i, "model.layers.%d." % i
            for norm in ("input_layernorm", "post_attention_layernorm"):
                out[kit + norm + ".weight"] = ([hf + norm + ".weight"], one)
            for suffix in (["weight", "bias"] if self._qkv_bias() else ["weight"]):
                out[kit + "self_attn.qkv_proj." + suffix] = (
                    [hf + "self_attn.%s_proj.%s" % (p, suffix) for p in "qkv"], cat0)
            for suffix in (["weight", "bias"] if getattr(c, "o_proj_bias", False) else ["weight"]):
                out[kit + "self_attn.o_proj." + suffix] = ([hf + "self_attn.o_proj." + suffix], one)
            if self.name == "mixtral":
                self._moe_sources(out, kit + "block_sparse_moe.", hf + "block_sparse_moe.", ("w1", "w3", "w2"))
            elif self.name == "qwen2_moe" and i not in _dense_layers(c):
                self._moe_sources(out, kit + "mlp.", hf + "mlp.", ("gate_proj", "up_proj", "down_proj"))
                self._mlp_sources(out, kit + "mlp.shared_expert.", hf + "mlp.shared_expert.", False)
                # [1, H]; GGUF files (llama.cpp) store it as [H].
                out[kit + "mlp.shared_expert_gate.weight"] = ([hf + "mlp.shared_expert_gate.weight"],
                                                              lambda ts: Reshape(ts[0], (1, -1)))
            else:
                self._mlp_sources(out, kit + "mlp.", hf + "mlp.", getattr(c, "mlp_bias", False))
        return out

    def _qkv_bias(self) -> bool:
        # The kit's attention: Qwen2-MoE always has q/k/v biases, Mixtral never; Llama and Qwen2 by config.
        return {"qwen2_moe": True, "mixtral": False}.get(self.name, getattr(self.config, "attention_bias", False))

    @staticmethod
    def _mlp_sources(out, kit: str, hf: str, bias: bool) -> None:
        for suffix in (["weight", "bias"] if bias else ["weight"]):
            out[kit + "gate_up_proj." + suffix] = ([hf + "gate_proj." + suffix, hf + "up_proj." + suffix], Cat)
            out[kit + "down_proj." + suffix] = ([hf + "down_proj." + suffix], lambda ts: ts[0])

    def _moe_sources(self, out, kit: str, hf: str, names: Tuple[str, str, str]) -> None:
        gate, up, down = names
        n = self._num_experts()
        out[kit + "gate.weight"] = ([hf + "gate.weight"], lambda ts: ts[0])
        # FusedMoE: w13 [E, 2I, H] rows [gate | up] per expert; w2 [E, H, I].
        out[kit + "experts.w13_weight"] = (
            [hf + "experts.%d.%s.weight" % (e, p) for e in range(n) for p in (gate, up)],
            lambda ts: Stack([Cat(ts[2 * e:2 * e + 2]) for e in range(len(ts) // 2)]))
        out[kit + "experts.w2_weight"] = ([hf + "experts.%d.%s.weight" % (e, down) for e in range(n)], Stack)

    def _check_sources(self, params: Dict[str, Tuple[int, ...]], source: Source) -> None:
        """Every kit weight has its checkpoint tensors, every checkpoint tensor a place (or is redundant)."""
        sources = self.weight_sources()
        missing_kit = sorted(set(params) - set(sources))
        if missing_kit:
            raise CheckpointError("%s: no checkpoint tensor for the kit weights %s" % (source.path, missing_kit[:5]))
        available = set(source.names())
        used = set()
        for kit_name, (names, _) in sorted(sources.items()):
            absent = [n for n in names if n not in available]
            if absent:
                raise CheckpointError("%s: tensor %s is missing (needed for %s)" % (source.path, absent[0], kit_name))
            used.update(names)
        unused = sorted(n for n in available - used if not _redundant(n, self.tied))
        if unused:
            raise CheckpointError("%s: %d checkpoint tensors have no place in the kit's %s model, e.g. %s "
                                  "(a feature this import does not support)"
                                  % (source.path, len(unused), self.name, ", ".join(unused[:3])))

    @staticmethod
    def _check_shape(source: Source, names: List[str], kit_name: str, got, expected) -> None:
        if tuple(got) != tuple(expected):
            raise CheckpointError("%s: %s gives %s a shape %s, the model expects %s"
                                  % (source.path, "+".join(names) if len(names) < 4 else names[0] + "+...",
                                     kit_name, tuple(got), tuple(expected)))

    def kit_views(self, shapes: Dict[str, Tuple[int, ...]], source: Source) -> Dict[str, View]:
        """kit parameter name -> a lazy view of its whole (tp=1) tensor, every shape checked against
        ``shapes`` (the tp=1 model's, e.g. built on meta) before anything is read."""
        self._check_sources(shapes, source)
        out = {}
        for kit_name, (names, combine) in sorted(self.weight_sources().items()):
            try:
                view = combine([source.view(n) for n in names])
            except ValueError as e:
                raise CheckpointError("%s: %s: %s" % (source.path, kit_name, e)) from None
            self._check_shape(source, names, kit_name, view.shape, shapes[kit_name])
            out[kit_name] = view
        return out

    def load_weights(self, full: nn.Module, source: Source, progress=None) -> None:
        """Fill ``full`` (the kit model at tp=1) from ``source``, whole tensors in float32 (the materializing
        import); every kit weight filled, every checkpoint tensor used (or known to be redundant), every
        shape checked."""
        params = dict(full.named_parameters(remove_duplicate=False))  # a tied head: filled twice, alike
        self._check_sources({k: tuple(p.shape) for k, p in params.items()}, source)
        items = sorted(self.weight_sources().items())
        for kit_name, (names, combine) in (progress(items) if progress else items):
            value = materialize(combine([TensorView(source.get(n), n) for n in names]))
            dst = params[kit_name]
            self._check_shape(source, names, kit_name, value.shape, dst.shape)
            with torch.no_grad():
                dst.copy_(value.to(dst.dtype))


def _redundant(name: str, tied: bool) -> bool:
    """Tensors a checkpoint may carry that hold nothing the forward needs."""
    return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


def _dense_layers(c) -> List[int]:
    """Qwen2-MoE layers with a dense MLP (mlp_only_layers, or off the decoder_sparse_step)."""
    return [i for i in range(c.num_hidden_layers)
            if i in c.mlp_only_layers or c.num_experts == 0 or (i + 1) % c.decoder_sparse_step != 0]


# ----------------------------------------------------------------------------------------------------------
# config -> family

FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen2_moe": "qwen2_moe", "mixtral": "mixtral"}


def _rope_scaling(cfg: dict, where: str) -> Tuple[float, Optional[dict]]:
    """(rope_theta, scaling for models.rope_inv_freq) from either transformers 4's rope_theta/rope_scaling or
    transformers 5's rope_parameters."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling = params if params.get("rope_type", "default") != "default" else scaling
    theta = float(theta if theta is not None else 10000.0)
    if scaling is None:
        return theta, None
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    scaling["rope_type"] = kind
    if kind == "default":
        return theta, None
    if kind not in models.ROPE_TYPES + ("freq_factors",):
        raise CheckpointError("%s: rope scaling of type %r is not supported (supported: %s)"
                              % (where, kind, ", ".join(models.ROPE_TYPES)))
    known = {"rope_type", "type", "factor", "rope_theta", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "factors"}
    extra = sorted(set(scaling) - known)
    if extra:
        raise CheckpointError("%s: rope scaling field(s) %s are not supported" % (where, ", ".join(extra)))
    return theta, scaling


def family_for(cfg: dict, where: str, dtype: torch.dtype = torch.float32, enable_expert_parallel: bool = False,
               ignore_fields=()) -> Family:
    """The family of a Hugging Face config (``where`` names the file in messages)."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError("%s: model_type %r is not supported (supported: %s)"
                              % (where, model_type, ", ".join(sorted(FAMILIES))))
    name = FAMILIES[model_type]
    if enable_expert_parallel and name not in ("qwen2_moe", "mixtral"):
        raise CheckpointError("%s: --ep needs a mixture-of-experts model (Qwen2-MoE, Mixtral); this is %s"
                              % (where, model_type))
    honoured = set()

    def take(key, default=None, required=False):
        honoured.add(key)
        if key not in cfg or cfg[key] is None:
            if required:
                raise CheckpointError("%s: config field %r is missing" % (where, key))
            return default
        return cfg[key]

    def refuse_unless(key, ok, why):
        honoured.add(key)
        if key in cfg and not ok(cfg[key]):
            raise CheckpointError("%s: %s = %r is not supported: %s" % (where, key, cfg[key], why))

    refuse_unless("hidden_act", lambda v: v == "silu", "the kit's MLPs and experts use SiLU")
    refuse_unless("partial_rotary_factor", lambda v: float(v) == 1.0, "the kit rotates whole heads")
    refuse_unless("layer_types", lambda v: all(t == "full_attention" for t in v),
                  "every layer must use full attention")
    refuse_unless("logits_scaling", lambda v: float(v) == 1.0, "scaled logits")
    refuse_unless("attn_logit_softcapping", lambda v: v is None, "soft-capped attention")
    refuse_unless("final_logit_softcapping", lambda v: v is None, "soft-capped logits")
    refuse_unless("quantization_config", lambda v: v.get("quant_method") == "gguf",
                  "quantized Hugging Face checkpoints (GPTQ, AWQ, ...) are not read; import the unquantized model")
    max_pos = int(take("max_position_embeddings", 2048))
    # A sliding window at least as long as the longest sequence the model accepts never slides.
    use_window = take("use_sliding_window", model_type not in ("qwen2", "qwen2_moe"))
    window = take("sliding_window")
    take("max_window_layers")
    if use_window and window is not None and int(window) < max_pos:
        raise CheckpointError("%s: sliding_window = %d (< max_position_embeddings %d) is not supported: the kit's "
                              "attention is full causal attention" % (where, int(window), max_pos))
    theta, scaling = _rope_scaling(cfg, where)
    honoured.update({"rope_theta", "rope_scaling", "rope_parameters"})
    common = dict(
        vocab_size=int(take("vocab_size", required=True)),
        hidden_size=int(take("hidden_size", required=True)),
        num_attention_heads=int(take("num_attention_heads", required=True)),
        num_hidden_layers=int(take("num_hidden_layers", required=True)),
        rms_norm_eps=float(take("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=max_pos, dtype=dtype)
    common["num_key_value_heads"] = int(take("num_key_value_heads", common["num_attention_heads"]))
    head_dim = take("head_dim")
    common["head_dim"] = int(head_dim) if head_dim else common["hidden_size"] // common["num_attention_heads"]
    refuse_unless("v_head_dim", lambda v: int(v) == common["head_dim"], "value heads of another size than "
                  "query/key heads (%d)" % common["head_dim"])
    tied = bool(take("tie_word_embeddings", False))  # False: the default of all four families' configs
    common["tie_word_embeddings"] = tied  # the kit model shares one parameter (stored once per rank file)

    if name in ("llama", "qwen2"):
        attention_bias = bool(take("attention_bias", False))
        qkv_bias = True if name == "qwen2" else attention_bias
        config = models.LlamaConfig(intermediate_size=int(take("intermediate_size", required=True)),
                                    attention_bias=qkv_bias, o_proj_bias=attention_bias and name == "llama",
                                    mlp_bias=bool(take("mlp_bias", False)), **common)
    elif name == "qwen2_moe":
        refuse_unless("qkv_bias", lambda v: bool(v), "Qwen2-MoE attention without q/k/v biases")
        config = models.Qwen2MoeConfig(
            num_experts=int(take("num_experts", required=True)),
            num_experts_per_tok=int(take("num_experts_per_tok", required=True)),
            moe_intermediate_size=int(take("moe_intermediate_size", required=True)),
            shared_expert_intermediate_size=int(take("shared_expert_intermediate_size", required=True)),
            intermediate_size=int(take("intermediate_size", 0)),
            norm_topk_prob=bool(take("norm_topk_prob", False)),
            decoder_sparse_step=int(take("decoder_sparse_step", 1)),
            mlp_only_layers=list(take("mlp_only_layers", []) or []), **common)
    else:
        config = models.MixtralConfig(num_local_experts=int(take("num_local_experts", required=True)),
                                      num_experts_per_tok=int(take("num_experts_per_tok", required=True)),
                                      intermediate_size=int(take("intermediate_size", required=True)), **common)
    unknown = sorted(k for k in cfg if k not in honoured and k not in NO_MATH_FIELDS and k not in ignore_fields)
    if unknown:
        raise CheckpointError("%s: config field(s) %s are not understood by the %s import; if they do not change "
                              "the forward's math, pass --ignore-config-field for each" % (where, ", ".join(unknown),
                                                                                          name))
    return Family(name=name, config=config, hf_config=cfg, tied=tied,
                  enable_expert_parallel=enable_expert_parallel)
