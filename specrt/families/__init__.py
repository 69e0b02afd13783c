"""The trained draft families, one unit each: a module per family (eagle.py: EAGLE-1, EAGLE-3
and MTP; parallel.py: the parallel EAGLE-3 head; medusa.py; draft_model.py) declares in one
`Family` everything the three layers need of it, and the three registries read from here:

    schema/head_io.py HEAD_FAMILIES     the head's graph: I/O, own KV cache or not, its module
    training/families.py TRAINED_FAMILIES   its trainer: config, training function, options it reads
    runtime/drafts DRAFT_METHODS        its proposer: how it is made, whether it takes trees

and benchmark.py runs `--draft auto` with each family that declares `in_auto`. A new family is
its own files (module, trainer, proposer) and one `Family`, registered here at import (the
built-in ones, below) or by `register` (tests/test_families.py defines a toy family in the test
alone, which trains, exports, builds and drafts with no edit elsewhere).

References are "module:attribute" strings, imported when used, or the objects themselves: this
package imports nothing of specrt, so every layer may read it and the CLI's choices cost no
torch import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

from specrt.families import draft_model, eagle, medusa, parallel
from specrt.families.base import Drafting, Family, HeadGraph, Training, load

__all__ = ["Drafting", "Family", "HeadGraph", "Training", "View", "families", "load", "register", "unregister"]

_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family (or replace one of the same name); every registry sees it at once."""
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    _FAMILIES.pop(name, None)


def families() -> dict[str, Family]:
    return dict(_FAMILIES)


class View(Mapping):
    """A registry read from the families: name -> select(family), for the families where it is
    not None, after the entries of `base`; live, so a family registered later is in it."""

    def __init__(self, select: Callable[[Family], Any], base: Mapping | None = None):
        self._select, self._base = select, base if base is not None else {}

    def _current(self) -> dict:
        picked = {n: self._select(f) for n, f in _FAMILIES.items()}
        return {**self._base, **{n: v for n, v in picked.items() if v is not None}}

    def __getitem__(self, name):
        return self._current()[name]

    def __iter__(self) -> Iterator:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())

    def __setitem__(self, name, value) -> None:
        """An entry of the base (a draft without weights: runtime/drafts DRAFT_METHODS); a
        family is added by `register`."""
        self._base[name] = value

    def __delitem__(self, name) -> None:
        del self._base[name]


# the built-in families
for _module in (eagle, parallel, medusa, draft_model):
    for _family in _module.FAMILIES:
        register(_family)
