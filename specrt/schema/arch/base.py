"""What a model family is to specrt: the facts of its block, read from its config.json, and the
names of its weights.

A family is one `Architecture` (schema/arch/<family>.py) registered in schema/arch/__init__.py. The
block every family shares (export/llama.py, the graph writers) reads only ModelConfig's facts:

    qk_norm          an RMSNorm over each head's query and key before the rotary (Qwen3, Gemma 3)
    norm_offset      norms scale by (offset + weight): 1.0 for Gemma's (1 + w) norms, else 0.0
    sandwich_norms   a norm after attention and one after the MLP besides the two before (Gemma)
    hidden_act       the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale      the embedding multiplied by this (Gemma: sqrt(hidden)); None: not scaled
    attn_scale       the attention scores' scale; None: head_dim ** -0.5
    sliding_window   keys a sliding layer sees: position q sees keys at q - window < k <= q
    sliding_layers   the layers with the window (the rest see the whole past)
    rope_local_theta the sliding layers' rotary base where it differs from the global layers'
    rotary_dim       the leading dims of a head the rotary turns (Phi-3's partial rotary)

A family's file says how its config.json gives these (`facts`), what transformers needs back
(`config_keys`), and how its weights' names map onto the shared block's (`weights`); where a
GGUF of the family converts, how its metadata, tensor names and stored values differ (`Gguf`),
and the chat template and end-of-turn token a file without them needs. Nothing else in the
exporters names a family.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from specrt.errors import CheckpointError

MISSING = dataclasses.MISSING


def _none(_) -> dict:
    return {}


def _same(state: dict) -> dict:
    return state


@dataclasses.dataclass(frozen=True)
class Gguf:
    """How a GGUF file of the family reads (export/gguf.py reads the shared part)."""

    arch: str  # general.architecture
    # GGUF tensor role -> the shared block's name, beyond the common ones (export/gguf.py)
    names: dict = dataclasses.field(default_factory=dict)
    # read(key, default) of the `<arch>.` metadata -> config.json keys beyond the common ones
    config: Callable[[Callable], dict] = _none
    # (transformers name, float32 array) -> the array as transformers stores it
    weight: Callable[[str, Any], Any] = lambda name, a: a
    permuted_qk: bool = False  # llama.cpp permutes q/k rows for its interleaved rotary


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One model family: its config.json name and how to read it."""

    architecture: str  # config.json's architectures[0]
    model_type: str  # transformers' model_type for the same model
    # config.json -> ModelConfig fields beyond the common ones (or overriding them)
    facts: Callable[[dict], dict] = _none
    # ModelConfig -> the config.json keys transformers needs beyond the common ones
    config_keys: Callable[[Any], dict] = _none
    # the checkpoint's state dict ('model.' prefixes removed) -> the shared block's names
    weights: Callable[[dict], dict] = _same
    attention_bias: bool = False  # q/k/v carry a bias where config.json does not say
    hidden_act: str = "silu"  # the config key's default
    gguf: Gguf | None = None  # where a GGUF of the family converts
    # a file without a chat template gets this one; these tokens also end a turn (besides EOS)
    chat_template: str | None = None
    end_of_turn: tuple[str, ...] = ()


def as_number(kind: type, value: Any, name: str):
    """value as int or float, or a CheckpointError naming the field (True, "two", 3.5 as int...)."""
    ok = not isinstance(value, bool) and (
        isinstance(value, (int, float))
        if kind is float
        else isinstance(value, int) or isinstance(value, float) and value.is_integer()
    )
    if not ok:
        what = "an integer" if kind is int else "a number"
        raise CheckpointError(f"{name} must be {what}, got {json.dumps(value)[:40]}; fix the checkpoint's config.json.")
    return kind(value)


def field(d: dict[str, Any], name: str, kind: type, default: Any = MISSING):
    """config.json's `name` as `kind`, `default` where it is absent or null."""
    if name not in d or d[name] is None:
        if default is MISSING:
            raise CheckpointError(
                f"lacks the required key {name!r}; restore it from the original checkpoint's config.json."
            )
        return default
    return as_number(kind, d[name], name)


def layer_list(d: dict[str, Any], sliding: str = "sliding_attention") -> tuple[int, ...] | None:
    """The indices of config.json's `layer_types` that are `sliding`; None without the key."""
    types = d.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise CheckpointError("layer_types must be a list of strings; fix the checkpoint's config.json.")
    return tuple(i for i, t in enumerate(types) if t == sliding)
