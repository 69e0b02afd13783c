"""The EAGLE family: EAGLE-1, EAGLE-3 and MTP heads, one graph (a decoder layer over the target's
features with a KV cache of its own; export/draft_head.py), trained by training/eagle.py and
drafting with runtime/drafts/eagle.py (chains and EAGLE-2 dynamic trees)."""

from __future__ import annotations

from specrt.families.base import Drafting, Family, HeadGraph, Training

METHODS = ("eagle", "eagle3", "mtp", "peagle")  # what the shared HeadConfig takes (peagle: families/parallel.py)
FULL_VOCAB_METHODS = ("eagle", "mtp")  # read the final normed state, project through the target's head

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

GRAPH = HeadGraph(
    HEAD_INPUTS, HEAD_OUTPUTS, True, "specrt.export.draft_head:HeadConfig", "specrt.export.draft_head:DraftHead"
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
