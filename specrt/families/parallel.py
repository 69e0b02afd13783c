"""The parallel EAGLE-3 head (P-EAGLE): K draft tokens in one call, K - 1 of them from mask
entries (export/parallel_head.py, trained by training/eagle.py, drafting with
runtime/drafts/parallel.py)."""

from __future__ import annotations

from specrt.families.base import Drafting, Family, HeadGraph, Training
from specrt.families.eagle import HEAD_DIMS, HEAD_DYNAMIC_AXES, HEAD_INPUTS, HEAD_OUTPUTS, TRAINING

PARALLEL = "peagle"  # EAGLE-3 with mask entries: the first draft and K - 1 more in the same call
# a parallel head's graph: the EAGLE head's, and which entries are mask entries (0: none; d: draft depth d + 1)
PARALLEL_INPUTS = (*HEAD_INPUTS, "mask_depth")  # [B, Q] int64
PARALLEL_DYNAMIC_AXES = {**HEAD_DYNAMIC_AXES, "mask_depth": {0: "batch", 1: "q"}}

FAMILIES = (
    Family(
        PARALLEL,
        "a parallel EAGLE-3 head (P-EAGLE: --ttt-steps tokens per call)",
        Training(*TRAINING, reads=("batch_tokens", "ttt_steps", "draft_vocab")),
        Drafting(
            "specrt.runtime.drafts.parallel:ParallelProposer",
            "a parallel EAGLE-3 head in --draft-dir (K tokens a call)",
            takes_tree=True,
            in_auto=True,
        ),
        HeadGraph(
            PARALLEL_INPUTS,
            HEAD_OUTPUTS,
            True,
            "specrt.export.draft_head:HeadConfig",
            "specrt.export.parallel_head:ParallelHead",
            (*HEAD_DIMS, ("batch", "q")),
        ),
    ),
)
