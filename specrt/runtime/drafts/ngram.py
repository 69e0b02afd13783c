"""n-gram / prompt lookup: find the context's last n tokens earlier in the context and propose
what followed them there (no weights, no probabilities: q is a point mass).

The longest n in [n_min, n_max] with a match wins; among matches of that n the most recent one
is used (for edits of pasted code the nearest copy is the one being rewritten).

Each row keeps an index (n-gram -> where it last started) that grows with its context, so a
lookup costs a few dictionary reads, not a scan of the whole context (which `--draft auto` pays
on every step beside the suffix draft's).
"""

from __future__ import annotations

from specrt.runtime.drafts.base import MATCH_BUCKETS, match_evidence
from specrt.runtime.verification import DraftTree


class _Index:
    """Where each n-gram of one context last started, for n in [n_min, n_max], among those with
    a token after them (so the context's own last n tokens are not their own match)."""

    def __init__(self, n_min: int, n_max: int):
        self.starts: dict[int, dict[tuple, int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.ends = 0  # every n-gram ending before this position is in
        self.seen = 0  # the length of the context last indexed

    def extend(self, ctx: list[int]) -> None:
        for end in range(self.ends, len(ctx) - 1):  # n-grams ending at `end` have ctx[end + 1] after them
            for n, starts in self.starts.items():
                if end + 1 >= n:
                    starts[tuple(ctx[end + 1 - n : end + 1])] = end + 1 - n
        self.ends, self.seen = max(self.ends, len(ctx) - 1), len(ctx)


class NgramProposer:
    name = "ngram"
    needs_features = False
    cost_per_token = False  # a lookup costs about the same for any draft length
    lookup = True  # cheap enough to draft every step: the plan sees each chain and its evidence first

    def __init__(self, n_min: int = 2, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max
        self._rows: dict[int, _Index] = {}

    def begin(self, rows, prompts, prefilled):
        for b in rows:
            self._rows.pop(b, None)

    def commit(self, rows, trees, verdicts, step):
        pass  # the index catches up from the context at the next proposal

    def end(self, rows, outputs):
        for b in rows:
            self._rows.pop(b, None)

    def propose(self, inp) -> list[DraftTree]:
        return [self.match(ctx, inp.max_tokens, row, inp.judge) for row, ctx in zip(inp.rows, inp.contexts)]

    def match(self, context, max_tokens: int, row: int | None = None, judge=None) -> DraftTree:
        """The chain that followed the longest recent match of the context's last n tokens (`row`:
        whose index to grow; a row's context only grows between its begin and end; `judge`:
        DraftInput.judge)."""
        ctx = [int(t) for t in context] if not isinstance(context, list) else context
        L = len(ctx)
        if max_tokens <= 0:
            return DraftTree.empty()
        index = self._rows.get(row) if row is not None else None
        if index is None or index.seen > L:
            index = _Index(self.n_min, self.n_max)
            if row is not None:
                self._rows[row] = index
        index.extend(ctx)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            start = index.starts[n].get(tuple(ctx[L - n :]))
            if start is not None:
                match = n  # how far back the copy agrees with the context: the draft's evidence
                while match < MATCH_BUCKETS[-1] and start + n - match > 0:
                    if ctx[start + n - match - 1] != ctx[L - match - 1]:
                        break
                    match += 1
                chain, evidence = ctx[start + n : start + n + max_tokens], match_evidence(self.name, match)
                if judge is not None:
                    chain = chain[: judge(evidence, len(chain))[0]]
                return DraftTree.chain(chain, evidence=evidence) if chain else DraftTree.empty()
        return DraftTree.empty()
