"""Model configuration: the few numbers a decoder needs, read from config.json.

Every supported family shares one block (RMSNorm, rotary embeddings, grouped-query attention,
a gated MLP); what differs between families is a handful of facts (schema/arch/base.py lists
them), each family's in its own file under schema/arch/: Llama and SmolLM, Mistral, Qwen2,
Qwen3, Phi-3 / Phi-4-mini and Gemma 3 (text).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from specrt.artifacts import read_json_object
from specrt.errors import ArtifactError, CheckpointError, SpecrtError, UnsupportedArchitectureError
from specrt.schema.arch import FAMILIES
from specrt.schema.arch.base import as_number as _as
from specrt.schema.arch.base import field as _field

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)  # config.json's architecture names
ACTIVATIONS = ("silu", "gelu_tanh")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
OUTPUT_VOCAB_KEY = "specrt_output_vocab"  # config.json key of ModelConfig.output_vocab


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", "factor": ..., ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2); o_proj never has one here
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    # a draft model's reduced output vocabulary (train-draft --method draft-model): the output head
    # has this many rows, for the token ids in its `output_ids` buffer; None: the whole vocabulary
    output_vocab: int | None = None
    # the block's facts (schema/arch/base.py explains each; the defaults are the Llama block)
    qk_norm: bool = False
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    embed_scale: float | None = None
    attn_scalar: float | None = None  # scores scaled by attn_scalar ** -0.5; None: head_dim
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    rotary_dim: int | None = None  # None: the whole head

    def __post_init__(self):
        # every reader of a config (config.json, an artifact's manifest) gets here: one place
        # that refuses sizes a model cannot have, with the field's name
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CheckpointError(
                    f"{f} must be a positive integer, got {v!r}; fix it in the checkpoint's config.json."
                )
        for f in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise CheckpointError(
                    f"{f} must be a positive finite number, got {v!r}; fix it in the checkpoint's config.json."
                )
        if self.head_dim % 2:
            raise CheckpointError(
                f"head_dim must be even (rotary embeddings rotate pairs), got {self.head_dim}; fix the checkpoint's "
                "config.json."
            )
        for f in ("bos_token_id",):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise CheckpointError(
                    f"{f} must be a token id (an integer >= 0) or null, got {v!r}; fix the checkpoint's config.json."
                )
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.eos_token_id):
            raise CheckpointError(
                f"eos_token_id must be token ids (integers >= 0), got {list(self.eos_token_id)!r}; fix the "
                "checkpoint's config.json."
            )
        if self.output_vocab is not None and (
            isinstance(self.output_vocab, bool)
            or not isinstance(self.output_vocab, int)
            or not 1 <= self.output_vocab <= self.vocab_size
            or self.tie_word_embeddings
        ):
            raise CheckpointError(
                f"specrt_output_vocab must be an integer in 1..vocab_size ({self.vocab_size}) with untied embeddings, "
                f"got {self.output_vocab!r}; fix the checkpoint's config.json."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedArchitectureError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; grouped-query attention needs it to be."
            )
        self._check_facts()
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"rope_scaling type {rope_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}). Use a checkpoint without it or add it to "
                "specrt/schema/config.py:rope_inv_freq."
            )

    def _check_facts(self):
        object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
        if self.architecture not in FAMILIES:
            raise UnsupportedArchitectureError(
                f"architecture {self.architecture!r} is not supported; specrt handles {', '.join(FAMILIES)}."
            )
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedArchitectureError(
                f"hidden_act {self.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})."
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise CheckpointError(f"sliding_window must be >= 1, got {self.sliding_window}; fix the config.json.")
        if any(not 0 <= i < self.num_hidden_layers for i in self.sliding_layers) or (
            self.sliding_layers and self.sliding_window is None
        ):
            raise CheckpointError(
                f"sliding layers {list(self.sliding_layers)} need a sliding_window and indices below "
                f"num_hidden_layers={self.num_hidden_layers}; fix the checkpoint's config.json."
            )
        rd = self.rotary_dim
        if rd is not None and (
            isinstance(rd, bool) or not isinstance(rd, int) or rd % 2 or not 0 < rd <= self.head_dim
        ):
            raise CheckpointError(f"rotary_dim must be an even count in 1..head_dim ({self.head_dim}), got {rd!r}.")

    @property
    def rotary_dims(self) -> int:
        """The leading dims of each head the rotary turns."""
        return self.rotary_dim or self.head_dim

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return float(self.attn_scalar or self.head_dim) ** -0.5

    def is_sliding(self, layer: int) -> bool:
        return layer in self.sliding_layers

    @property
    def plain(self) -> "ModelConfig":
        """This model's shapes with the Llama block's facts: the layer a draft head adds (EAGLE's
        head is its own model, a Llama layer over the target's features)."""
        facts = dict(qk_norm=False, norm_offset=0.0, sandwich_norms=False, hidden_act="silu", embed_scale=None)
        facts |= dict(attn_scalar=None, sliding_window=None, sliding_layers=(), rope_local_theta=None, rotary_dim=None)
        return dataclasses.replace(self, architecture="LlamaForCausalLM", **facts)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or [d.get("model_type", "?")]
        arch = archs[0]
        family = FAMILIES.get(arch)
        if family is None:
            raise UnsupportedArchitectureError(
                f"architecture {arch!r} is not supported; specrt handles "
                f"{', '.join(FAMILIES)}. Convert the model to one of these or "
                "add its family (docs/architecture.md, 'Adding a model family')."
            )
        max_pos = _field(d, "max_position_embeddings", int, 2048)
        if d.get("mlp_bias"):
            raise UnsupportedArchitectureError("mlp_bias=true is not supported (no supported family uses it).")
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters
        rope_params = d.get("rope_parameters") or {}
        rope_theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or {
            k: v for k, v in rope_params.items() if k not in ("rope_theta", "partial_rotary_factor")
        }
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (_as(int, eos, "eos_token_id"),))
        n_heads = _field(d, "num_attention_heads", int)
        hidden = _field(d, "hidden_size", int)
        if n_heads < 1:
            raise CheckpointError(
                f"num_attention_heads must be a positive integer, got {n_heads}; fix the checkpoint's config.json."
            )
        kv_heads, head_dim = _field(d, "num_key_value_heads", int, None), _field(d, "head_dim", int, None)
        layers = _field(d, "num_hidden_layers", int)
        fields = dict(
            vocab_size=_field(d, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=_field(d, "intermediate_size", int),
            num_hidden_layers=layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_heads if kv_heads is None else kv_heads,
            head_dim=hidden // n_heads if head_dim is None else head_dim,
            rms_norm_eps=_field(d, "rms_norm_eps", float, 1e-5),
            rope_theta=_as(float, rope_theta, "rope_theta"),
            rope_scaling=scaling or None,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", family.attention_bias)),
            architecture=arch,
            bos_token_id=_field(d, "bos_token_id", int, None),
            eos_token_id=eos_ids,
            output_vocab=_field(d, OUTPUT_VOCAB_KEY, int, None),
            hidden_act=d.get("hidden_act") or family.hidden_act,
        )
        fields |= family.facts(d)
        if fields["hidden_act"] not in ACTIVATIONS:
            raise UnsupportedArchitectureError(
                f"hidden_act {fields['hidden_act']!r} is not supported for {arch} (supported: silu)."
            )
        scaling = fields["rope_scaling"]
        if scaling:
            scaling = dict(scaling)
            scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
            scaling.pop("type", None)
            fields["rope_scaling"] = None if scaling["rope_type"] == "default" else scaling
        if fields.get("sliding_layers") == "all":
            fields["sliding_layers"] = tuple(range(layers))
        if fields.get("sliding_window") is not None and fields["sliding_window"] >= max_pos:
            fields |= dict(sliding_window=None, sliding_layers=())  # a window as long as the context
        return cls(**fields)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(
                f"{path} not found: a checkpoint directory needs config.json next to its safetensors files."
            )
        d = read_json_object(path, CheckpointError, "restore it from the original checkpoint")
        try:
            return cls.from_hf_dict(d)
        except UnsupportedArchitectureError:
            raise
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json transformers reads for the same model (also used by our own loader)."""
        family = FAMILIES[self.architecture]
        rope = {"rope_type": "default", "rope_theta": self.rope_theta} | (self.rope_scaling or {})
        d = {
            "architectures": [self.architecture],
            "model_type": family.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": self.hidden_act.replace("gelu_tanh", "gelu_pytorch_tanh"),
            "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
        }
        d |= family.config_keys(self)
        if self.output_vocab is not None:  # specrt's own key: transformers has no such model
            d[OUTPUT_VOCAB_KEY] = self.output_vocab
        return d

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_id"] = list(self.eos_token_id)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """The config as `to_dict` wrote it (in an artifact's manifest)."""
        known = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in d]
        if missing or set(d) - known:
            raise CheckpointError(
                f"the model config lacks fields {missing} or has unknown ones {sorted(set(d) - known)}"
            )
        d = dict(d)
        eos = d.get("eos_token_id") or ()
        d["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        d["sliding_layers"] = tuple(d.get("sliding_layers") or ())
        return cls(**d)


def config_from_manifest(manifest: dict[str, Any], where, how_to_make: str) -> ModelConfig:
    """The model config an artifact's manifest records, or an ArtifactError naming the artifact."""
    try:
        return ModelConfig.from_dict(manifest["config"])
    except SpecrtError as e:
        raise ArtifactError(f"{where}/manifest.json: {e}. Re-create the artifact with: {how_to_make}") from None


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> list[float]:
    """Inverse rotary frequencies (length rotary_dims/2) in float64, scaled as rope_scaling says;
    `local`: the sliding layers' (their own base where rope_local_theta is set, never scaled)."""
    dim = cfg.rotary_dims
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta else cfg.rope_theta
    inv = [1.0 / (theta ** (2 * i / dim)) for i in range(dim // 2)]
    scaling = {} if local and cfg.rope_local_theta else cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = [f / float(scaling["factor"]) for f in inv]
    elif kind == "llama3":
        # Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between.
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / factor)
            else:
                smooth = (old_ctx / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        inv = out
    return inv
