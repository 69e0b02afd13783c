"""A compact decoder written as one *step*: the function the step graph exports.

One block serves every supported family (schema/arch/): the Llama block, and the facts a
family's config sets (qk_norm, norm_offset, sandwich_norms, hidden_act, embed_scale,
attn_scalar, a sliding window on some layers with their own rotary base, a partial rotary).

One call takes Q new tokens per sequence, the past KV of P positions and a mask over the P + Q
keys, and returns logits, the hidden states draft heads read, and the KV of the Q new positions.
Q = 1 is decode, Q = N + 1 (or a tree size) is verification, large Q is prefill. The mask is
boolean [B, Q, P + Q] (True = may attend), so a tree, a ragged batch and unused cache slots are
all expressed by the caller; the model itself assumes nothing about causality.

Shapes: B batch, Q new positions, P past positions, H heads, Hkv KV heads, D head dim, C hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specrt.errors import SpecrtError
from specrt.schema.config import ModelConfig, rope_inv_freq


def as_dtype(x, dtype):
    """x in `dtype`; the tracer records even a no-op `.to`, so a float32 export skips the call
    (its graph stays free of Cast nodes that do nothing)."""
    return x if x.dtype == dtype else x.to(dtype)


class RMSNorm(nn.Module):
    """x / rms(x) scaled by (offset + weight): offset 0 for most families, 1 for Gemma's norms
    (whose weights are stored as the scale minus one)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def scale(self):
        return self.weight + self.offset if self.offset else self.weight

    def forward(self, x):
        # the statistics in float32 whatever the model's dtype: a residual channel of this model
        # family reaches ~25,000, whose square overflows float16 (a no-op in a float32 model)
        h = as_dtype(x, torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        return self.scale() * as_dtype(h * torch.rsqrt(var + self.eps), x.dtype)


def inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """The rotary embedding's inverse frequencies (computed in float64, kept in float32);
    `local`: the sliding layers'."""
    return torch.tensor(rope_inv_freq(cfg, local), dtype=torch.float64).to(torch.float32)


def rotary(position_ids, inv_freq):
    """(cos, sin), each (B, 1, Q, D), for positions (B, Q)."""
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq  # (B, Q, D/2)
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # (B, 1, Q, D)
    return emb.cos(), emb.sin()


def mask_bias(attention_mask, dtype):
    """(B, 1, Q, P+Q) additive bias of a boolean mask (B, Q, P+Q): 0 where attention is allowed,
    the most negative float elsewhere (float32's in a float64 model, which the float32 `where`
    could not hold: a reference computation; no export runs in float64)."""
    low = max(torch.finfo(dtype).min, torch.finfo(torch.float32).min)
    return as_dtype(torch.where(attention_mask, 0.0, low), dtype).unsqueeze(1)


def window_bias(attention_mask, position_ids, slots, window: int, dtype):
    """The sliding layers' mask bias: `attention_mask` (B, Q, K) and each key no further than
    `window` - 1 positions behind the query. A key's position is its slot's for the past (a
    row's committed positions sit at slots 0, 1, ...) and `position_ids`' for the new ones (a
    tree's nodes sit at slots past their positions)."""
    B, Q, K = attention_mask.shape
    if slots is None:  # past slots, then the Q new positions
        past = torch.arange(K - Q, device=position_ids.device).expand(B, K - Q)
        keys = torch.cat([past, position_ids], dim=1)
    else:
        keys = torch.arange(K, device=position_ids.device).expand(B, K).scatter(1, slots, position_ids)
    near = (position_ids.unsqueeze(-1) - keys.unsqueeze(1)) < window
    return mask_bias(attention_mask & near, dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x, cos, sin):
    """The rotary on x's leading cos.shape[-1] dims (all of them but for a partial rotary)."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned, kept = x[..., :d], x[..., d:]
    return torch.cat([turned * cos + rotate_half(turned) * sin, kept], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.scale = cfg.scale
        if cfg.qk_norm:  # over each head's D dims, before the rotary
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)

    def forward(self, x, cos, sin, mask_bias, past_k, past_v, slots=None):
        B, Q, _ = x.shape
        D, Hkv, G = self.head_dim, self.n_kv, self.n_heads // self.n_kv
        q = self.q_proj(x).view(B, Q, Hkv * G, D)
        k = self.k_proj(x).view(B, Q, Hkv, D)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, Q, D), (B, Hkv, Q, D)
        v = self.v_proj(x).view(B, Q, Hkv, D).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # cos/sin: (B, 1, Q, rotary dims)
        if slots is None:
            keys = torch.cat([past_k, k], dim=2)  # (B, Hkv, P+Q, D)
            values = torch.cat([past_v, v], dim=2)
        else:  # in place (LlamaModel.forward): the cache's buffers get the new positions first
            at = slots[:, None, :, None].expand(B, Hkv, Q, D)
            past_k.scatter_(2, at, as_dtype(k, past_k.dtype))
            past_v.scatter_(2, at, as_dtype(v, past_v.dtype))
            keys, values = as_dtype(past_k, k.dtype), as_dtype(past_v, v.dtype)  # (B, Hkv, C, D)
        # grouped-query attention without repeating K/V: fold the G query heads of a KV head
        # into the query axis, so one batched matmul per KV head reads each key once.
        qg = q.reshape(B, Hkv, G * Q, D)  # heads are laid out kv-major: head h = kv * G + g
        scores = torch.matmul(qg, keys.transpose(2, 3)) * self.scale  # (B, Hkv, G*Q, P+Q)
        scores = scores.view(B, Hkv, G, Q, -1) + mask_bias.unsqueeze(1)  # mask_bias: (B, 1, Q, P+Q)
        probs = torch.softmax(scores, dim=-1).view(B, Hkv, G * Q, -1)
        out = torch.matmul(probs, values).view(B, Hkv * G, Q, D)  # (B, H, Q, D)
        out = out.transpose(1, 2).reshape(B, Q, Hkv * G * D)
        return self.o_proj(out), k, v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, x):
        gate = self.gate_proj(x)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Norm, attention, (norm), residual; norm, MLP, (norm), residual. With sandwich norms
    (Gemma) post_attention_layernorm normalizes the attention's output and the MLP has its own
    norms before and after; otherwise post_attention_layernorm is the MLP's input norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        self.input_layernorm = RMSNorm(C, eps, off)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(C, eps, off)
        self.mlp = MLP(cfg)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(C, eps, off)
            self.post_feedforward_layernorm = RMSNorm(C, eps, off)

    def forward(self, x, cos, sin, mask_bias, past_k, past_v, slots=None):
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask_bias, past_k, past_v, slots)
        if not self.sandwich:
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x)), k, v
        x = x + self.post_attention_layernorm(a)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, k, v


class LlamaModel(nn.Module):
    """Parameter names follow transformers' LlamaForCausalLM (and Gemma3ForCausalLM's, Qwen3's
    for their extra norms), so their state dicts load as they are (Phi-3's fused weights split
    first: schema/arch/phi3.py)."""

    def __init__(self, cfg: ModelConfig, hidden_layers: tuple[int, ...] = (-1,)):
        super().__init__()
        self.cfg = cfg
        # which features the `hidden_states` output carries, concatenated on the last axis:
        # -1 is the final normed state (EAGLE-1, Medusa); layer indices i give the output of
        # decoder layer i (EAGLE-3 reads a low, a middle and a high layer).
        self.hidden_layers = tuple(hidden_layers)
        wrong = [i for i in self.hidden_layers if not (i == -1 or 0 <= i < cfg.num_hidden_layers)]
        if wrong or not self.hidden_layers:
            raise SpecrtError(
                f"hidden layers {list(self.hidden_layers)}: this model has layers 0 to {cfg.num_hidden_layers - 1} "
                "(and -1, the final normed state); give indices in that range"
            )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.output_vocab or cfg.vocab_size, bias=False)
        if cfg.output_vocab is not None:
            # a draft model's reduced output head: its rows' token ids; logits stay vocabulary-wide
            self.register_buffer("output_ids", torch.zeros(cfg.output_vocab, dtype=torch.int64))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq(cfg), persistent=False)
        if cfg.rope_local_theta:  # the sliding layers' own rotary base
            self.register_buffer("local_inv_freq", inv_freq(cfg, local=True), persistent=False)
        if cfg.embed_scale is not None:  # float32, then the model's dtype (as transformers rounds it)
            self.register_buffer("embed_scale", torch.tensor(cfg.embed_scale, dtype=torch.float32), persistent=False)

    def forward(self, input_ids, position_ids, attention_mask, past_key_values, logits_index=None, slots=None):
        """input_ids, position_ids: (B, Q) int64; attention_mask: (B, Q, P+Q) bool;
        past_key_values: list of (key, value), each (B, Hkv, P, D); logits_index: (B, K) int64,
        the positions (0..Q-1) whose logits are wanted (None: all Q; prefill asks for the last
        only, which saves the vocabulary projection of every other prompt position).
        Returns logits (B, K, V), hidden_states (B, Q, C * len(hidden_layers)) and
        present: list of (key, value), each (B, Hkv, Q, D) for the Q new positions only.
        Whatever the model's dtype (to_dtype), past KV comes in and every output goes out in
        float32: the runtime's one contract (casts a float32 model does not trace at all).

        In place (slots (B, Q) int64, the PyTorch backend): the past is the cache's whole buffers
        (B, Hkv, C, D), each layer writes the new keys and values into them at `slots` and
        attends over the C slots alone, attention_mask (B, Q, C) (step_io.in_place); present is
        empty. A key then sits at one slot and every reduction runs over C slots whatever the
        step's shape, so a position's logits do not depend on how many positions its step has."""
        dtype = self.embed_tokens.weight.dtype
        if slots is None:
            past_key_values = [(as_dtype(k, dtype), as_dtype(v, dtype)) for k, v in past_key_values]
        x = self.embed_tokens(input_ids)
        cfg = self.cfg
        if cfg.embed_scale is not None:
            x = x * as_dtype(self.embed_scale, x.dtype)
        # angles in float32 (positions past 2,048 lose their phase in 16 bits), then the model's dtype
        cos, sin = (as_dtype(t, x.dtype) for t in rotary(position_ids, self.inv_freq))
        bias = mask_bias(attention_mask, x.dtype)
        local = (cos, sin, bias)  # the sliding layers': their window, their rotary base
        if cfg.sliding_layers:
            local_bias = window_bias(attention_mask, position_ids, slots, cfg.sliding_window, x.dtype)
            if cfg.rope_local_theta:
                cos_l, sin_l = (as_dtype(t, x.dtype) for t in rotary(position_ids, self.local_inv_freq))
                local = (cos_l, sin_l, local_bias)
            else:
                local = (cos, sin, local_bias)
        present, taps = [], {}
        for i, layer in enumerate(self.layers):
            past_k, past_v = past_key_values[i]
            c, s, b = local if cfg.is_sliding(i) else (cos, sin, bias)
            x, k, v = layer(x, c, s, b, past_k, past_v, slots)
            if slots is None:
                present.append((k, v))
            taps[i] = x
        normed = self.norm(x)
        taps[-1] = normed
        hidden = (
            torch.cat([taps[i] for i in self.hidden_layers], dim=-1)
            if len(self.hidden_layers) > 1
            else taps[self.hidden_layers[0]]
        )
        if logits_index is not None:
            B, K = logits_index.shape
            normed = torch.gather(normed, 1, logits_index.unsqueeze(-1).expand(B, K, normed.shape[-1]))  # (B, K, C)
        logits = self.lm_head(normed)
        if self.cfg.output_vocab is not None:
            # the reduced head's logits scattered into the vocabulary; the other tokens get the
            # most negative float (probability 0), so the runtime reads logits as from any model
            full = torch.full(
                (*logits.shape[:-1], self.cfg.vocab_size),
                torch.finfo(logits.dtype).min,
                dtype=logits.dtype,
                device=logits.device,
            )
            index = self.output_ids.expand(*logits.shape[:-1], self.cfg.output_vocab)
            logits = full.scatter(-1, index, logits)
        f32 = torch.float32
        present = [(as_dtype(k, f32), as_dtype(v, f32)) for k, v in present]
        return as_dtype(logits, f32), as_dtype(hidden, f32), present

    def to_dtype(self, dtype: torch.dtype) -> "LlamaModel":
        """Weights and compute in `dtype`; the rotary frequencies stay float32 (their products
        with positions in the thousands need the mantissa)."""
        self.to(dtype)
        self.inv_freq = inv_freq(self.cfg)
        if self.cfg.rope_local_theta:
            self.local_inv_freq = inv_freq(self.cfg, local=True)
        return self

    def empty_past(self, batch: int, dtype=torch.float32):
        cfg = self.cfg
        shape = (batch, cfg.num_key_value_heads, 0, cfg.head_dim)
        return [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_hidden_layers)
        ]


def causal_mask(batch: int, q: int, past: int) -> torch.Tensor:
    """(B, Q, P+Q) bool: every new position sees the whole past and the new positions up to itself."""
    new = torch.tril(torch.ones(q, q, dtype=torch.bool))
    full = torch.cat([torch.ones(q, past, dtype=torch.bool), new], dim=1)
    return full.unsqueeze(0).expand(batch, q, past + q).contiguous()
