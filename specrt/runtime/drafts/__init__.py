"""Draft methods: objects that propose draft tokens for the target to verify (contract: base.py).

Methods are looked up by name in DRAFT_METHODS, one DraftMethod entry each (how to make it, and
what its options need: the CLI's choices and checks come from here); `make_proposer("ngram",
n_max=3)` builds one. The methods without weights are listed here; the trained families add
their own entries from their declarations (specrt/families/: one unit per family).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from specrt.errors import SpecrtError
from specrt.families import Family, View
from specrt.runtime.drafts.auto import AutoProposer
from specrt.runtime.drafts.base import DraftInput, GrammarDrafts, Proposer
from specrt.runtime.drafts.eagle import EagleProposer
from specrt.runtime.drafts.lookahead import LookaheadProposer
from specrt.runtime.drafts.ngram import NgramProposer
from specrt.runtime.drafts.suffix import SuffixProposer


def _head(**options):
    """The proposer of the trained head in options["draft_dir"], as the registry's entry for the
    method its manifest names makes it (an EAGLE-family head, the parallel head, Medusa heads),
    or of the draft model there (a smaller model's engine)."""
    from specrt.engines.head import head_method
    from specrt.runtime.drafts.draft_model import is_draft_model

    method = head_method(options["draft_dir"])
    if method is None and is_draft_model(options["draft_dir"]):
        if options.get("tree") is not None:
            raise SpecrtError(
                f"{options['draft_dir']} holds a draft model, which drafts chains: leave out --draft-tree"
            )
        # inside auto: fed at its first draft for a row, so a row the copies serve costs no prefill
        return DRAFT_METHODS["draft-model"].make(**options, lazy=True)
    entry = DRAFT_METHODS.get(method)
    if entry is None or not entry.needs_draft_dir:  # no readable head: EagleProposer's open says why
        return EagleProposer(**options)
    if options.get("tree") is not None and not entry.takes_tree:
        raise SpecrtError(
            f"{options['draft_dir']} holds {entry.what}, which draft their own tree of choices: leave out --draft-tree"
        )
    return entry.make(**options)


def _auto(**head) -> AutoProposer:
    """The copy drafts, and a trained head or a draft model when its directory is given (options:
    the member's proposer's)."""
    return AutoProposer(head=_head(**head) if head.get("draft_dir") is not None else None)


@dataclasses.dataclass(frozen=True)
class DraftMethod:
    """A registry entry: how to make the proposer, and what the CLI and the runner check of its
    options before any engine loads."""

    make: Callable[..., Proposer]
    about: str  # what it drafts from, for --help
    needs_draft_dir: bool = False  # a method with weights: --draft-dir DIR
    takes_tree: bool = False  # drafts EAGLE-2 dynamic trees: --draft-tree TOP_K,DEPTH
    head_optional: bool = False  # takes a trained head in --draft-dir when given (auto)
    own_tree: bool = False  # drafts a tree of its own choosing (Medusa's tree of choices)

    @property
    def what(self) -> str:
        """What it drafts from, for an error message: e.g. "Medusa heads"."""
        return self.about.removesuffix(" in --draft-dir")


_LOOKUPS: dict[str, DraftMethod] = {
    "ngram": DraftMethod(NgramProposer, "prompt lookup (no weights)"),
    "suffix": DraftMethod(SuffixProposer, "the prompt and earlier answers, SuffixDecoding (no weights)"),
    "auto": DraftMethod(
        _auto,
        "per row and step the copy draft (suffix, ngram) whose draft promises most, or none; with --draft-dir, "
        "also the head or draft model there where no copy serves",
        takes_tree=True,
        head_optional=True,
    ),
    "lookahead": DraftMethod(LookaheadProposer, "Jacobi iteration's n-grams (no weights)"),
    "grammar": DraftMethod(GrammarDrafts, "only the tokens a request's grammar forces (structured output)"),
}


def _trained(family: Family) -> DraftMethod:
    """A trained family's entry: make_proposer("eagle3", draft_dir=DIR, target=generator.session.caps)."""
    d = family.drafting
    return DraftMethod(d.make, d.about, needs_draft_dir=True, takes_tree=d.takes_tree, own_tree=d.own_tree)


DRAFT_METHODS = View(_trained, _LOOKUPS)

__all__ = ["DRAFT_METHODS", "DraftInput", "DraftMethod", "Proposer", "make_proposer"]


def make_proposer(name: str, **options) -> Proposer:
    if name not in DRAFT_METHODS:
        raise SpecrtError(f"unknown draft method {name!r}; choose one of {', '.join(DRAFT_METHODS)}.")
    try:
        return DRAFT_METHODS[name].make(**options)
    except TypeError as e:
        raise SpecrtError(f"bad options for draft method {name!r}: {e}") from None
