"""Independent peers for bench/peer_benchmark.py (issue 31, item 3): models nobody here wrote the
numerics of, built on the weights of a tp-1 rank file of the kit's Llama (fragkit), so their logits
can be compared with the kit model's and their times with fragments'.

``PlainLlama`` is the model a PyTorch user writes by hand: ``torch.nn.Linear`` (q/k/v fused into one, gate
and up fused into one, as the rank file stores them), an RMSNorm computed in float32 as Hugging Face's,
rotary embedding (rotate halves, cos/sin in the model dtype), ``F.scaled_dot_product_attention`` (causal,
grouped-query heads through ``enable_gqa``) and SiLU·mul; the embedding and the LM head are included
(the unpadded vocabulary rows), so its logits have the same scope as the kit model's.

With a static KV cache (``new_static_cache``, the kit's layout [layers, 2, batch, kv heads, max_len, head
dim]; ``decode``): each step writes its k/v at each row's position (``index_put_``) and attends over the whole
cache through ``F.scaled_dot_product_attention`` with a boolean mask of the slots at or before the row's
position: fixed shapes, so a decode step can be captured in a ``torch.cuda.CUDAGraph`` as transformers'
StaticCache is.

``hf_llama`` builds transformers' ``LlamaForCausalLM`` from a ``LlamaConfig`` of the same shape and copies
the same weights in (q/k/v and gate/up split into Hugging Face's separate projections).
"""
import torch
import torch.nn.functional as F
from torch import nn


class PlainRMSNorm(nn.Module):
    def __init__(self, hidden, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PlainLayer(nn.Module):
    def __init__(self, hidden, intermediate, heads, kv_heads, head_dim, eps):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_layernorm = PlainRMSNorm(hidden, eps)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, hidden, bias=False)
        self.post_attention_layernorm = PlainRMSNorm(hidden, eps)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x, cos, sin, cache=None, positions=None, mask=None):
        """cache: this layer's [2, batch, kv heads, max_len, head dim] (written at `positions` [B, t]);
        mask: [B, 1, t, max_len], True where a query may attend."""
        b, t, _ = x.shape
        q, k, v = self.qkv(self.input_layernorm(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        gqa = self.heads != self.kv_heads
        if cache is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=gqa)
        else:
            rows = torch.arange(b, device=x.device).unsqueeze(1).expand(b, t)
            cache[0].transpose(1, 2).index_put_((rows, positions), k.transpose(1, 2))
            cache[1].transpose(1, 2).index_put_((rows, positions), v.transpose(1, 2))
            a = F.scaled_dot_product_attention(q, cache[0], cache[1], attn_mask=mask, enable_gqa=gqa)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.gate_up(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class PlainLlama(nn.Module):
    def __init__(self, vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, eps=1e-6,
                 rope_theta=10000.0, max_positions=512):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(PlainLayer(hidden, intermediate, heads, kv_heads, head_dim, eps)
                                    for _ in range(layers))
        self.norm = PlainRMSNorm(hidden, eps)
        self.head = nn.Linear(hidden, vocab, bias=False)
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, ids):
        t = ids.shape[-1]
        x = self.embed(ids)
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))

    def new_static_cache(self, batch, max_len):
        """A zeroed cache [layers, 2, batch, kv heads, max_len, head dim] on the model's device and dtype."""
        layer, weight = self.layers[0], self.head.weight
        return torch.zeros(len(self.layers), 2, batch, layer.kv_heads, max_len, layer.head_dim, dtype=weight.dtype,
                           device=weight.device)

    def decode(self, ids, positions, cache):
        """Logits [B, t, vocab] of `ids` [B, t] at `positions` [B, t] (each row its own), their k/v written into
        `cache` (new_static_cache) and attended over all of its slots up to each query's position."""
        x = self.embed(ids)
        cos, sin = self.cos[positions].to(x.dtype).unsqueeze(1), self.sin[positions].to(x.dtype).unsqueeze(1)
        slots = torch.arange(cache.size(4), device=ids.device)
        mask = (slots.view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)  # [B, 1, t, max_len]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache[i], positions, mask)
        return self.head(self.norm(x))

    @torch.no_grad()
    def load_kit(self, sd, vocab):
        """Copies a tp-1 kit rank file's state dict in (the vocabulary padding rows dropped)."""
        self.embed.weight.copy_(sd["model.embed_tokens.weight"][:vocab])
        self.head.weight.copy_(sd["lm_head.weight"][:vocab])
        self.norm.weight.copy_(sd["model.norm.weight"])
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_layernorm.weight.copy_(sd[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(sd[p + "post_attention_layernorm.weight"])
            layer.qkv.weight.copy_(sd[p + "self_attn.qkv_proj.weight"])
            layer.o.weight.copy_(sd[p + "self_attn.o_proj.weight"])
            layer.gate_up.weight.copy_(sd[p + "mlp.gate_up_proj.weight"])
            layer.down.weight.copy_(sd[p + "mlp.down_proj.weight"])
        return self


def hf_llama(sd, vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, eps, rope_theta, max_positions,
             dtype, device):
    """transformers' LlamaForCausalLM of the same shape with the kit rank file's weights (tp 1), eval, sdpa."""
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=eps,
        max_position_embeddings=max_positions, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(dtype=dtype).eval()
    q, kv = heads * head_dim, kv_heads * head_dim
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(sd["model.embed_tokens.weight"][:vocab])
        model.lm_head.weight.copy_(sd["lm_head.weight"][:vocab])
        model.model.norm.weight.copy_(sd["model.norm.weight"])
        for i, layer in enumerate(model.model.layers):
            p = f"model.layers.{i}."
            layer.input_layernorm.weight.copy_(sd[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(sd[p + "post_attention_layernorm.weight"])
            qkv = sd[p + "self_attn.qkv_proj.weight"]
            layer.self_attn.q_proj.weight.copy_(qkv[:q])
            layer.self_attn.k_proj.weight.copy_(qkv[q:q + kv])
            layer.self_attn.v_proj.weight.copy_(qkv[q + kv:])
            layer.self_attn.o_proj.weight.copy_(sd[p + "self_attn.o_proj.weight"])
            gate_up = sd[p + "mlp.gate_up_proj.weight"]
            layer.mlp.gate_proj.weight.copy_(gate_up[:intermediate])
            layer.mlp.up_proj.weight.copy_(gate_up[intermediate:])
            layer.mlp.down_proj.weight.copy_(sd[p + "mlp.down_proj.weight"])
    return model
