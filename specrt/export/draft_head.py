"""EAGLE draft heads: one decoder layer that drafts from the target's own features.

A head reads, per position j, the token t[j+1] and a feature vector, and predicts t[j+2]. The
feature is the target's hidden state at j when the target computed it (the committed context),
or the head's own output hidden state at j - 1 when it did not (every draft token after the
first): drafting is autoregressive over the head's one layer, with its own KV cache.

Two methods (both read the target's features from its step graph's `hidden_states` output):

    eagle    EAGLE-1: the final normed state of the target; fc(embed(t) ++ feature) -> one decoder
             layer -> the target's own output head (frozen, full vocabulary). Trained with
             cross-entropy plus a regression of the next feature.
    eagle3   EAGLE-3: a low, a middle and a high layer of the target fused by fc (3C -> C); the
             layer's attention reads norm(embed(t)) ++ norm(feature) (2C wide); a final norm and
             an output head over a reduced draft vocabulary (the most frequent tokens of the
             training answers), mapped back to target ids by `draft_to_target`. Trained with
             cross-entropy over several unrolled draft steps (training-time test).
    mtp      a multi-token-prediction module in DeepSeek-V3's layout: eh_proj(enorm(embed(t)) ++
             hnorm(feature)) -> one decoder layer -> shared_head.norm -> the target's output
             head (frozen, full vocabulary); chained for several tokens on its own output
             state, like EAGLE. Loaded from a checkpoint that carries one (export/mtp.py) or
             trained here with cross-entropy over unrolled steps.

The head is written as one *step*, like the target (export/llama.py): Q new positions, the past
KV of its single layer and a boolean mask [B, Q, P+Q], so one ONNX graph serves catching up on
the committed context, chains and tree-masked draft steps. Its I/O names are `HeadIO`.

Shapes: B batch, Q new positions, P past positions, C hidden, F feature width, Vd draft vocab.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from torch import nn

from specrt.artifacts import atomic_write_text, read_json_object
from specrt.errors import SpecrtError
from specrt.export.llama import DecoderLayer, LlamaModel, RMSNorm, inv_freq, mask_bias, rotary
from specrt.families.eagle import HEAD_DYNAMIC_AXES, HEAD_INPUTS, HEAD_OUTPUTS, Variant, variant
from specrt.schema.config import ModelConfig
from specrt.schema.head_io import CONFIG_FILE, WEIGHTS_FILE, default_target_layers, eagle3_layers


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    method: str
    target: ModelConfig  # the target's config: the head's layer has its shape
    layers: tuple[int, ...]  # the target layers the head reads (-1: the final normed state)
    draft_vocab: int  # rows of the head's output projection (the target's vocab for eagle)
    parallel: int = 0  # peagle: mask depths, the draft tokens after the first one call makes

    def __post_init__(self):
        v = self.variant
        if v.full_vocab and tuple(self.layers) != (-1,):
            raise SpecrtError(f"an {self.method} head reads the target's final normed state (layers -1)")
        if v.full_vocab and self.draft_vocab != self.target.vocab_size:
            raise SpecrtError(f"an {self.method} head projects through the target's full vocabulary")
        if v.parallel != (self.parallel >= 1):
            raise SpecrtError(f"a {self.method} head with {self.parallel} mask depths (peagle needs >= 1, others 0)")
        if not 1 <= self.draft_vocab <= self.target.vocab_size:
            raise SpecrtError(f"draft vocabulary {self.draft_vocab} must be in 1..{self.target.vocab_size}")

    @property
    def variant(self) -> Variant:
        """Its method's flags (families/eagle.py): what the layer reads and how it projects."""
        return variant(self.method)

    @property
    def feature_width(self) -> int:
        return self.target.hidden_size * len(self.layers)

    def to_dict(self) -> dict:
        d = {
            "method": self.method,
            "target": self.target.to_dict(),
            "layers": list(self.layers),
            "draft_vocab": self.draft_vocab,
        }
        return d | ({"parallel": self.parallel} if self.parallel else {})

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        target = ModelConfig.from_dict(d["target"])
        return cls(d["method"], target, tuple(d["layers"]), int(d["draft_vocab"]), int(d.get("parallel", 0)))


