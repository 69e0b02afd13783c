"""Hybrid draft: the suffix draft where its match is long, the EAGLE head elsewhere.

Copying drafts (suffix) are free and, on repetitive text (code edits, JSON, quotes of the
prompt), accept long runs; a learned head costs a forward per token but drafts open-ended text.
SuffixDecoding suggests combining them; here each step and row is decided by tokens per second:

    suffix   (1 + E_s) / T_step             E_s: the suffix tree's own estimate (sum of its scores)
    eagle    (1 + E_e) / (T_step + T_draft) E_e: the head's measured mean accepted drafts per step

T_step (a target step with its bookkeeping) and T_draft (the head's proposal) are medians of
this generation's own measurements: the time between proposals, and the head's drafting time
(its catch-up runs every step either way, so it is not counted). Until the head has been measured
(its first steps) it is used. The head catches up on every committed position, also on steps the
suffix draft won, so it never misses a target feature.
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


class HybridProposer:
    name = "hybrid"
    needs_features = True
    cost_per_token = True

    def __init__(self, eagle: EagleProposer, suffix: SuffixProposer | None = None):
        self.eagle, self.suffix = eagle, suffix or SuffixProposer()
        self.chosen = collections.Counter()  # trees proposed per method (for the benchmark)
        self._draft_s: collections.deque = collections.deque(maxlen=WINDOW)
        self._step_s: collections.deque = collections.deque(maxlen=WINDOW)
        self._accepted: collections.deque = collections.deque(maxlen=WINDOW)  # per EAGLE tree
        self._last_end: float | None = None
        self._from_eagle: set[int] = set()

    def begin(self, rows, prompts, prefilled):
        self.eagle.begin(rows, prompts, prefilled)
        self.suffix.begin(rows, prompts, prefilled)
        self._last_end = None

    def propose(self, inp: DraftInput) -> list[DraftTree]:
        start = time.perf_counter()
        if self._last_end is not None:  # the target step (and loop bookkeeping) since our last proposal
            self._step_s.append(start - self._last_end)
        suffix_trees = self.suffix.propose(inp)
        roots = self.eagle.catch_up(inp)  # every step: the head never misses a committed feature
        head = [i for i, tree in enumerate(suffix_trees) if not self._suffix_wins(tree)]
        out = list(suffix_trees)
        self._from_eagle = {inp.rows[i] for i in head}
        if head:
            t0 = time.perf_counter()
            sub = dataclasses.replace(
                inp,
                rows=[inp.rows[i] for i in head],
                contexts=[inp.contexts[i] for i in head],
                budgets=[inp.budgets[i] for i in head],
                features=None,
            )
            for i, tree in zip(head, self.eagle.draft(sub, roots)):
                out[i] = tree
            self._draft_s.append(time.perf_counter() - t0)
        self.chosen["eagle"] += len(head)
        self.chosen["suffix"] += len(out) - len(head)
        self._last_end = time.perf_counter()
        return out

    def _suffix_wins(self, tree: DraftTree) -> bool:
        if not len(tree) or len(self._accepted) < 4 or not self._step_s or not self._draft_s:
            return False
        e_suffix = float(tree.scores.sum()) if tree.scores is not None else 0.0
        e_eagle = float(np.mean(self._accepted))
        t_step, t_draft = float(np.median(self._step_s)), float(np.median(self._draft_s))
        return (1 + e_suffix) / max(t_step, 1e-9) >= (1 + e_eagle) / max(t_step + t_draft, 1e-9)

    def commit(self, rows, trees, verdicts, step):
        for b, v in zip(rows, verdicts):
            if b in self._from_eagle:
                self._accepted.append(len(v.accepted))
        self.eagle.commit(rows, trees, verdicts, step)
        self.suffix.commit(rows, trees, verdicts, step)

    def end(self, rows, outputs):
        self.eagle.end(rows, outputs)
        self.suffix.end(rows, outputs)
