"""Lookahead decoding (Fu et al., arXiv 2402.02057): Jacobi iteration feeding an n-gram pool, no
weights. Both of its branches ride in the tree of the target's own verification step:

    root ─┬─ pool n-gram 1 ...          verification branch: up to `max_ngrams` continuations
          ├─ pool n-gram 2 ...          of the root token from the pool (a trie: shared
          │                             prefixes are one node)
          └─ g1 ─ g2 ─ ... ─ gW         lookahead branch: the current Jacobi guess for the next
                                        W positions, a chain (each guess sees those before it)

The step's logits at the root and along the window are one Jacobi update: o_j, the target's
argmax after g_1..g_j, is the new guess for position j + 1. The window is itself a draft, so a
prefix of it is accepted whenever the iteration has converged there (Jacobi decoding), and
nothing in the step graph changes. The pool is filled from the iteration's trajectory: the
guesses of the last n - 1 iterations and the newest outputs, read along the diagonal (position
p in the oldest iteration, p + 1 in the next, ... , p + n - 1 in the outputs), where every token
is the target's own prediction after the token before it; that n-gram is kept under its first
token. With `prompt_ngrams` the context's own n-grams go into the pool too (prompt lookup).

Where this differs from the paper: the paper feeds all n - 1 iterations of its 2-D window each
step with a diagonal attention pattern, which is not a tree; here only the newest iteration is
fed (W positions instead of W (n - 1)) and the older ones are kept on the host for the
diagonal. Verification is the runtime's, so output stays exactly the target's (greedy: equal
to plain decoding; sampling: the drafts are point masses, accepted by the exact rule).

The tree's node order puts the pool's n-grams first and the window last, so the speculation
policy's budget N (which truncates trees) spends itself on the likelier drafts; a slice of it
(`window_share`, at least one node) is kept for the window, or the iteration would stall.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from specrt.runtime.verification import DraftTree


class _Row:
    """One sequence's Jacobi state: the current guess and the recent iterations (absolute
    position -> token), and its n-gram pool (first token -> continuations, newest first)."""

    def __init__(self, levels: int):
        self.guess: list[int] = []  # guesses for the positions after the root
        self.root_pos = 0  # absolute position of the root (the last context token)
        self.history: deque[dict[int, int]] = deque(maxlen=levels)  # oldest first
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.window_nodes: list[int] = []  # node index of each window guess in the last tree
        self.tail: list[int] = []  # the context's last n - 1 tokens


class LookaheadProposer:
    name = "lookahead"
    needs_features = False
    cost_per_token = False  # the lookahead branch costs target positions, not draft time
    lookup = False  # its Jacobi window advances only when verified: drafted where the plan asks

    def __init__(
        self,
        window: int = 4,
        ngram: int = 4,
        max_ngrams: int = 4,
        pool_per_token: int = 8,
        window_share: float = 0.4,
        prompt_ngrams: bool = True,
    ):
        if window < 1 or ngram < 2 or max_ngrams < 0 or pool_per_token < 1 or not 0 < window_share <= 1:
            raise ValueError(
                "need window >= 1, ngram >= 2, max_ngrams >= 0, pool_per_token >= 1, 0 < window_share <= 1; got "
                f"window={window}, ngram={ngram}, max_ngrams={max_ngrams}, pool_per_token={pool_per_token}, "
                f"window_share={window_share}"
            )
        self.window, self.ngram, self.max_ngrams = window, ngram, max_ngrams
        self.pool_per_token, self.window_share, self.prompt_ngrams = pool_per_token, window_share, prompt_ngrams
        self._rows: dict[int, _Row] = {}

    # -- contract ---------------------------------------------------------------------------------

    def begin(self, rows, prompts, prefilled):
        for b, prompt in zip(rows, prompts):
            row = _Row(self.ngram - 1)
            row.tail = list(prompt[-(self.ngram - 1) :])
            if self.prompt_ngrams:
                for i in range(len(prompt) - self.ngram + 1):
                    self._add(row, prompt[i : i + self.ngram])
            # the first guess: the prompt's own last tokens (any tokens converge; these are cheap)
            row.guess = list(prompt[-self.window :])
            row.root_pos = len(prompt)  # the first output token, the first root, sits there
            self._rows[b] = row

    def propose(self, inp) -> list[DraftTree]:
        return [self._tree(self._rows[b], ctx, inp.max_tokens) for b, ctx in zip(inp.rows, inp.contexts)]

    def commit(self, rows, trees, verdicts, step):
        for i, b in enumerate(rows):
            row, tree = self._rows[b], trees[i]
            emitted = verdicts[i].tokens(tree)
            if row.window_nodes:  # the step was a Jacobi update too: read it along the window
                argmax = step.argmax()[b, : len(tree) + 1]
                # the decoder may have verified the tree depth first: the window's nodes moved
                at = [int(np.flatnonzero(tree.proposed() == n)[0]) for n in row.window_nodes]
                self._iterate(row, [int(argmax[0]), *(int(argmax[n + 1]) for n in at)])
                row.window_nodes = []
            seq = row.tail + emitted
            if self.prompt_ngrams:  # the context's new n-grams: those ending in an emitted token
                for j in range(len(seq) - self.ngram + 1):
                    self._add(row, seq[j : j + self.ngram])
            row.tail = seq[-(self.ngram - 1) :]
            row.root_pos += len(emitted)
            row.guess = row.guess[len(emitted) :]  # guesses for the positions after the new root

    def end(self, rows, outputs):
        for b in rows:
            self._rows.pop(b, None)

    # -- the pieces ------------------------------------------------------------------------------

    def _add(self, row: _Row, gram) -> None:
        key, rest = int(gram[0]), tuple(int(t) for t in gram[1:])
        grams = row.pool.setdefault(key, OrderedDict())
        grams.pop(rest, None)
        grams[rest] = None  # newest last
        if len(grams) > self.pool_per_token:
            grams.popitem(last=False)

    def _tree(self, row: _Row, context, budget: int) -> DraftTree:
        row.window_nodes = []
        row.tail = list(context[-(self.ngram - 1) :])
        row.root_pos = len(context) - 1
        if budget <= 0:
            return DraftTree.empty()
        n_window = min(self.window, max(1, int(round(budget * self.window_share))))
        guess = (row.guess + self._filler(context))[:n_window]
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent, token) -> node

        def insert(seq) -> list[int]:
            path, parent = [], -1
            for t in seq:
                node = children.get((parent, t))
                if node is None:
                    node = len(tokens)
                    tokens.append(t)
                    parents.append(parent)
                    children[(parent, t)] = node
                path.append(node)
                parent = node
            return path

        grams = list(reversed(row.pool.get(int(context[-1]), {})))[: self.max_ngrams]  # newest first
        for gram in grams:
            if len(tokens) + len(gram) > budget - n_window:
                break
            insert(gram)
        row.window_nodes = insert(guess)
        row.guess = guess
        return DraftTree(np.array(tokens, np.int64), np.array(parents, np.int64))

    def _filler(self, context) -> list[int]:
        """Guesses past the end of the current one: the context's last tokens, repeated."""
        return list(context[-self.window :]) * 2

    def _iterate(self, row: _Row, outputs: list[int]) -> None:
        """One Jacobi update: outputs[j] is the target's argmax after the root and guesses
        1..j, the new guess for position root + j + 1. Harvest the diagonal n-grams first."""
        start = row.root_pos + 1  # absolute position of guess 1
        current = {start + j: t for j, t in enumerate(row.guess)}
        newest = {start + j: t for j, t in enumerate(outputs)}  # outputs[j] is for position start + j
        levels = [*row.history, current]
        if len(levels) >= self.ngram - 1:
            levels = levels[-(self.ngram - 1) :]
            first = min(levels[0]) if levels[0] else start
            for p in range(first, start + len(outputs)):
                gram = [levels[k].get(p + k) for k in range(len(levels))] + [newest.get(p + len(levels))]
                if None not in gram:
                    self._add(row, gram)
        row.history.append(current)
        row.guess = outputs  # the new guess for positions start ...; the caller shifts it
