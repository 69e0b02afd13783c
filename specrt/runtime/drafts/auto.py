"""`auto`: per row and step, the copy draft that has served that row best so far.

The copy drafts (suffix, n-gram) cost a lookup each, so every one of them proposes for every
drafting row on every step, and the row gets the proposal of the method with the highest
estimate of accepted tokens for that row (among those that proposed anything). After
verification every method's proposal is scored against what the target emitted, the accepted
drafts and the next token: the depth to which its tree follows those tokens (`follows`), which is
how many of its tokens the step would have accepted (exactly, for a greedy row, short of the
emitted length; a tree that follows all of them might have gone further, so the score is a lower
bound that treats every method alike). Scores are decayed means per row and method (ROW_DECAY per
step: text changes its kind within one answer), with the method's mean over all rows as a prior
worth PRIOR_STEPS steps (what a new request starts from).

Why not one tree of both: the verification step pays for every position it computes, and the two
lookups mostly propose the same tokens where both match, so their union costs positions for
little. Why the choice is lossless: it reads only what was emitted before the step, so each step
verifies a tree fixed before the target is consulted, as any draft's; its trees are point masses.

Which text suits which: n-gram (the most recent copy of the last few tokens) wins where the answer
quotes its prompt in order (summaries), suffix (a trie over the prompt and earlier answers, a tree
of continuations) where the text repeats with variants (code edits, JSON).
"""

from __future__ import annotations

import collections

import numpy as np

from specrt.runtime.drafts.base import DraftInput
from specrt.runtime.drafts.ngram import NgramProposer
from specrt.runtime.drafts.suffix import SuffixProposer
from specrt.runtime.verification import DraftTree

ROW_DECAY = 0.9  # a row's scores: weight of the past per step
GLOBAL_DECAY = 0.99  # the methods' means over all rows
PRIOR_STEPS = 2.0  # the global mean's weight in a row's estimate, in steps


def follows(tree: DraftTree, emitted: list[int]) -> int:
    """How deep `tree` follows `emitted` from the root: the tokens of it a step that emitted these
    would have accepted."""
    node, depth = -1, 0
    while depth < len(emitted):
        kids = [c for c in tree.children(node) if tree.tokens[c] == emitted[depth]]
        if not kids:
            break
        node, depth = kids[0], depth + 1
    return depth


class AutoProposer:
    name = "auto"
    needs_features = False
    cost_per_token = False  # lookups: about the same for any length
    lookup = True  # its members are

    def __init__(self, methods: dict | None = None):
        # members must be lookups: stateless but for begin/end (their commit ignores the trees,
        # which are the chosen method's)
        self.methods = methods or {"suffix": SuffixProposer(), "ngram": NgramProposer()}
        m = len(self.methods)
        self._sum, self._weight = np.zeros(m), np.zeros(m)  # global decayed sums and weights
        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row -> (sums, weights)
        self._proposed: dict[int, list[DraftTree]] = {}  # row -> this step's proposal per method
        self.chosen = collections.Counter()  # trees given per method (for the benchmark)

    def begin(self, rows, prompts, prefilled):
        for b in rows:
            self._rows.pop(b, None)
        for method in self.methods.values():
            method.begin(rows, prompts, prefilled)

    def _row(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """The row's decayed (sums, weights) per method; zeros for a row not yet scored."""
        return self._rows.get(row) or (np.zeros(len(self.methods)), np.zeros(len(self.methods)))

    def estimates(self, row: int) -> np.ndarray:
        """(methods,) expected accepted tokens per step for this row, by method."""
        prior = (self._sum + 0.5 * PRIOR_STEPS) / (self._weight + PRIOR_STEPS)  # half a token before any
        sums, weights = self._row(row)
        return (sums + PRIOR_STEPS * prior) / (weights + PRIOR_STEPS)

    def propose(self, inp: DraftInput) -> list[DraftTree]:
        per_method = [method.propose(inp) for method in self.methods.values()]
        names = list(self.methods)
        out = []
        for i, b in enumerate(inp.rows):
            proposals = [trees[i] for trees in per_method]
            self._proposed[b] = proposals
            order = np.argsort(-self.estimates(b), kind="stable")  # ties: the registry's order
            pick = next((int(k) for k in order if len(proposals[k])), None)
            out.append(DraftTree.empty() if pick is None else proposals[pick])
            if pick is not None:
                self.chosen[names[pick]] += 1
        return out

    def commit(self, rows, trees, verdicts, step):
        for b, tree, verdict in zip(rows, trees, verdicts):
            proposals = self._proposed.pop(b, None)
            if proposals is None:  # the row did not draft this step
                continue
            emitted = verdict.tokens(tree)
            scores = np.array([follows(p, emitted) for p in proposals], dtype=np.float64)
            sums, weights = self._row(b)
            self._rows[b] = (sums * ROW_DECAY + scores, weights * ROW_DECAY + 1.0)
            self._sum = self._sum * GLOBAL_DECAY + scores
            self._weight = self._weight * GLOBAL_DECAY + 1.0
        for method in self.methods.values():
            method.commit(rows, trees, verdicts, step)

    def end(self, rows, outputs):
        for b in rows:
            self._rows.pop(b, None)
            self._proposed.pop(b, None)
        for method in self.methods.values():
            method.end(rows, outputs)
