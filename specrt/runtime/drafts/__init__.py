"""Draft methods: objects that propose draft tokens for the target to verify (contract: base.py).

Methods are looked up by name in DRAFT_METHODS; `make_proposer("ngram", n_max=3)` builds one.
"""

from __future__ import annotations

import functools

from specrt.errors import SpecrtError
from specrt.runtime.drafts.base import DraftInput, Proposer
from specrt.runtime.drafts.draft_model import DraftModelProposer
from specrt.runtime.drafts.eagle import EagleProposer
from specrt.runtime.drafts.hybrid import HybridProposer
from specrt.runtime.drafts.lookahead import LookaheadProposer
from specrt.runtime.drafts.medusa import MedusaProposer
from specrt.runtime.drafts.ngram import NgramProposer
from specrt.runtime.drafts.suffix import SuffixProposer


def _hybrid(**head) -> HybridProposer:
    """The suffix draft and an EAGLE head (options: EagleProposer's)."""
    return HybridProposer(EagleProposer(**head))


DRAFT_METHODS = {
    "ngram": NgramProposer,
    "suffix": SuffixProposer,
    "lookahead": LookaheadProposer,
    # trained heads: make_proposer("eagle3", draft_dir=DIR, target=generator.session.caps)
    "eagle": functools.partial(EagleProposer, method="eagle"),
    "eagle3": functools.partial(EagleProposer, method="eagle3"),
    "mtp": functools.partial(EagleProposer, method="mtp"),  # an MTP module drafts as an EAGLE head does
    "hybrid": _hybrid,
    "medusa": MedusaProposer,  # make_proposer("medusa", draft_dir=DIR, target=caps[, tree=paths])
    "draft-model": DraftModelProposer,  # draft_dir: a smaller model's build-engines output
}
NEEDS_DRAFT_DIR = (
    "eagle",
    "eagle3",
    "mtp",
    "hybrid",
    "medusa",
    "draft-model",
)  # methods with weights: they need --draft-dir
TAKES_TREE = ("eagle", "eagle3", "mtp", "hybrid")  # methods that draft EAGLE-2 trees (--draft-tree TOP_K,DEPTH)

__all__ = ["DRAFT_METHODS", "NEEDS_DRAFT_DIR", "TAKES_TREE", "DraftInput", "Proposer", "make_proposer"]


def make_proposer(name: str, **options) -> Proposer:
    if name not in DRAFT_METHODS:
        raise SpecrtError(f"unknown draft method {name!r}; choose one of {', '.join(DRAFT_METHODS)}.")
    try:
        return DRAFT_METHODS[name](**options)
    except TypeError as e:
        raise SpecrtError(f"bad options for draft method {name!r}: {e}") from None
