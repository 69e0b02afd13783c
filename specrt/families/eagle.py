"""The EAGLE family: EAGLE-1, EAGLE-3 and MTP heads, one graph (a decoder layer over the target's
features with a KV cache of its own; export/draft_head.py), trained by training/eagle.py and
drafting with runtime/drafts/eagle.py (chains and EAGLE-2 dynamic trees)."""

from __future__ import annotations

import dataclasses

from specrt.errors import SpecrtError
from specrt.families.base import Drafting, Family, HeadGraph, Training


@dataclasses.dataclass(frozen=True)
class Variant:
    """What sets one head method apart, declared here once: the exporter and the trainer read
    these flags, never the method's name."""

    # reads the target's final normed state (layers -1) and projects through the target's own
    # output head (frozen, full vocabulary); else fc fuses a low, a middle and a high layer, the
    # layer's attention reads norm(embed) ++ norm(feature), over a reduced draft vocabulary
    full_vocab: bool
    normed_inputs: bool = False  # fc reads enorm(embed) ++ hnorm(feature), no bias (MTP); else embed ++ feature
    final_norm: bool = True  # a norm before the output head (EAGLE-1's state has none)
    regress_feature: bool = False  # trained to regress the next feature beside cross-entropy (EAGLE-1)
    parallel: bool = False  # mask entries: one call drafts K tokens (peagle, families/parallel.py)
    ttt_steps: int = 3  # draft steps unrolled in training by default (training-time test)


VARIANTS = {
    "eagle": Variant(full_vocab=True, final_norm=False, regress_feature=True, ttt_steps=1),
    "eagle3": Variant(full_vocab=False),
    "mtp": Variant(full_vocab=True, normed_inputs=True, ttt_steps=2),
    "peagle": Variant(full_vocab=False, parallel=True, ttt_steps=5),
}
METHODS = tuple(VARIANTS)  # what the shared HeadConfig takes


def variant(method: str) -> Variant:
    if method not in VARIANTS:
        raise SpecrtError(f"unknown head method {method!r}; choose one of {', '.join(METHODS)}")
    return VARIANTS[method]


# the head's step graph I/O, in order (the one definition; the proposer and the exporter read it)
HEAD_INPUTS = (
    "input_ids",  # [B, Q] int64: t[j+1]
    "features",  # [B, Q, F] float32: the target's features at j (ignored where from_draft)
    "draft_hidden",  # [B, Q, C] float32: the head's own hidden state at j - 1 (used where from_draft)
    "from_draft",  # [B, Q] bool: take draft_hidden instead of features
    "position_ids",  # [B, Q] int64: j
    "attention_mask",  # [B, Q, P+Q] bool
    "past_key",  # [B, Hkv, P, D] float32
    "past_value",
)
HEAD_OUTPUTS = ("logits", "hidden", "present_key", "present_value")  # [B,Q,Vd], [B,Q,C], [B,Hkv,Q,D] x2
HEAD_DYNAMIC_AXES = {
    "input_ids": {0: "batch", 1: "q"},
    "features": {0: "batch", 1: "q"},
    "draft_hidden": {0: "batch", 1: "q"},
    "from_draft": {0: "batch", 1: "q"},
    "position_ids": {0: "batch", 1: "q"},
    "attention_mask": {0: "batch", 1: "q", 2: "kv"},
    "past_key": {0: "batch", 2: "past"},
    "past_value": {0: "batch", 2: "past"},
    "logits": {0: "batch", 1: "q"},
    "hidden": {0: "batch", 1: "q"},
    "present_key": {0: "batch", 2: "q"},
    "present_value": {0: "batch", 2: "q"},
}

KV = ("batch", "kv_heads", "past", "head_dim")
HEAD_DIMS = (
    ("batch", "q"),
    ("batch", "q", "features"),
    ("batch", "q", "hidden"),
    ("batch", "q"),
    ("batch", "q"),
    ("batch", "q", "kv"),
    KV,
    KV,
)  # HEAD_INPUTS' dimensions (HeadGraph.dims)
GRAPH = HeadGraph(
    HEAD_INPUTS,
    HEAD_OUTPUTS,
    True,
    "specrt.export.draft_head:HeadConfig",
    "specrt.export.draft_head:DraftHead",
    HEAD_DIMS,
)
TRAINING = "specrt.training.eagle:train_config", "specrt.training.eagle:train_head"
_EAGLE = ("batch_tokens", "ttt_steps")  # eagle and mtp predict the target's whole vocabulary: no draft_vocab
_PROPOSER = "specrt.runtime.drafts.eagle:EagleProposer"
_HEAD = "a trained head in --draft-dir"


def _family(name: str, about: str, reads: tuple[str, ...], in_auto: bool = False) -> Family:
    drafting = Drafting(_PROPOSER, _HEAD, takes_tree=True, fixed=(("method", name),), in_auto=in_auto)
    return Family(name, about, Training(*TRAINING, reads=reads), drafting, GRAPH)


FAMILIES = (
    _family("eagle", "an EAGLE-1 head", _EAGLE),
    _family("eagle3", "an EAGLE-3 head", (*_EAGLE, "draft_vocab"), in_auto=True),
    # an MTP module (DeepSeek-V3's layout) drafts as an EAGLE head does
    _family("mtp", "an MTP module (DeepSeek-V3 layout)", _EAGLE),
)
