"""Draft methods: small objects that propose draft tokens for the target to verify.

Every method has the same shape (no base class):

    begin(row, prompt)               a request starts in batch row `row`
    propose(row, context, max_tokens) -> DraftTree   (may be empty; at most max_tokens nodes)
    end(row, output)                 the request finished; methods that learn across requests
                                     (suffix) keep its output

Methods are looked up by name in DRAFT_METHODS; `make_proposer("ngram", n_max=3)` builds one.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from specrt.errors import SpecrtError
from specrt.runtime.drafts.ngram import NgramProposer
from specrt.runtime.drafts.suffix import SuffixProposer
from specrt.runtime.verification import DraftTree


class Proposer(Protocol):
    name: str

    def begin(self, row: int, prompt: Sequence[int]) -> None: ...

    def propose(self, row: int, context: Sequence[int], max_tokens: int) -> DraftTree: ...

    def end(self, row: int, output: Sequence[int]) -> None: ...


DRAFT_METHODS = {
    "ngram": NgramProposer,
    "suffix": SuffixProposer,
}


def make_proposer(name: str, **options) -> Proposer:
    if name not in DRAFT_METHODS:
        raise SpecrtError(f"unknown draft method {name!r}; choose one of {', '.join(DRAFT_METHODS)}.")
    try:
        return DRAFT_METHODS[name](**options)
    except TypeError as e:
        raise SpecrtError(f"bad options for draft method {name!r}: {e}") from None
