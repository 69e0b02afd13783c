"""Verification: which draft tokens the target accepts, and the token it adds. A pure module.

Glossary
    root        the last committed token; the target step over [root, draft...] gives, at the
                root and at every draft node, the target distribution of the *next* token.
    draft tree  draft tokens with parent links (-1 = the root). A chain is a tree with one branch.
    accepted    draft tokens the target keeps: a path from the root down the tree.
    recovered   the token sampled by the target where it rejected every child of a node.
    bonus       the token sampled by the target after the last accepted node when that node has
                no children left to try (e.g. every token of a chain was accepted).
    Every step therefore yields len(accepted) + 1 tokens.

Greedy (temperature 0): follow the child whose token equals the target's argmax; the first node
without such a child contributes its argmax (recovered, or bonus at a leaf).

Sampling: at the current node with target distribution p, try the children in order. A child x
drawn from draft distribution q is accepted with probability min(1, p(x) / q(x)); on rejection
p becomes norm((p - q)+) and the next sibling is tried against it (recursive rejection sampling,
the multi-draft generalisation). When no child is accepted, the token is drawn from the final p.
Drafts without probabilities (n-gram, suffix) have q = a point mass on x: acceptance probability
p(x), and the residual is p with x removed. The output is distributed exactly as the target's
own samples, provided each child's q is the distribution it was drawn from given its earlier
siblings (for distinct children drawn without replacement: q with the earlier siblings removed).

Bitwise exactness (greedy): a node's logits are the bits plain decoding would compute only when
its ancestors fill the slots right before it (the leading chain: node j at depth j + 1). A node
off it sees masked siblings among its keys, and the attention's reduction over them rounds
differently (ORT's fused attention, on every engine). So trees are verified depth first
(`DraftTree.depth_first`: the proposer's best guess at every depth is the leading chain), and
`on_leading_chain` cuts a greedy verdict where its path leaves the chain: the nodes kept and the
next token (the argmax at the last kept position, which is the first dropped node's token) are
plain decoding's own; the rest is drafted again.

Randomness is passed in (a numpy Generator); nothing here touches a model or a cache.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ON_DEMAND = 0  # DraftTree.evidence's match length for a draft made only when it is served


@dataclasses.dataclass
class DraftTree:
    tokens: np.ndarray  # (n,) int64 draft tokens
    parents: np.ndarray  # (n,) int64 parent node index, -1 = root; parents come before children
    q: np.ndarray | None = None  # (n, V) distribution each token was drawn from; None = point masses
    scores: np.ndarray | None = None  # (n,) proposer's estimate that each node is accepted (optional)
    # what the proposer knew when it drafted, as a class the cost model keeps acceptance for
    # (a lookup: its method and the length of the match it continues, drafts/base.match_evidence;
    # a member that drafts only when served, auto's head or draft model: its name and ON_DEMAND)
    evidence: tuple = ()
    # drafts made beside this one and not chosen (drafts/auto.py): hindsight reads them too
    rivals: tuple = ()
    # (n,) each node's index in its row's proposal (the tree the proposer returned), -1 for a node
    # the proposer did not draft (a grammar's forced token, the floor's guess); None: node i is the
    # proposal's node i. Cutting, re-ordering and forced tokens in front keep it (`proposed`).
    origin: np.ndarray | None = None

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, dtype=np.int64)
        self.parents = np.asarray(self.parents, dtype=np.int64)
        if self.tokens.shape != self.parents.shape:
            raise ValueError(f"tokens {self.tokens.shape} and parents {self.parents.shape} differ in length")
        if len(self.parents) and ((self.parents >= np.arange(len(self.parents))) | (self.parents < -1)).any():
            raise ValueError(f"every parent must come before its child: parents={self.parents.tolist()}")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens, q=None, scores=None, evidence: tuple = ()) -> "DraftTree":
        tokens = np.asarray(tokens, dtype=np.int64)
        return cls(tokens, np.arange(len(tokens)) - 1, q, scores, evidence)

    @classmethod
    def empty(cls) -> "DraftTree":
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))

    @classmethod
    def imposed(cls, tokens) -> "DraftTree":
        """A chain of point masses no proposer drafted (a grammar's forced tokens, the floor's
        guess): every node's origin is -1."""
        tokens = np.asarray(tokens, dtype=np.int64)
        return cls(tokens, np.arange(len(tokens)) - 1, origin=np.full(len(tokens), -1, np.int64))

    def proposed(self) -> np.ndarray:
        """(n,) each node's index in its row's proposal, -1 where the proposer drafted none."""
        return np.arange(len(self), dtype=np.int64) if self.origin is None else self.origin

    def depths(self) -> np.ndarray:
        """(n,) depth of each node; children of the root have depth 1."""
        d = np.zeros(len(self), dtype=np.int64)
        for i, p in enumerate(self.parents):
            d[i] = 1 if p < 0 else d[p] + 1
        return d

    def ancestor_mask(self) -> np.ndarray:
        """(n+1, n+1) bool over [root, nodes...]: entry (i, j) is True when j is i or an ancestor of i."""
        n = len(self)
        m = np.zeros((n + 1, n + 1), dtype=bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents):
            m[i + 1] = m[p + 1] if p >= 0 else m[0]
            m[i + 1, i + 1] = True
        return m

    def children(self, node: int) -> np.ndarray:
        """Indices of the children of `node` (-1 = root), in draft order."""
        return np.flatnonzero(self.parents == node)

    def truncate(self, n: int) -> "DraftTree":
        """The first n nodes (a valid tree since parents come first); the tree itself when it has
        no more (trees are not changed once made)."""
        if n >= len(self):
            return self
        return DraftTree(
            self.tokens[:n],
            self.parents[:n],
            None if self.q is None else self.q[:n],
            None if self.scores is None else self.scores[:n],
            self.evidence,
            origin=None if self.origin is None else self.origin[:n],
        )

    def preorder(self) -> np.ndarray | None:
        """The node order of `depth_first` (preorder, children in draft order); None when it is
        the tree's own."""
        n = len(self)
        children: list[list[int]] = [[] for _ in range(n + 1)]  # per node (the root first)
        for i, p in enumerate(self.parents.tolist()):
            children[p + 1].append(i)
        order, stack = [], children[0][::-1]
        while stack:
            i = stack.pop()
            order.append(i)
            stack.extend(children[i + 1][::-1])
        return None if order == list(range(n)) else np.array(order, np.int64)

    def depth_first(self) -> "DraftTree":
        """The same tree with every node's first child right after it (`preorder`), so its
        leading chain is the path of first children: the proposer's best guess at every depth.
        `origin` follows the nodes; the tree itself when nothing moves."""
        order = self.preorder()
        return self if order is None else self.reordered(order)

    def reordered(self, order: np.ndarray) -> "DraftTree":
        """The nodes in `order` (a permutation that keeps parents before children)."""
        index = np.empty(len(self), np.int64)
        index[order] = np.arange(len(self))
        parents = self.parents[order]
        return dataclasses.replace(
            self,
            tokens=self.tokens[order],
            parents=np.where(parents < 0, -1, index[np.maximum(parents, 0)]),
            q=None if self.q is None else self.q[order],
            scores=None if self.scores is None else self.scores[order],
            origin=self.proposed()[order],
        )

    def behind(self, tokens) -> "DraftTree":
        """This tree drafted after a chain of `tokens` (point masses: a grammar's forced tokens,
        runtime/grammar.py): the chain first, then the tree under its last node."""
        k = len(tokens)
        if not k:
            return self
        parents = np.concatenate([np.arange(k) - 1, np.where(self.parents < 0, k - 1, self.parents + k)])
        q = None
        if self.q is not None:  # a point mass is a one-hot q
            q = np.concatenate([np.eye(self.q.shape[1], dtype=self.q.dtype)[list(tokens)], self.q])
        scores = None if self.scores is None else np.concatenate([np.ones(k), self.scores])
        origin = np.concatenate([np.full(k, -1, np.int64), self.proposed()])
        tokens = np.concatenate([np.asarray(tokens, np.int64), self.tokens])
        return DraftTree(tokens, parents, q, scores, self.evidence, origin=origin)


