"""Tiny checkpoints of real model families, written by transformers' save_pretrained, and the map from
vLLM's locations to the same values read with transformers' forward hooks.

Each family gives: a config (head_dim 64: vLLM's CPU attention refuses smaller heads), the module prefix of
its decoder layers in vLLM, and for every location a plan saves, how to read the whole value from
transformers' hooks (q|k|v and gate|up concatenated in logical order: what fragments must return).
"""
import os

import torch
import transformers

FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "gemma2", "gpt_neox")


def neox_tree() -> str:
    """Which module tree vLLM gives GPT-NeoX: "vllm" (0.24: its own models/gpt_neox.py, gpt_neox.layers.*,
    QKVParallelLinear's [Q | K | V]) or "transformers" (0.32 has no such module: the registry serves
    GPTNeoXForCausalLM through the Transformers backend, model.layers.*, query_key_value a plain column-parallel
    layer in transformers' per-head [q k v] layout, no "heads" view). The checks follow the tree vLLM has."""
    import importlib.util
    try:
        return "vllm" if importlib.util.find_spec("vllm.model_executor.models.gpt_neox") else "transformers"
    except ImportError:  # no vLLM: transformers-only callers, either is fine
        return "vllm"


def config(family: str, heads: int = 4, kv_heads: int = 2):
    # tp 3 (6 heads): every fragmented width and the padded vocab (380 -> 384) must divide by 3
    common = dict(vocab_size=300 if heads % 3 else 380, hidden_size=64 * heads, num_hidden_layers=2, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=128, torch_dtype="float32")
    if family == "llama":
        return transformers.LlamaConfig(intermediate_size=64 * heads, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(intermediate_size=256, **common)
    if family == "qwen3":
        return transformers.Qwen3Config(intermediate_size=256, head_dim=64, **common)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(intermediate_size=256, moe_intermediate_size=128,
                                           shared_expert_intermediate_size=192, num_experts=4,
                                           num_experts_per_tok=2, decoder_sparse_step=1, **common)
    if family == "gemma2":
        # FRAG_GEMMA2_SOFTCAP=0: the same model without attention-score softcapping, to tell vLLM's Triton softcap
        # apart from everything else on a GPU (tools/probes/softcap_probe.py, docs/vllm.md "On a GPU")
        cap = None if os.environ.get("FRAG_GEMMA2_SOFTCAP") == "0" else 50.0
        return transformers.Gemma2Config(intermediate_size=256, head_dim=64, sliding_window=64,
                                         attn_logit_softcapping=cap, **common)
    if family == "gpt_neox":
        c = dict(common)
        c.pop("num_key_value_heads")
        return transformers.GPTNeoXConfig(intermediate_size=256, rotary_pct=0.25, **c)
    raise ValueError(family)


def write_checkpoint(family: str, folder: str, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> None:
    torch.manual_seed(seed)
    cfg = config(family, heads, kv_heads)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():  # weights large enough that every layer matters (default init is tiny)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)


def hf_model(folder: str):
    """transformers' model of `folder` on the checks' device and dtype (engine_env: the GPU with vLLM's CUDA
    build, else the CPU). Gemma 2 in transformers' eager attention, the one that soft-caps its attention logits
    (attn_logit_softcapping, as vLLM does): transformers 5.24 refuses SDPA for Gemma 2, 5.17 and 5.19 pick
    it by default, which drops the soft-capping (measured on 5.19: 2.6e-4 relative at layer 0's attention
    output, 8.5e-5 at the logits, against eager)."""
    import engine_env
    eager = {"attn_implementation": "eager"} if _model_type(folder) == "gemma2" else {}
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=engine_env.torch_dtype(), **eager).to(engine_env.DEVICE).eval()


def _model_type(folder: str) -> str:
    import json
    import os
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f).get("model_type", "")


def ids(model, tokens) -> torch.Tensor:
    """A [1, len] batch of token ids on `model`'s device."""
    return torch.tensor([list(tokens)], device=next(model.parameters()).device)


