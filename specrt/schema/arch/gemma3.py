"""Gemma 3 (text: Gemma3ForCausalLM, the 270M and 1B checkpoints). The shared block with:
the embedding scaled by sqrt(hidden); norms that scale by (1 + weight), four per layer (before
and after attention, before and after the MLP); GeGLU with the tanh-approximated gelu; an
RMSNorm over each head's query and key; scores scaled by query_pre_attn_scalar ** -0.5; five of
every six layers slide a window (512 on the 270M) with their own rotary base (10,000 beside
the global layers' 1,000,000). Refused: logit soft-capping (Gemma 2's) and bidirectional
attention, which no Gemma 3 text checkpoint sets."""

from __future__ import annotations

from specrt.errors import UnsupportedArchitectureError
from specrt.schema.arch.base import Architecture, Gguf, field, layer_list

ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}


def _facts(d: dict) -> dict:
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise UnsupportedArchitectureError(
            f"Gemma 3 with hidden_activation={act!r} is not supported (supported: {', '.join(ACTIVATIONS)})."
        )
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
        if d.get(key):
            raise UnsupportedArchitectureError(
                f"Gemma 3 with {key}={d[key]!r} is not supported; no Gemma 3 text checkpoint sets it."
            )
    layers = field(d, "num_hidden_layers", int)
    sliding = layer_list(d)
    if sliding is None:  # configs before layer_types: every `pattern`-th layer is global
        pattern = field(d, "sliding_window_pattern", int, 6)
        sliding = tuple(i for i in range(layers) if (i + 1) % pattern)
    rope = d.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise UnsupportedArchitectureError(
            f"Gemma 3's sliding layers with rope_type {local['rope_type']!r} are not supported (only the default)."
        )
    theta = field(full, "rope_theta", float, None) or field(d, "rope_theta", float, 1_000_000.0)
    scaling = {k: v for k, v in full.items() if k != "rope_theta"} or d.get("rope_scaling") or None
    return {
        "qk_norm": True,
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "hidden_act": ACTIVATIONS[act],
        "embed_scale": field(d, "hidden_size", int) ** 0.5,
        "attn_scalar": field(d, "query_pre_attn_scalar", float, 256.0),
        "sliding_window": field(d, "sliding_window", int, 4096),
        "sliding_layers": sliding,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_local_theta": field(local, "rope_theta", float, None)
        or field(d, "rope_local_base_freq", float, 10_000.0),
        "tie_word_embeddings": bool(d.get("tie_word_embeddings", True)),
    }


def _keys(cfg) -> dict:
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta} | (cfg.rope_scaling or {})
    types = ["sliding_attention" if i in cfg.sliding_layers else "full_attention" for i in range(cfg.num_hidden_layers)]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": int(cfg.attn_scalar) if float(cfg.attn_scalar).is_integer() else cfg.attn_scalar,
        "sliding_window": cfg.sliding_window,
        "layer_types": types,
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta},
        },
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def _gguf_config(read) -> dict:
    """What llama.cpp's Gemma 3 metadata leaves out, as llama.cpp itself assumes it: every sixth
    layer global, the sliding layers' rotary base 10,000, scores scaled by key_length ** -0.5."""
    return {
        "sliding_window": int(read("attention.sliding_window", 512)),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": int(read("attention.key_length", 256)),
        "tie_word_embeddings": True,
    }


def _gguf_weight(name: str, a):
    """llama.cpp stores Gemma's norms as their scale (1 + w); transformers stores w."""
    return a - 1.0 if name.endswith("norm.weight") else a


GGUF_NAMES = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma's own turn format; a system message opens the first user turn (Gemma has no system role)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\\n\\n' %}{% else %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' }}"
    "{% if m['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ m['content'] | trim }}{{ '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

GEMMA3 = Architecture(
    "Gemma3ForCausalLM",
    "gemma3_text",
    facts=_facts,
    config_keys=_keys,
    gguf=Gguf("gemma3", names=GGUF_NAMES, config=_gguf_config, weight=_gguf_weight),
    chat_template=CHAT_TEMPLATE,
    end_of_turn=("<end_of_turn>",),
)