class Eagle3Layer(DecoderLayer):
    """A decoder layer whose attention reads norm(embedding) ++ norm(feature) (2C wide) while
    the residual stream carries the feature alone (EAGLE-3)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        C, a = cfg.hidden_size, self.self_attn
        self.hidden_norm = RMSNorm(C, cfg.rms_norm_eps)
        a.q_proj = nn.Linear(2 * C, a.n_heads * a.head_dim, bias=cfg.attention_bias)
        a.k_proj = nn.Linear(2 * C, a.n_kv * a.head_dim, bias=cfg.attention_bias)
        a.v_proj = nn.Linear(2 * C, a.n_kv * a.head_dim, bias=cfg.attention_bias)

    def forward(self, emb, x, cos, sin, mask_bias, past_k, past_v):
        attn_in = torch.cat([self.input_layernorm(emb), self.hidden_norm(x)], dim=-1)
        a, k, v = self.self_attn(attn_in, cos, sin, mask_bias, past_k, past_v)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v


class DraftHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head (see the module docstring); `draft_to_target` maps its output
    rows to target token ids (the identity for EAGLE-1)."""

    io = (HEAD_INPUTS, HEAD_OUTPUTS, HEAD_DYNAMIC_AXES)  # the graph's inputs, outputs, dynamic axes

    def __init__(self, hc: HeadConfig):
        super().__init__()
        self.hc = hc
        # the head's layer is a Llama layer of the target's shapes, whatever the target's family
        cfg, C = hc.target.plain, hc.target.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, C)  # the target's, frozen
        self.embed_tokens.weight.requires_grad_(False)
        v, self.enorm, self.hnorm = hc.variant, None, None
        if v.full_vocab and v.normed_inputs:  # MTP, DeepSeek-V3's names: enorm, hnorm, eh_proj (fc), shared_head.norm
            self.enorm = RMSNorm(C, cfg.rms_norm_eps)
            self.hnorm = RMSNorm(C, cfg.rms_norm_eps)
        if v.full_vocab:  # over embed(t) ++ feature, each normed first where normed_inputs (then no bias)
            self.fc = nn.Linear(2 * C, C, bias=not v.normed_inputs)
            self.layer = DecoderLayer(cfg)
        else:
            self.fc = nn.Linear(hc.feature_width, C, bias=False)  # fuses the low/middle/high features
            self.layer = Eagle3Layer(cfg)
        self.norm = RMSNorm(C, cfg.rms_norm_eps) if v.final_norm else None
        self.lm_head = nn.Linear(C, hc.draft_vocab, bias=False)
        if v.full_vocab:
            self.lm_head.weight.requires_grad_(False)  # the target's head, shared and frozen
        self.register_buffer("draft_to_target", torch.arange(hc.draft_vocab, dtype=torch.int64))
        self.register_buffer("inv_freq", inv_freq(cfg), persistent=False)  # the target's rotary embedding

    def forward(self, input_ids, features, draft_hidden, from_draft, position_ids, attention_mask, past_k, past_v):
        """See HEAD_INPUTS / HEAD_OUTPUTS. Returns logits (B, Q, Vd), hidden (B, Q, C), and the
        new positions' key and value (B, Hkv, Q, D)."""
        h, k, v = self.body(input_ids, features, draft_hidden, from_draft, position_ids, attention_mask, past_k, past_v)
        return self.project(h), h, k, v

    def project(self, h):
        """Draft-vocabulary logits of output hidden states (training projects only the positions
        it scores)."""
        return self.lm_head(h) if self.norm is None else self.lm_head(self.norm(h))

    def body(self, input_ids, features, draft_hidden, from_draft, position_ids, attention_mask, past_k, past_v):
        """(hidden, key, value): the forward up to the output projection."""
        emb, full = self.embed_tokens(input_ids), self.hc.variant.full_vocab
        if full:
            feat = torch.where(from_draft.unsqueeze(-1), draft_hidden, features)
            if self.enorm is not None:
                emb, feat = self.enorm(emb), self.hnorm(feat)
            x = self.fc(torch.cat([emb, feat], dim=-1))
        else:
            x = torch.where(from_draft.unsqueeze(-1), draft_hidden, self.fc(features))
        cos, sin = rotary(position_ids, self.inv_freq)
        bias = mask_bias(attention_mask, x.dtype)
        if full:  # the final norm, where there is one, is in project()
            return self.layer(x, cos, sin, bias, past_k, past_v)
        return self.layer(emb, x, cos, sin, bias, past_k, past_v)

    def empty_past(self, batch: int):
        cfg = self.hc.target
        z = torch.zeros(batch, cfg.num_key_value_heads, 0, cfg.head_dim)
        return z, z.clone()

    def example_inputs(self, batch: int = 2, q: int = 3, past: int = 4) -> tuple[torch.Tensor, ...]:
        """Inputs to trace the graph with (every dynamic axis > 1)."""
        cfg = self.hc.target
        kv = torch.zeros(batch, cfg.num_key_value_heads, past, cfg.head_dim)
        return (
            torch.zeros(batch, q, dtype=torch.int64),
            torch.zeros(batch, q, self.hc.feature_width),
            torch.zeros(batch, q, cfg.hidden_size),
            torch.zeros(batch, q, dtype=torch.bool),
            torch.arange(q).repeat(batch, 1) + past,
            torch.ones(batch, q, past + q, dtype=torch.bool),
            kv,
            kv.clone(),
        )

    def parity_inputs(self, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        """A ragged batch for the export's parity check: a catch-up step with a past, and a
        tree-masked step mixing target features and the head's own hidden states."""
        cfg, B, Q, P = self.hc.target, 2, 5, 7
        inputs = (
            torch.randint(0, cfg.vocab_size, (B, Q), generator=g),
            torch.randn(B, Q, self.hc.feature_width, generator=g),
            torch.randn(B, Q, cfg.hidden_size, generator=g),
            torch.rand(B, Q, generator=g) < 0.5,
            torch.arange(Q).repeat(B, 1) + P,
            torch.rand(B, Q, P + Q, generator=g) < 0.7,
            torch.randn(B, cfg.num_key_value_heads, P, cfg.head_dim, generator=g),
            torch.randn(B, cfg.num_key_value_heads, P, cfg.head_dim, generator=g),
        )
        inputs[5][:, :, 0] = True  # every position sees at least one key
        return inputs


def head_from_target(target: LlamaModel, hc: HeadConfig, draft_ids=None, seed: int = 0) -> DraftHead:
    """A new head initialised from the target: its embedding (frozen), its output head (the rows
    of the draft vocabulary, `draft_ids`, most frequent first), and its last decoder layer as the
    head's layer. With the little data a CPU can make, starting from a layer that already
    computes the target's next-token features trains much faster than a random one; fc starts
    as "pass the feature through" (EAGLE-1: the feature half; EAGLE-3: the high layer)."""
    from specrt.schema.head_io import head_family

    torch.manual_seed(seed)
    head = head_family(hc.method).load_types()[1](hc)  # the family's module (a DraftHead)
    cfg, C = hc.target, hc.target.hidden_size
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.embed_tokens.weight)
        ids = torch.arange(cfg.vocab_size) if draft_ids is None else torch.as_tensor(draft_ids, dtype=torch.int64)
        if len(ids) != hc.draft_vocab:
            raise SpecrtError(f"{len(ids)} draft ids for a draft vocabulary of {hc.draft_vocab}")
        head.draft_to_target.copy_(ids)
        head.lm_head.weight.copy_(target.lm_head.weight[ids])
        last, own = _plain_layer_weights(target.layers[-1]), head.layer.state_dict()
        for name, w in last.items():
            if name not in own:  # the head's own weights (EAGLE-3's hidden_norm) start as they are
                continue
            if own[name].shape == w.shape:
                own[name].copy_(w)
            else:  # EAGLE-3's 2C-wide q/k/v: the feature half from the target, the embedding half small
                own[name].normal_(0.0, 0.02 * float(w.std()))
                own[name][:, C:].copy_(w)
        # the feature passes through: the second half of embed ++ feature, or the high layer's
        # block, the last C columns of the fused features; the output norm is the target's
        head.fc.weight.zero_()
        head.fc.weight[:, -C:].copy_(torch.eye(C))
        if head.fc.bias is not None:
            head.fc.bias.zero_()
        if head.norm is not None:
            head.norm.weight.copy_(target.norm.scale())
    return head


