"""Multi-token-prediction modules a checkpoint carries (DeepSeek-V3's layout), as draft heads.

A checkpoint whose config.json has `num_nextn_predict_layers: n` stores n MTP modules after its
decoder layers, module i under `model.layers.{L + i}.` (L = num_hidden_layers):

    enorm.weight, hnorm.weight         RMSNorms of the next token's embedding and of the feature
    eh_proj.weight [C, 2C]             the projection of enorm(embed) ++ hnorm(feature)
    self_attn.*, mlp.*, input_layernorm.weight, post_attention_layernorm.weight
                                       one decoder layer (here: the target's own layer type)
    shared_head.norm.weight            the norm before the output head
    shared_head.head.weight, embed_tokens.weight   optional: the model's own are shared

`mtp_head(checkpoint, i)` is module i as a draft_head.DraftHead (method "mtp");
training.pipeline.import_mtp (`specrt import-mtp`) writes it as a draft head directory (head/,
onnx/, engines/) that `--draft mtp` runs. A target without such modules gets one from
`specrt train-draft --method mtp`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specrt.artifacts import read_json_object
from specrt.errors import CheckpointError, SpecrtError
from specrt.export.checkpoint import load_config, read_state_dict, require_checkpoint_dir
from specrt.export.draft_head import DraftHead, HeadConfig

MTP_CONFIG_KEY = "num_nextn_predict_layers"
# DeepSeek-V3's names for the module's own pieces -> DraftHead's (the decoder layer's go under layer.)
RENAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "fc.weight",
    "shared_head.norm.weight": "norm.weight",
    "shared_head.head.weight": "lm_head.weight",
    "embed_tokens.weight": "embed_tokens.weight",
}


def mtp_modules(checkpoint: str | Path) -> int:
    """How many MTP modules the checkpoint's config declares (0 when none)."""
    checkpoint = Path(checkpoint)
    require_checkpoint_dir(checkpoint)
    config = checkpoint / "config.json"
    n = read_json_object(config, CheckpointError, "restore it from the original checkpoint").get(MTP_CONFIG_KEY)
    if n is None:
        return 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise CheckpointError(
            f"{config}: {MTP_CONFIG_KEY} must be a whole number >= 0 (how many MTP modules the checkpoint carries), "
            f"got {json.dumps(n)[:40]}; correct it, or restore the file from the original checkpoint"
        )
    return n


def mtp_head(checkpoint: str | Path, index: int = 0) -> DraftHead:
    """MTP module `index` of the checkpoint as a DraftHead (method "mtp"), in float32."""
    checkpoint = Path(checkpoint)
    n = mtp_modules(checkpoint)
    if not 0 <= index < n:
        raise SpecrtError(
            f"{checkpoint} carries {n} MTP modules ({MTP_CONFIG_KEY} in config.json), so there is no module {index}; "
            "train one for this target with: specrt train-draft --method mtp --model CHECKPOINT --out DIR"
        )
    cfg = load_config(checkpoint)
    state = {k.removeprefix("model."): v.to(torch.float32) for k, v in read_state_dict(checkpoint).items()}
    prefix = f"layers.{cfg.num_hidden_layers + index}."
    own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    mapped = {RENAMES.get(k, f"layer.{k}"): v for k, v in own.items()}
    mapped.setdefault("embed_tokens.weight", state.get("embed_tokens.weight"))  # shared with the model
    shared_head = state.get("embed_tokens.weight") if cfg.tie_word_embeddings else state.get("lm_head.weight")
    mapped.setdefault("lm_head.weight", shared_head)
    head = DraftHead(HeadConfig("mtp", cfg, (-1,), cfg.vocab_size))
    expected = {k: v.shape for k, v in head.state_dict().items() if k != "draft_to_target"}
    missing = sorted(k for k in expected if mapped.get(k) is None)
    unknown = sorted(set(mapped) - set(expected))
    if missing or unknown:
        raise CheckpointError(
            f"{checkpoint}: MTP module {index} (model.{prefix}*) is not in DeepSeek-V3's layout: "
            f"missing {missing[:3]}, unexpected {unknown[:3]}"
        )
    for k, shape in expected.items():
        if tuple(mapped[k].shape) != tuple(shape):
            raise CheckpointError(
                f"{checkpoint}: MTP weight {k} has shape {tuple(mapped[k].shape)}, the config implies {tuple(shape)}"
            )
    head.load_state_dict({k: mapped[k] for k in expected}, strict=False)
    return head.eval()
