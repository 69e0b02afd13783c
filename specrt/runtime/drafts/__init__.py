"""Draft methods: objects that propose draft tokens for the target to verify (contract: base.py).

Methods are looked up by name in DRAFT_METHODS; `make_proposer("ngram", n_max=3)` builds one.
"""

from __future__ import annotations

from specrt.errors import SpecrtError
from specrt.runtime.drafts.base import DraftInput, Proposer
from specrt.runtime.drafts.ngram import NgramProposer
from specrt.runtime.drafts.suffix import SuffixProposer

DRAFT_METHODS = {
    "ngram": NgramProposer,
    "suffix": SuffixProposer,
}

__all__ = ["DRAFT_METHODS", "DraftInput", "Proposer", "make_proposer"]


def make_proposer(name: str, **options) -> Proposer:
    if name not in DRAFT_METHODS:
        raise SpecrtError(f"unknown draft method {name!r}; choose one of {', '.join(DRAFT_METHODS)}.")
    try:
        return DRAFT_METHODS[name](**options)
    except TypeError as e:
        raise SpecrtError(f"bad options for draft method {name!r}: {e}") from None
