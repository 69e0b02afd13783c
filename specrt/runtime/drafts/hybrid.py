"""Hybrid draft: the suffix draft where its match is long, the EAGLE head elsewhere.

Copying drafts (suffix) are free and, on repetitive text (code edits, JSON, quotes of the
prompt), accept long runs; a learned head costs a forward per token but drafts open-ended text.
SuffixDecoding suggests combining them; here each step and row is decided by tokens per second:

    suffix   (1 + E_s) / T_step             E_s: the suffix tree's own estimate (sum of its scores)
    eagle    (1 + E_e) / (T_step + T_draft) E_e: the head's measured mean accepted drafts per tree

T_step (the target step) and T_draft (the head's proposal) are medians of this generation's own
measurements: the time from a proposal to its verdicts, and the head's time (its catch-up and its
drafting). Until the head has been measured (4 trees) priors stand in: one accepted draft token
per step, at a fifth of a step.

The head catches up lazily: while the suffix draft wins a row, the target's features of that
row's committed positions are kept here, and fed to the head in one call when it next drafts for
the row. So a row the suffix draft serves costs no head call at all (it used to cost one per
step), and a long catch-up runs as one
batched call rather than one per step.

The speculative loop's cost model sees one draft with a constant cost (`cost_per_token =
False`): on repetitive text the suffix draft wins most steps, and a per-token cost line fitted to
its nearly free trees plus the head's catch-up kept speculation off (measured on a code-edit
prompt: 1.12x with a per-token line, 2.54x with a constant). One cost model per method is the
better answer and is not built yet.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from specrt.runtime.drafts.base import DraftInput
from specrt.runtime.drafts.eagle import EagleProposer
from specrt.runtime.drafts.suffix import SuffixProposer
from specrt.runtime.verification import DraftTree

WINDOW = 32  # measurements kept for the medians
PRIOR_ACCEPTED, PRIOR_DRAFT_SHARE = 1.0, 0.2  # the head's until measured: a useful head, 1/5 of a step


class HybridProposer:
    name = "hybrid"
    needs_features = True
    cost_per_token = False  # mostly the suffix draft (constant)
    lookup = False  # the head's part is not

    def __init__(self, eagle: EagleProposer, suffix: SuffixProposer | None = None):
        self.eagle, self.suffix = eagle, suffix or SuffixProposer()
        self.chosen = collections.Counter()  # trees proposed per method (for the benchmark)
        self._draft_s: collections.deque = collections.deque(maxlen=WINDOW)
        self._step_s: collections.deque = collections.deque(maxlen=WINDOW)
        self._accepted: collections.deque = collections.deque(maxlen=WINDOW)  # per EAGLE tree
        self._proposed_at: float | None = None
        self._from_eagle: set[int] = set()
        # per row: the target's features the head has not seen yet (the steps the suffix draft won)
        self._unseen: collections.defaultdict[int, list[np.ndarray]] = collections.defaultdict(list)

    def begin(self, rows, prompts, prefilled):
        for b in rows:
            self._unseen.pop(b, None)
        self.eagle.begin(rows, prompts, prefilled)
        self.suffix.begin(rows, prompts, prefilled)

    def propose(self, inp: DraftInput) -> list[DraftTree]:
        suffix_trees = self.suffix.propose(inp)
        for b, feats in zip(inp.rows, inp.features):
            self._unseen[b].append(feats)
        head = [i for i, tree in enumerate(suffix_trees) if not self._suffix_wins(tree)]
        out = list(suffix_trees)
        self._from_eagle = {inp.rows[i] for i in head}
        if head:
            t0 = time.perf_counter()
            rows = [inp.rows[i] for i in head]
            sub = dataclasses.replace(
                inp,
                rows=rows,
                contexts=[inp.contexts[i] for i in head],
                budgets=[inp.budgets[i] for i in head],
                features=[np.concatenate(self._unseen.pop(b)) for b in rows],
            )
            for i, tree in zip(head, self.eagle.draft(sub, self.eagle.catch_up(sub))):
                out[i] = tree
            self._draft_s.append(time.perf_counter() - t0)
        self.chosen["eagle"] += len(head)
        self.chosen["suffix"] += len(out) - len(head)
        self._proposed_at = time.perf_counter()
        return out

    def _suffix_wins(self, tree: DraftTree) -> bool:
        if not len(tree):
            return False
        e_suffix = float(tree.scores.sum()) if tree.scores is not None else 0.0
        if len(self._accepted) < 4 or not self._step_s or not self._draft_s:  # priors until measured
            e_eagle, draft_share = PRIOR_ACCEPTED, PRIOR_DRAFT_SHARE
        else:
            e_eagle = float(np.mean(self._accepted))
            draft_share = float(np.median(self._draft_s)) / max(float(np.median(self._step_s)), 1e-9)
        return (1 + e_suffix) >= (1 + e_eagle) / (1 + draft_share)

    def commit(self, rows, trees, verdicts, step):
        if self._proposed_at is not None:  # from the end of the proposal to here: the target step
            self._step_s.append(time.perf_counter() - self._proposed_at)
            self._proposed_at = None
        for b, v in zip(rows, verdicts):
            if b in self._from_eagle:
                self._accepted.append(len(v.accepted))
        self.eagle.commit(rows, trees, verdicts, step)
        self.suffix.commit(rows, trees, verdicts, step)

    def end(self, rows, outputs):
        for b in rows:
            self._unseen.pop(b, None)
        self.eagle.end(rows, outputs)
        self.suffix.end(rows, outputs)
