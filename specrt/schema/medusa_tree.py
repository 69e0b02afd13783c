"""Medusa's tree of choices: which candidates of which heads one step verifies, as paths of ranks
(path (r1, r2) = the r1-th candidate of head 1, then the r2-th of head 2 under it). Derived from
the heads' rank accuracies, measured by training (training.json "tree") or assumed
(`DEFAULT_RANK_ACCURACY`); the proposer (runtime/drafts/medusa.py) checks a tree it is given.
Topology only: no torch, no I/O.
"""

from __future__ import annotations

import heapq

from specrt.errors import SpecrtError

# rank accuracies assumed for the default tree (plain data, not measured here): rank r of head
# d + 1 is right this often, about what Medusa's paper reports for its 7B heads (head 1 top-1 ~0.6,
# falling by head); a trained head's own measured accuracies replace them (training.json "tree")
DEFAULT_RANK_ACCURACY = (
    (0.55, 0.12, 0.05, 0.03, 0.02, 0.01),
    (0.35, 0.10, 0.05, 0.03, 0.02, 0.01),
    (0.25, 0.08, 0.04, 0.02, 0.01, 0.01),
    (0.20, 0.07, 0.03, 0.02, 0.01, 0.01),
)
DEFAULT_TREE_SIZE = 24


def derive_tree(rank_accuracy, budget: int) -> tuple[tuple[int, ...], ...]:
    """The `budget` most valuable paths, best first, from rank_accuracy[d][r]: the share of
    positions where head d + 1's rank-r candidate is the right token. A path's value is the
    product of its ranks' accuracies (the chance the whole path is accepted, heads taken as
    independent); a path is only offered once its parent is taken, so the result is a tree
    whose every prefix (any truncation) is a tree too."""
    depth = len(rank_accuracy)
    heap = [(-float(rank_accuracy[0][r]), (r,)) for r in range(len(rank_accuracy[0]))]
    heapq.heapify(heap)
    out: list[tuple[int, ...]] = []
    while heap and len(out) < budget:
        neg, path = heapq.heappop(heap)
        if -neg <= 0:
            break
        out.append(path)
        if len(path) < depth:
            for r in range(len(rank_accuracy[len(path)])):
                heapq.heappush(heap, (neg * float(rank_accuracy[len(path)][r]), (*path, r)))
    return tuple(out)


def check_tree(tree, num_heads: int, top_k: int) -> tuple[tuple[int, ...], ...]:
    """The tree as tuples, refused unless every path fits the heads and comes after its parent."""
    tree = tuple(tuple(int(r) for r in p) for p in tree)
    seen: set[tuple[int, ...]] = set()
    for p in tree:
        if not p or len(p) > num_heads or min(p) < 0 or max(p) >= top_k:
            raise SpecrtError(f"Medusa tree path {list(p)} does not fit {num_heads} heads of {top_k} candidates")
        if len(p) > 1 and p[:-1] not in seen:
            raise SpecrtError(f"Medusa tree path {list(p)} comes before its parent {list(p[:-1])}")
        if p in seen:
            raise SpecrtError(f"Medusa tree path {list(p)} appears twice")
        seen.add(p)
    return tree


def default_tree(num_heads: int = 4, top_k: int = 8) -> tuple[tuple[int, ...], ...]:
    """The tree for heads whose own accuracies are unknown: derive_tree of the assumed ones
    (DEFAULT_RANK_ACCURACY; heads past the fourth assumed as good as the fourth)."""
    rows = [DEFAULT_RANK_ACCURACY[min(d, len(DEFAULT_RANK_ACCURACY) - 1)][:top_k] for d in range(num_heads)]
    return derive_tree(rows, DEFAULT_TREE_SIZE)


# the tree of choices for K = 4 heads of 8 candidates, best first
DEFAULT_TREE = default_tree()