def _plain_layer_weights(layer) -> dict[str, torch.Tensor]:
    """A target layer's weights as a Llama layer holds them (the head's layer is one, whatever the
    target's family): each norm's scale (Gemma's 1 + w), the MLP's input norm (Gemma's
    pre-feed-forward norm), and none of what a Llama layer lacks (q/k norms, Gemma's norms after
    attention and the MLP)."""
    out = {k: v for k, v in layer.state_dict().items() if "norm" not in k}
    mlp_norm = layer.pre_feedforward_layernorm if layer.sandwich else layer.post_attention_layernorm
    out["input_layernorm.weight"] = layer.input_layernorm.scale()
    out["post_attention_layernorm.weight"] = mlp_norm.scale()
    return out


def save_head(head: DraftHead, directory: str | Path, extra: dict | None = None) -> None:
    """head.safetensors (trainable and frozen weights, the draft-to-target map) and head.json."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    tmp = directory / (WEIGHTS_FILE + ".tmp")  # a run killed while saving leaves the last head whole
    save_file(state, str(tmp))
    os.replace(tmp, directory / WEIGHTS_FILE)
    atomic_write_text(directory / CONFIG_FILE, json.dumps({**head.hc.to_dict(), **(extra or {})}, indent=2) + "\n")


def load_head(directory: str | Path):
    """The trained head in `directory`, as its family (head_io.HEAD_FAMILIES) makes it: a
    DraftHead (eagle, eagle3, mtp), MedusaHeads (medusa)."""
    from safetensors.torch import load_file

    from specrt.schema.head_io import HEAD_FAMILIES

    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file():
        raise SpecrtError(f"{directory} holds no draft head ({CONFIG_FILE} missing); train one with specrt train-draft")
    fix = f"train the head again (specrt train-draft --out {directory.parent}), or restore the file from a copy"
    d = read_json_object(directory / CONFIG_FILE, SpecrtError, fix)
    if d.get("method") not in HEAD_FAMILIES:
        raise SpecrtError(f"{directory / CONFIG_FILE} names no known head family ({d.get('method')!r}); {fix}")
    config, module = HEAD_FAMILIES[d["method"]].load_types()
    try:
        head = module(config.from_dict(d))
    except (KeyError, TypeError, ValueError) as e:
        raise SpecrtError(f"{directory / CONFIG_FILE} is not a head's configuration ({e!r}); {fix}") from None
    try:
        state = load_file(str(directory / WEIGHTS_FILE))
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for a damaged file
        raise SpecrtError(f"{directory / WEIGHTS_FILE} is damaged or missing ({e}); {fix}") from None
    try:
        head.load_state_dict(state)
    except RuntimeError as e:  # weights of other shapes than the configuration says
        raise SpecrtError(f"{directory / WEIGHTS_FILE} does not fit {CONFIG_FILE} ({str(e)[:160]}); {fix}") from None
    return head.eval()


__all__ = [
    "DraftHead",
    "HEAD_INPUTS",
    "HEAD_OUTPUTS",
    "HeadConfig",
    "default_target_layers",
    "eagle3_layers",
    "head_from_target",
    "load_head",
    "save_head",
]
