"""Qwen3 (dense): the Llama block with an RMSNorm over each head's query and key before the
rotary, and no q/k/v bias."""

from __future__ import annotations

from specrt.schema.arch.base import Architecture, Gguf
from specrt.schema.arch.llama import _no_window


def _facts(d: dict) -> dict:
    return _no_window("Qwen3")(d) | {"qk_norm": True}


QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
QWEN3 = Architecture("Qwen3ForCausalLM", "qwen3", facts=_facts, gguf=Gguf("qwen3", names=QK_NORMS))
