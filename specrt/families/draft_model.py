"""A draft model: a smaller model of the target's family with its own step graph, engine and KV
cache; trained here by distilling the target's layers (training/draft_model.py), drafting with
runtime/drafts/draft_model.py."""

from __future__ import annotations

from specrt.families.base import Drafting, Family, Training

FAMILIES = (
    Family(
        "draft-model",
        "a draft model distilled from the target's layers",
        Training(
            "specrt.training.draft_model:train_config",
            "specrt.training.draft_model:train_draft_model",
            writes="model",
            reads=("batch_tokens", "draft_vocab"),
        ),
        Drafting(
            "specrt.runtime.drafts.draft_model:DraftModelProposer",
            "a smaller model's build-engines output in --draft-dir",
            in_auto=True,
        ),
    ),
)
