"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): draft trees from the current request
(prompt and output so far) and from the outputs of earlier requests, as a suffix tree of each
would give them.

To propose, the longest suffix of the context that occurred before with a continuation is found
(the match, length m); the continuations of its occurrences form a tree, grown best-first by
frequency: a child's score is its parent's score times the fraction of the parent's
continuations that go through it, an estimate of the probability the target accepts it. At most
min(max_tokens, ceil(spec_factor * m)) nodes with score >= min_score are kept, so long matches
speculate far and short ones little. The request and the earlier outputs each propose; the tree
with the larger expected accepted length (sum of scores) is used.

Why an index of occurrences rather than a suffix trie: a trie holds every substring up to its
depth, ~35 new nodes per token at depth 48 (33 us a token here, and gigabytes for the earlier
outputs of a long-running server); the index appends each token to two lists (where it occurs,
and where the pair it ends occurs), and a proposal reads the few occurrences of the context's
last tokens. Both give the same trees, up to a bound on how many occurrences are read
(CANDIDATES, the most recent).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math

import numpy as np

from specrt.runtime.drafts.base import match_evidence
from specrt.runtime.verification import DraftTree

SEP = -1  # ends a sequence in an index: no match or continuation runs across it
CANDIDATES = 64  # occurrences of a suffix's last tokens a proposal reads (the most recent)


class SuffixIndex:
    """Sequences of tokens with, for every token and every pair of tokens, the positions where
    they occur (a pair: the position of its second token)."""

    def __init__(self):
        self.tokens: list[int] = []
        self._ones: collections.defaultdict[int, list[int]] = collections.defaultdict(list)
        self._twos: collections.defaultdict[tuple[int, int], list[int]] = collections.defaultdict(list)
        self.fed = 0  # tokens of the current sequence

    def extend(self, tokens) -> None:
        seq = self.tokens
        for t in tokens:
            t = int(t)
            i = len(seq)
            seq.append(t)
            self._ones[t].append(i)
            if self.fed:
                self._twos[(seq[i - 1], t)].append(i)
            self.fed += 1

    def end_sequence(self) -> None:
        """The next token fed starts a new sequence."""
        self.tokens.append(SEP)
        self.fed = 0

    def match(self, context, max_match: int) -> tuple[int, list[int]]:
        """(m, ends): the longest m <= max_match such that the context's last m tokens occurred
        here followed by a token, and where those occurrences end (oldest first); (0, [])
        when not even the last token did."""
        seq, n = self.tokens, len(self.tokens)
        if not context or max_match < 1:
            return 0, []
        if len(context) >= 2 and max_match >= 2:
            ends = [i for i in self._twos.get((context[-2], context[-1]), ())[-CANDIDATES:] if i + 1 < n]
            ends = [i for i in ends if seq[i + 1] != SEP]
            if ends:
                most = min(max_match, len(context))
                lengths = []
                for i in ends:  # how far back each occurrence agrees with the context
                    k = 2
                    while k < most and k <= i and seq[i - k] == context[-1 - k]:
                        k += 1
                    lengths.append(k)
                m = max(lengths)
                return m, [i for i, k in zip(ends, lengths) if k == m]
        ends = [i for i in self._ones.get(context[-1], ())[-CANDIDATES:] if i + 1 < n and seq[i + 1] != SEP]
        return (1, ends) if ends else (0, [])

    def grow(self, ends: list[int], budget: int, min_score: float) -> DraftTree:
        """Best-first tree of at most `budget` nodes over the continuations after `ends`, scored
        by frequency (siblings in the order their token first followed)."""
        root: dict[int, list] = {}  # token -> [count, children], as a trie of the continuations
        seq = self.tokens
        for i in ends:
            node = root
            for t in seq[i + 1 : i + 1 + budget]:  # a tree of `budget` nodes is at most that deep
                if t == SEP:
                    break
                child = node.get(t)
                if child is None:
                    child = node[t] = [0, {}]
                child[0] += 1
                node = child[1]
        tokens, parents, scores = [], [], []
        tie = itertools.count()
        heap: list = []

        def push_children(children: dict, parent_index: int, score: float):
            total = sum(c[0] for c in children.values())
            for tok, c in children.items():
                s = score * c[0] / total
                if s >= min_score:
                    heapq.heappush(heap, (-s, next(tie), tok, c[1], parent_index))

        push_children(root, -1, 1.0)
        while heap and len(tokens) < budget:
            neg, _, tok, children, parent = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent)
            scores.append(-neg)
            push_children(children, len(tokens) - 1, -neg)
        return DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64), None, np.array(scores))


class SuffixProposer:
    name = "suffix"
    needs_features = False
    cost_per_token = False  # growing a tree from the index costs about the same for any size here
    lookup = True  # cheap enough to draft every step: the plan sees each tree and its evidence first

    def __init__(
        self,
        max_match: int = 32,
        spec_factor: float = 2.0,
        min_score: float = 0.1,
        max_global_tokens: int = 1 << 20,
    ):
        self.max_match = max_match
        self.spec_factor, self.min_score = spec_factor, min_score
        self.earlier = SuffixIndex()  # outputs of earlier requests
        self.max_global_tokens = max_global_tokens
        self._requests: dict[int, SuffixIndex] = {}

    def begin(self, rows, prompts, prefilled):
        for row, prompt in zip(rows, prompts):
            index = SuffixIndex()
            index.extend(prompt)
            self._requests[row] = index

    def commit(self, rows, trees, verdicts, step):
        pass  # the request's index catches up from the context at the next proposal

    def end(self, rows, outputs):
        for row, output in zip(rows, outputs):
            self._requests.pop(row, None)
            if len(self.earlier.tokens) + len(output) > self.max_global_tokens:  # bound memory: start afresh
                self.earlier = SuffixIndex()
            self.earlier.extend(output)
            self.earlier.end_sequence()

    def propose(self, inp) -> list[DraftTree]:
        return [self.draft(row, ctx, inp.max_tokens, inp.judge) for row, ctx in zip(inp.rows, inp.contexts)]

    def draft(self, row: int, context, max_tokens: int, judge=None) -> DraftTree:
        if max_tokens <= 0:
            return DraftTree.empty()
        index = self._requests.get(row)
        if index is None:
            index = self._requests[row] = SuffixIndex()
        index.extend(context[index.fed :])  # the context only grows: feed what is new
        best = DraftTree.empty()
        for source in (index, self.earlier):
            m, ends = source.match(context, self.max_match)
            if not ends:
                continue
            budget, evidence = min(max_tokens, math.ceil(self.spec_factor * m)), match_evidence(self.name, m)
            if judge is not None:  # the first nodes best-first are the same for any budget
                budget = judge(evidence, budget)[0]
            if budget <= 0:
                continue
            tree = source.grow(ends, budget, self.min_score)
            if len(tree) and (not len(best) or tree.scores.sum() > best.scores.sum()):
                best = tree
                best.evidence = evidence
        return best
