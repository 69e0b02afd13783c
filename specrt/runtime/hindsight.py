"""Hindsight: how deep each lookup draft would have been accepted, read from the tokens its row
emitted after it, whether the draft was verified or not.

A lookup drafts on every step (drafts/base.py, `lookup`) and most of its drafts are never
verified: the plan judged them not worth the step's extra cost. What the target emits next still
says how each would have fared. The nodes of a draft along the emitted tokens are the ones a
verification would have accepted: for a greedy row exactly (a verified draft's reading is its
verdict); for a sampled row, a point mass is accepted with the target's probability of its token,
which is the chance that the emitted token is that token, so the reading is unbiased. The cost
model thus learns each evidence's acceptance from every draft, at no cost, and never verifies a
draft only to find out whether drafts like it pay.

A draft is followed as its row emits, depth by depth: a node whose token was emitted is a hit;
the first emitted token that no child of the reached node carries is a miss, and so is a node
without children before the draft's size is used up (its next depth was asked for and not
drafted, as the cost model counts it); either ends the reading. A row that ends leaves its open
drafts unread: their next verdict is unknown, and guessing it would bias the counts.
"""

from __future__ import annotations

import dataclasses

from specrt.runtime.verification import DraftTree


@dataclasses.dataclass
class Reading:
    """What became known of one draft: `hits` more accepted depths after the first `depth`, and
    whether that is where it ended (a miss, or a leaf)."""

    evidence: tuple
    size: int  # the draft's nodes (what the plan could have asked for)
    depth: int  # depths known before this reading
    hits: int
    ended: bool


@dataclasses.dataclass
class _Open:
    tokens: list[int]
    parents: list[int]
    evidence: tuple
    start: int  # where in the row's output the tokens after the draft's root begin
    node: int = -1  # the node the emitted tokens reached (-1: the root)
    depth: int = 0


class Hindsight:
    def __init__(self):
        self._rows: dict[int, list[_Open]] = {}

    def draft(self, row: int, tree: DraftTree, start: int) -> None:
        """The row drafted `tree` after its root; the tokens after the root are its output from
        index `start` on."""
        if len(tree):
            self._rows.setdefault(row, []).append(
                _Open(tree.tokens.tolist(), tree.parents.tolist(), tree.evidence, start)
            )

    def read(self, row: int, out: list[int]) -> list[Reading]:
        """The row's open drafts followed over its output so far; each one's news, and those that
        ended are dropped."""
        still, news = [], []
        for d in self._rows.get(row, ()):
            emitted = out[d.start + d.depth :]
            known, missed = d.depth, False
            for token in emitted:
                child = next((c for c, p in enumerate(d.parents) if p == d.node and d.tokens[c] == token), None)
                if child is None:
                    missed = True
                    break
                d.node, d.depth = child, d.depth + 1
            spent = not missed and d.node not in d.parents  # a leaf: nothing deeper was drafted
            if d.depth > known or missed or spent:
                news.append(Reading(d.evidence, len(d.tokens), known, d.depth - known, missed or spent))
            if not (missed or spent):
                still.append(d)
        self._rows[row] = still
        return news

    def forget(self, row: int) -> None:
        self._rows.pop(row, None)