class Reader:
    """vLLM location -> (HF module path, side, how to turn HF values into vLLM's whole value)."""

    def __init__(self, family: str, cfg):
        self.family, self.cfg = family, cfg
        # GPT-NeoX through vLLM's Transformers backend: vLLM's names are transformers' under "model." (not
        # "gpt_neox."), and the fused q|k|v stays in transformers' per-head layout
        self.hf_tree = family == "gpt_neox" and neox_tree() == "transformers"

    def layer_prefix(self, i):
        """Layer i's module path in vLLM."""
        if self.family == "gpt_neox":
            return f"model.layers.{i}" if self.hf_tree else f"gpt_neox.layers.{i}"
        return f"model.layers.{i}"

    def hf(self, name: str) -> str:
        """transformers' module path of vLLM's module `name`."""
        return "gpt_neox." + name[len("model."):] if self.hf_tree and name.startswith("model.") else name

    def locations(self, layers=(0, 1)):
        """The fragmented and whole vLLM locations a test saves, per layer, with their HF readers."""
        out = {}
        f = self.family
        for i in layers:
            p = self.layer_prefix(i)
            if f == "gpt_neox":
                h = self.hf
                out[f"{p}.attention.query_key_value.output"] = (
                    "output" if self.hf_tree else "neox_qkv", h(f"{p}.attention.query_key_value"))
                out[f"{p}.attention.dense.input"] = ("input", h(f"{p}.attention.dense"))
                out[f"{p}.attention.dense.output"] = ("output", h(f"{p}.attention.dense"))
                out[f"{p}.mlp.dense_h_to_4h.output"] = ("output", h(f"{p}.mlp.dense_h_to_4h"))
                out[f"{p}.mlp.dense_4h_to_h.input"] = ("input", h(f"{p}.mlp.dense_4h_to_h"))
                out[f"{p}.mlp.dense_4h_to_h.output"] = ("output", h(f"{p}.mlp.dense_4h_to_h"))
                continue
            a = f"{p}.self_attn"
            out[f"{a}.qkv_proj.output"] = ("cat", [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"])
            out[f"{a}.o_proj.input"] = ("input", f"{a}.o_proj")
            out[f"{a}.o_proj.output"] = ("output", f"{a}.o_proj")
            if f == "qwen2_moe":
                s = f"{p}.mlp.shared_expert"
                out[f"{s}.gate_up_proj.output"] = ("cat", [f"{s}.gate_proj", f"{s}.up_proj"])
                out[f"{s}.down_proj.input"] = ("input", f"{s}.down_proj")
                out[f"{s}.down_proj.output"] = ("output", f"{s}.down_proj")  # a partial sum in vLLM at tp > 1
                out[f"{p}.mlp.experts.output"] = ("output", f"{p}.mlp")  # routed + gated shared, all-reduced
            else:
                m = f"{p}.mlp"
                if f == "gemma2":  # its four norms a layer (vLLM passes the residual through two of them: a tuple)
                    for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                              "post_feedforward_layernorm"):
                        out[f"{p}.{n}.output"] = ("output", f"{p}.{n}")
                out[f"{m}.gate_up_proj.output"] = ("cat", [f"{m}.gate_proj", f"{m}.up_proj"])
                out[f"{m}.down_proj.input"] = ("input", f"{m}.down_proj")
                out[f"{m}.down_proj.output"] = ("output", f"{m}.down_proj")
        emb = "model.embed_tokens"
        if f == "gpt_neox":
            emb = "model.embed_in" if self.hf_tree else "gpt_neox.embed_in"
        # Gemma 2: transformers' embedding module scales by sqrt(hidden); vLLM's scales after its embed_tokens
        out[f"{emb}.output"] = ("gemma_embed", emb) if f == "gemma2" else ("output", self.hf(emb))
        return out

    def read(self, spec, captured):
        kind, what = spec
        if kind == "cat":
            return torch.cat([captured[(m, "output")] for m in what], -1)
        if kind == "neox_qkv":  # HF's fused layout is per head [q k v]; vLLM's (and the whole) is [Q | K | V]
            t = captured[(what, "output")]
            h = self.cfg.num_attention_heads
            t = t.view(*t.shape[:-1], h, 3, -1)
            return torch.cat([t[..., j, :].flatten(-2) for j in range(3)], -1)
        if kind == "gemma_embed":
            t = captured[(what, "output")]
            return t / torch.tensor(self.cfg.hidden_size ** 0.5, dtype=t.dtype, device=t.device)
        return captured[(what, kind)]


def capture(model, modules, run):
    """Runs `run()` with hooks capturing (module, "input"/"output") of every named module (first tensor,
    the batch dim dropped, a clone: rotary edits q and k in place later)."""
    captured, handles = {}, []
    named = dict(model.named_modules())

    def first(x):
        x = x[0] if isinstance(x, tuple) else x
        return x[0] if x.dim() == 3 else x  # [1, S, W] -> [S, W]; MoE blocks call experts on [S, W] already
    for name in modules:
        mod = named[name]
        handles.append(mod.register_forward_pre_hook(
            lambda m, args, name=name: captured.__setitem__((name, "input"), first(args[0]).detach().clone())))
        handles.append(mod.register_forward_hook(
            lambda m, args, out, name=name: captured.__setitem__((name, "output"), first(out).detach().clone())))
    try:
        result = run()
    finally:
        for h in handles:
            h.remove()
    return captured, result


BF16_UNIT_ROUNDOFF = 2.0 ** -8


def rounding_envelope(model, modules, run, seeds: int = 8, u: float = BF16_UNIT_ROUNDOFF):
    """How far from the float32 model a bfloat16 implementation of it can be, measured on the float32 model
    itself: each of `seeds` runs multiplies every leaf module's output, every decoder layer's output (the
    residual stream) and the inputs of o_proj and down_proj (attention's and the MLP's products, which are
    not modules) by (1 + d), d uniform in [-u, u] elementwise, independently: one bfloat16 rounding at each
    place an implementation rounds. The model's own amplification over depth is in the result, whatever the
    depth. Returns [(captured, run's result)] per seed, as `capture` does."""
    out = []
    for seed in range(seeds):
        g = torch.Generator(device="cpu").manual_seed(seed)

        def noise(x):
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                return x
            d = (torch.rand(x.shape, generator=g) * 2 - 1).to(device=x.device, dtype=x.dtype)
            return x * (1 + d * u)

        def post(module, args, output):
            return (noise(output[0]),) + tuple(output[1:]) if isinstance(output, tuple) else noise(output)
        handles = []
        for name, m in model.named_modules():
            leaf = name and next(m.children(), None) is None and not name.endswith("rotary_emb")
            if leaf or type(m).__name__.endswith("DecoderLayer"):
                handles.append(m.register_forward_hook(post))
            if name.endswith(("o_proj", "down_proj")):
                handles.append(m.register_forward_pre_hook(lambda mod, args: (noise(args[0]),) + tuple(args[1:])))
        try:
            out.append(capture(model, modules, run))
        finally:
            for h in handles:
                h.remove()
    return out


def write_tokenizer(folder: str, vocab_size: int) -> None:
    """A word-level tokenizer over tokens "t0".."t{vocab-1}" (nnsight's VLLM loads one; prompts are token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", unk_token="t0").save_pretrained(folder)


class Edit:
    """The edit vllm_check.py and compiled_check.py make on prompt B, and its ground truth in transformers:
    layer 0's last v head scaled by 0.5 (through "segment"/"heads"; with fewer kv heads than ranks that head
    is replicated, and the edit must reach every copy) and `steer` added to layer 1's down projection input
    at every step (Qwen2-MoE: the shared expert's), saving layer 1's q|k|v at the prefill and the logits at
    every step."""

    def __init__(self, family: str, cfg, g):
        self.family, self.cfg = family, cfg
        self.reader = Reader(family, cfg)
        lp = self.reader.layer_prefix
        if family == "gpt_neox":
            self.qkv0, self.qkv1 = f"{lp(0)}.attention.query_key_value", f"{lp(1)}.attention.query_key_value"
            self.down1 = f"{lp(1)}.mlp.dense_4h_to_h"
        else:
            self.qkv0, self.qkv1 = f"{lp(0)}.self_attn.qkv_proj", f"{lp(1)}.self_attn.qkv_proj"
            self.down1 = f"{lp(1)}.mlp.shared_expert.down_proj" if family == "qwen2_moe" else f"{lp(1)}.mlp.down_proj"
        steer = (torch.randn(cfg.intermediate_size, generator=g) * 0.5).float()
        self.steer = steer[:cfg.shared_expert_intermediate_size].contiguous() if family == "qwen2_moe" else steer
        self.vhead = (cfg.num_attention_heads if family == "gpt_neox" else cfg.num_key_value_heads) - 1

    def write(self, folder: str) -> str:
        """Writes the steering vector (folder/steer.safetensors:v) for the plan; returns the folder."""
        import os
        from safetensors.torch import save_file
        save_file({"v": self.steer}, os.path.join(folder, "steer.safetensors"))
        return folder

    def plan(self) -> list:
        head = {"segment": "v", "heads": [self.vhead]}
        if self.reader.hf_tree:  # no "heads" view of transformers' per-head [q k v]: head vhead's v by its columns
            hs = self.cfg.hidden_size // self.cfg.num_attention_heads
            head = {"index": f"...,{(3 * self.vhead + 2) * hs}:{(3 * self.vhead + 3) * hs}"}
        return [{"at": f"{self.qkv0}.output", "do": "scale", "by": 0.5, **head},
                {"at": f"{self.down1}.input", "do": "add", "value": "steer.safetensors:v"},
                {"at": f"{self.qkv1}.output", "do": "save", "as": "qkv1", "step": 0},
                {"at": "logits_processor.output", "do": "save", "as": "final_logits"}]

    def transformers(self, hf, prompt, max_tokens: int):
        """transformers under the same edits (forward hooks): its greedy tokens after `prompt`, layer 1's whole
        q|k|v over the prompt's rows and the logits at every step (one forward over the prompt plus the
        tokens). Returns (tokens, qkv1, logits)."""
        cfg, named = self.cfg, dict(hf.named_modules())
        hs = cfg.hidden_size // cfg.num_attention_heads
        vhead = self.vhead

        def scale_v(m, a, out):
            out = out.clone()
            if self.family == "gpt_neox":  # HF's fused layout is per head [q k v]
                out = out.view(*out.shape[:-1], cfg.num_attention_heads, 3, hs)
                out[..., vhead, 2, :] *= 0.5
                return out.flatten(-3)
            out[..., vhead * hs:(vhead + 1) * hs] *= 0.5
            return out
        neox, h = self.family == "gpt_neox", self.reader.hf
        h1 = named[h(self.qkv0) if neox else self.qkv0.replace("qkv_proj", "v_proj")].register_forward_hook(scale_v)
        h2 = named[h(self.down1)].register_forward_pre_hook(
            lambda m, a: (a[0] + self.steer.to(a[0].device, a[0].dtype),))
        q1 = [h(self.qkv1)] if neox else [self.qkv1.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
        try:
            with torch.no_grad():
                gen = hf.generate(ids(hf, prompt), max_new_tokens=max_tokens, do_sample=False,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=hf.device))
                cap, logits = capture(hf, q1, lambda: hf(gen[:, :-1]).logits[0])
        finally:
            h1.remove()
            h2.remove()
        spec = (("output" if self.reader.hf_tree else "neox_qkv", h(self.qkv1)) if neox else ("cat", q1))
        qkv1 = self.reader.read(spec, cap)[:len(prompt)]
        return gen[0, len(prompt):].tolist(), qkv1, logits[len(prompt) - 1:]
