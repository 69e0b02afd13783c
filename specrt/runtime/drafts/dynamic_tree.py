"""EAGLE-2 dynamic draft trees: grow a tree where the draft is confident, keep the best nodes.

Glossary
    value       a node's estimate of the chance the target accepts it: the product of the
                draft's probabilities along its path from the root (EAGLE-2 observes that the
                draft's confidence tracks acceptance, so a tree can follow it instead of a
                fixed shape).
    layer       the nodes at one depth.
    frontier    the `top_k` nodes of the newest layer with the highest value: the only ones
                expanded at the next depth (one batched draft step per depth, whatever the tree).
    candidates  every node generated while growing: each expanded node's `top_k` most likely
                next tokens.

Growing: layer 1 is the root's top_k tokens; each further layer is the top_k children of each
frontier node, up to `depth` layers. Reranking: of all candidates, the `budget` with the highest
value are kept. A child's value never exceeds its parent's (probabilities are <= 1) and ties are
broken towards shallower nodes, so a kept node's ancestors are always kept: the result is a
tree. Nodes are ordered by depth, then value, so parents come before children (as DraftTree
requires) and each node's siblings are tried most likely first.

Children are the top_k tokens of the draft's distribution, not samples, so their q is a point
mass and verification stays exact under sampling too (verification.py). The draft model is
behind a callback: `TreeBuilder` only says which nodes to expand and keeps the books, so one
builder per row can share a batched draft step. A pure module: no model, no cache.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specrt.runtime.verification import DraftTree


@dataclasses.dataclass
class Candidate:
    token: int
    parent: int  # candidate index, -1 = the root
    value: float
    depth: int


class TreeBuilder:
    """The books of one row's dynamic tree: feed it the draft's distributions layer by layer."""

    def __init__(self, root_probs: np.ndarray, top_k: int, budget: int):
        if top_k < 1 or budget < 0:
            raise ValueError(f"need top_k >= 1 and budget >= 0, got top_k={top_k}, budget={budget}")
        self.top_k, self.budget = top_k, budget
        self.candidates: list[Candidate] = []
        self._layer: list[int] = []  # candidate indices of the newest layer
        self._add(-1, root_probs, 1.0, 1)

    def _add(self, parent: int, probs: np.ndarray, value: float, depth: int) -> None:
        k = min(self.top_k, len(probs))
        best = np.argpartition(-probs, k - 1)[:k]
        best = best[np.lexsort((best, -probs[best]))]  # most likely first; ties by token id (deterministic)
        for t in best:
            if probs[t] > 0:
                self.candidates.append(Candidate(int(t), parent, value * float(probs[t]), depth))
                self._layer.append(len(self.candidates) - 1)

    def frontier(self) -> list[int]:
        """Candidates to expand next: the top_k of the newest layer by value (most valuable first)."""
        layer = sorted(self._layer, key=lambda i: (-self.candidates[i].value, i))
        return layer[: self.top_k] if self.budget > 0 else []

    def path(self, node: int) -> list[int]:
        """Tokens from the root's first child down to `node`."""
        out = []
        while node >= 0:
            out.append(self.candidates[node].token)
            node = self.candidates[node].parent
        return out[::-1]

    def expand(self, probs: dict[int, np.ndarray]) -> None:
        """The draft's next-token distributions at the frontier nodes: their children are the
        new layer."""
        self._layer = []
        for node, p in probs.items():
            c = self.candidates[node]
            self._add(node, np.asarray(p, dtype=np.float64), c.value, c.depth + 1)

    def tree(self) -> DraftTree:
        """The `budget` most valuable candidates as a tree (parents first); scores = values."""
        order = sorted(
            range(len(self.candidates)), key=lambda i: (-self.candidates[i].value, self.candidates[i].depth, i)
        )
        kept = sorted(order[: self.budget], key=lambda i: (self.candidates[i].depth, -self.candidates[i].value, i))
        index = {old: new for new, old in enumerate(kept)}
        tokens, parents, values = [], [], []
        for old in kept:
            c = self.candidates[old]
            if c.parent >= 0 and c.parent not in index:
                raise AssertionError("a kept node lost its parent: values must not grow down a path")
            tokens.append(c.token)
            parents.append(index[c.parent] if c.parent >= 0 else -1)
            values.append(c.value)
        return DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64), None, np.array(values))


def grow_tree(root_probs: np.ndarray, draft_step, top_k: int, depth: int, budget: int) -> DraftTree:
    """One row's dynamic tree. draft_step(builder, nodes) -> {node: next-token probs} for the
    frontier nodes (a batched proposer drives several builders itself instead)."""
    builder = TreeBuilder(root_probs, top_k, budget)
    for _ in range(depth - 1):
        nodes = builder.frontier()
        if not nodes:
            break
        builder.expand(draft_step(builder, nodes))
    return builder.tree()