@dataclasses.dataclass
class Verdict:
    accepted: list[int]  # accepted node indices, root to leaf
    next_token: int  # the recovered or bonus token

    def tokens(self, tree: DraftTree) -> list[int]:
        """Every token this step emits: the accepted drafts, then next_token."""
        return [int(tree.tokens[i]) for i in self.accepted] + [int(self.next_token)]


def accept_greedy(tree: DraftTree, target_argmax: np.ndarray) -> Verdict:
    """target_argmax: (n+1,) argmax of the target at the root (row 0) and at each node (row i+1)."""
    if not len(tree):  # plain decoding's step: the root's argmax
        return Verdict([], int(target_argmax[0]))
    accepted, node = [], -1
    while True:
        want = int(target_argmax[node + 1])
        match = [c for c in tree.children(node) if tree.tokens[c] == want]
        if not match:
            return Verdict(accepted, want)
        node = int(match[0])
        accepted.append(node)


def on_leading_chain(tree: DraftTree, verdict: Verdict) -> Verdict:
    """A greedy verdict cut where its path leaves the tree's leading chain (module docstring):
    the accepted nodes j = 0, 1, ... while node j is the j-th accepted, then the first other
    accepted node's token as the next token (the target's argmax where the kept path ends)."""
    for j, node in enumerate(verdict.accepted):
        if node != j:
            return Verdict(verdict.accepted[:j], int(tree.tokens[node]))
    return verdict


def accept_sampling(tree: DraftTree, target_probs: np.ndarray, rng: np.random.Generator) -> Verdict:
    """target_probs: (n+1, V) target distributions (after temperature/top-k/top-p) at the root and
    at each node. Recursive rejection over siblings; see the module docstring."""
    accepted, node = [], -1
    while True:
        p = target_probs[node + 1].astype(np.float64, copy=True)
        next_node = None
        for c in tree.children(node):
            x = int(tree.tokens[c])
            if tree.q is None:  # point mass on x
                if rng.random() < p[x]:
                    next_node = int(c)
                    break
                p[x] = 0.0
            else:
                q = tree.q[c]
                if q[x] > 0 and rng.random() < min(1.0, p[x] / q[x]):
                    next_node = int(c)
                    break
                p = np.maximum(p - q, 0.0)
            total = p.sum()
            if total <= 0:  # p was covered by the drafts; only reachable with probability 0
                p = target_probs[node + 1].astype(np.float64, copy=True)
                total = p.sum()
            p /= total
        if next_node is None:
            cdf = np.cumsum(p)
            token = int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(p) - 1))
            return Verdict(accepted, token)
        accepted.append(next_node)
        node = next_node
