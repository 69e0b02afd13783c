"""Phi-3 and Phi-4-mini: the Llama block with q|k|v in one weight (qkv_proj) and gate|up in one
(gate_up_proj), a rotary over the leading `partial_rotary_factor` of each head (Phi-4-mini:
0.75) and, on Phi-3-mini-4k, a window on every layer. Refused: the longrope rotary (Phi-3-128k,
Phi-4-mini's long contexts), whose frequencies change with the sequence's length; GGUF files
(their fused blocks are not split yet: convert from the transformers checkpoint)."""

from __future__ import annotations

from specrt.errors import CheckpointError
from specrt.schema.arch.base import Architecture, as_number, field
from specrt.schema.arch.llama import _window_everywhere


def _facts(d: dict) -> dict:
    rope = d.get("rope_parameters") or {}
    factor = as_number(
        float, d.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)), "partial_rotary_factor"
    )
    heads, hidden = field(d, "num_attention_heads", int), field(d, "hidden_size", int)
    head_dim = field(d, "head_dim", int, hidden // heads)
    rotary = int(head_dim * factor)
    if not 0 < rotary <= head_dim or rotary % 2:
        raise CheckpointError(
            f"partial_rotary_factor={factor} turns {rotary} of {head_dim} dims; it must be an even count in "
            "1..head_dim: fix the checkpoint's config.json."
        )
    return _window_everywhere(d) | ({"rotary_dim": rotary} if rotary != head_dim else {})


def _keys(cfg) -> dict:
    return {"sliding_window": cfg.sliding_window, "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim}


def _weights(state: dict) -> dict:
    """qkv_proj and gate_up_proj split into the shared block's q/k/v and gate/up weights."""
    out = {}
    for name, w in state.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            p = name.removesuffix("qkv_proj.weight")
            out[p + "q_proj.weight"], out[p + "k_proj.weight"], out[p + "v_proj.weight"] = _thirds(state, name, w)
        elif name.endswith("mlp.gate_up_proj.weight"):
            p = name.removesuffix("gate_up_proj.weight")
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = w.chunk(2, dim=0)
        else:
            out[name] = w
    return out


def _thirds(state: dict, name: str, w):
    """q, k, v rows of a fused weight: q has as many rows as the o_proj has columns, k and v
    split the rest evenly."""
    q_rows = state[name.replace("qkv_proj", "o_proj")].shape[1]
    kv = (w.shape[0] - q_rows) // 2
    return w[:q_rows], w[q_rows : q_rows + kv], w[q_rows + kv :]


PHI3 = Architecture("Phi3ForCausalLM", "phi3", facts=_facts, config_keys=_keys, weights=_weights)
