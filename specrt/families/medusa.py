"""Medusa heads: K residual blocks over the target's final feature and one shared projection,
one call for a whole tree of choices (export/medusa.py, schema/medusa_tree.py; trained by
training/medusa.py; drafting with runtime/drafts/medusa.py)."""

from __future__ import annotations

from specrt.families.base import Drafting, Family, HeadGraph, Training

MEDUSA = "medusa"
MEDUSA_INPUTS = ("features",)  # [B, C] float32: the target's final normed state at the root's parent
MEDUSA_OUTPUTS = ("topk_logprobs", "topk_ids")  # [B, K, k] float32, [B, K, k] int64 (target ids)
MEDUSA_DYNAMIC_AXES = {"features": {0: "batch"}, "topk_logprobs": {0: "batch"}, "topk_ids": {0: "batch"}}

FAMILIES = (
    Family(
        MEDUSA,
        "Medusa heads",
        Training(
            "specrt.training.medusa:train_config",
            "specrt.training.medusa:train_medusa",
            reads=("draft_vocab", "heads"),
        ),
        # make_proposer("medusa", draft_dir=DIR, target=caps[, tree=paths]): its own tree of choices
        Drafting(
            "specrt.runtime.drafts.medusa:MedusaProposer", "Medusa heads in --draft-dir", in_auto=True, own_tree=True
        ),
        HeadGraph(
            MEDUSA_INPUTS,
            MEDUSA_OUTPUTS,
            False,
            "specrt.export.medusa:MedusaConfig",
            "specrt.export.medusa:MedusaHeads",
            (("batch", "hidden"),),
        ),
    ),
)
