"""n-gram / prompt lookup: find the context's last n tokens earlier in the context and propose
what followed them there (no weights, no probabilities: q is a point mass).

The longest n in [n_min, n_max] with a match wins; among matches of that n the most recent one
is used (for edits of pasted code the nearest copy is the one being rewritten).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specrt.runtime.verification import DraftTree


class NgramProposer:
    name = "ngram"
    needs_features = False
    cost_per_token = False  # a lookup costs about the same for any draft length

    def __init__(self, n_min: int = 2, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max

    def begin(self, rows, prompts, prefilled):
        pass

    def commit(self, rows, trees, verdicts, step):
        pass

    def end(self, rows, outputs):
        pass

    def propose(self, inp) -> list[DraftTree]:
        return [self.lookup(ctx, inp.max_tokens) for ctx in inp.contexts]

    def lookup(self, context, max_tokens: int) -> DraftTree:
        """The chain that followed the longest recent match of the context's last n tokens."""
        ctx = np.asarray(context, dtype=np.int64)
        L = len(ctx)
        if max_tokens <= 0:
            return DraftTree.empty()
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            # windows that start at 0 .. L-1-n: each has at least one token after it
            windows = sliding_window_view(ctx[: L - 1], n)
            hits = np.flatnonzero((windows == ctx[L - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return DraftTree.chain(ctx[start : start + max_tokens])
        return DraftTree.empty()
