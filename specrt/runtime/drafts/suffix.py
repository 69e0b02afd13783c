"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): draft trees from suffix tries over the
current request (prompt and output so far) and over the outputs of earlier requests.

A trie of depth D holds every substring of length <= D with its count. To propose, the longest
suffix of the context that occurs with a continuation is found (the match, length m); from its
node a tree is grown best-first by frequency: a child's score is its parent's score times the
fraction of the parent's continuations that go through it, an estimate of the probability the
target accepts it. At most min(max_tokens, ceil(spec_factor * m)) nodes with score >= min_score
are kept, so long matches speculate far and short ones little. The request trie and the global
trie each propose; the tree with the larger expected accepted length (sum of scores) is used.
"""

from __future__ import annotations

import heapq
import itertools
import math

import numpy as np

from specrt.runtime.drafts.base import match_evidence
from specrt.runtime.verification import DraftTree


class _Node:
    __slots__ = ("children", "count", "depth")

    def __init__(self, depth: int):
        self.children: dict[int, _Node] = {}
        self.count = 0
        self.depth = depth


class SuffixTrie:
    """All substrings (up to max_depth tokens) of the sequences fed to it, with counts."""

    def __init__(self, max_depth: int = 64):
        self.max_depth = max_depth
        self.root = _Node(0)
        self._open: list[_Node] = []  # nodes of the suffixes ending at the last token fed
        self.fed = 0  # tokens fed into the current sequence

    def append(self, token: int) -> None:
        nxt = []
        for node in itertools.chain(self._open, (self.root,)):
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(node.depth + 1)
            child.count += 1
            if child.depth < self.max_depth:
                nxt.append(child)
        self._open = nxt
        self.fed += 1

    def extend(self, tokens) -> None:
        for t in tokens:
            self.append(int(t))

    def end_sequence(self) -> None:
        """The next token fed starts a new sequence (no substring spans the boundary)."""
        self._open = []
        self.fed = 0

    def _walk(self, tokens) -> _Node | None:
        node = self.root
        for t in tokens:
            node = node.children.get(int(t))
            if node is None:
                return None
        return node

    def match(self, context, max_match: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` (<= max_match tokens) that has a continuation."""
        for m in range(min(max_match, len(context), self.max_depth - 1), 0, -1):
            node = self._walk(context[len(context) - m :])
            if node is not None and node.children:
                return node, m
        return None, 0

    def match_fed(self, max_match: int) -> tuple[_Node | None, int]:
        """`match` of the sequence this trie was fed: the nodes of its suffixes are the open ones
        (deepest first), so the longest with a continuation is found without walking from the
        root (a walk per length was ~0.1 ms a step, beside an 11-16 ms target step)."""
        for node in self._open:
            if node.depth <= max_match and node.children:
                return node, node.depth
        return None, 0

    @staticmethod
    def grow(node: _Node, budget: int, min_score: float) -> DraftTree:
        """Best-first tree of at most `budget` nodes below `node`, scored by frequency."""
        tokens, parents, scores = [], [], []
        tie = itertools.count()
        heap: list = []

        def push_children(n: _Node, parent_index: int, score: float):
            total = sum(c.count for c in n.children.values())
            for tok, c in n.children.items():
                s = score * c.count / total
                if s >= min_score:
                    heapq.heappush(heap, (-s, next(tie), tok, c, parent_index))

        push_children(node, -1, 1.0)
        while heap and len(tokens) < budget:
            neg, _, tok, c, parent = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent)
            scores.append(-neg)
            push_children(c, len(tokens) - 1, -neg)
        return DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64), None, np.array(scores))


class SuffixProposer:
    name = "suffix"
    needs_features = False
    cost_per_token = False  # growing a tree from a trie costs about the same for any size here
    lookup = True  # cheap enough to draft every step: the plan sees each tree and its evidence first

    def __init__(
        self,
        max_depth: int = 48,
        max_match: int = 32,
        spec_factor: float = 2.0,
        min_score: float = 0.1,
        max_outputs: int = 4096,
    ):
        self.max_depth, self.max_match = max_depth, max_match
        self.spec_factor, self.min_score = spec_factor, min_score
        self.global_trie = SuffixTrie(max_depth)  # outputs of earlier requests
        self.max_outputs = max_outputs
        self._outputs = 0
        self._requests: dict[int, SuffixTrie] = {}

    def begin(self, rows, prompts, prefilled):
        for row, prompt in zip(rows, prompts):
            trie = SuffixTrie(self.max_depth)
            trie.extend(prompt)
            self._requests[row] = trie

    def commit(self, rows, trees, verdicts, step):
        pass  # the request trie catches up from the context at the next proposal

    def end(self, rows, outputs):
        for row, output in zip(rows, outputs):
            self._requests.pop(row, None)
            if self._outputs >= self.max_outputs:  # bound memory: start a fresh global trie
                self.global_trie, self._outputs = SuffixTrie(self.max_depth), 0
            self.global_trie.extend(output)
            self.global_trie.end_sequence()
            self._outputs += 1

    def propose(self, inp) -> list[DraftTree]:
        return [self.draft(row, ctx, inp.max_tokens) for row, ctx in zip(inp.rows, inp.contexts)]

    def draft(self, row: int, context, max_tokens: int) -> DraftTree:
        if max_tokens <= 0:
            return DraftTree.empty()
        trie = self._requests.get(row)
        if trie is None:
            trie = self._requests[row] = SuffixTrie(self.max_depth)
        trie.extend(context[trie.fed :])  # context only grows: feed what is new
        best = DraftTree.empty()
        for t in (trie, self.global_trie):  # the request trie was fed the context: its open nodes are its suffixes
            node, m = t.match_fed(self.max_match) if t is trie else t.match(context, self.max_match)
            if node is None:
                continue
            budget = min(max_tokens, math.ceil(self.spec_factor * m))
            tree = SuffixTrie.grow(node, budget, self.min_score)
            if len(tree) and (not len(best) or tree.scores.sum() > best.scores.sum()):
                best = tree
                best.evidence = match_evidence(self.name, m)
        return best
