"""`auto`: per row and step, the draft (suffix, n-gram, a trained head if given) that promises most.

Both lookups draft for every row on every step (a lookup each, drafts/base.py `lookup`). The row
gets the draft the cost model judges best by its evidence (`DraftInput.judge`: the speedup the
draft's most valuable prefix promises, from the acceptance learnt per method and match length,
runtime/policy.py); the others ride along as its `rivals`, so hindsight (runtime/hindsight.py)
reads how every method's drafts fare, whichever one was verified, and the judgement of each
stays current. Without a judge (a fixed N) the first method in order that drafted wins.

Why not one tree of both: the verification step pays for every position it computes, and the two
lookups mostly propose the same tokens where both match, so their union costs positions for
little. Why the choice is lossless: it reads only what was emitted before the step, so each step
verifies a tree fixed before the target is consulted, as any draft's; its trees are point masses.

With a trained head (`--draft auto --draft-dir DIR`: an EAGLE-1, EAGLE-3, peagle or MTP head,
Medusa heads) or a draft model (DIR a smaller model's engine), it is a member too: a row gets the
member's draft when its judged speedup, with its own time in the step's cost (a line through its
calls' times per drafted token, over a target step's time), beats the row's best lookup draft's
and 1. The head's drafts have evidence of their own, (its method, ON_DEMAND), and hindsight
reads them as it reads the lookups', so the head too is verified only once drafts like it were
read to pay. Until then, and whenever its value does not pay, it drafts a short probe for the
rows no lookup serves: every PROBE_EVERY steps that have such rows until it has made
FIRST_PROBES (the drafts it needs to be judged at all: its evidence ages by its own drafts,
policy.on_demand), then after twice as many such steps as the last wait (up to PROBE_MOST)
while it keeps not paying, and back to PROBE_EVERY once it pays. So its judgement stays current,
and a head that never pays costs a few probes a request, not an eighth of its steps (the 0.5B
draft model for the 1.5B: a probe with its catch-up took ~0.07 s, about two target steps).

The head catches up lazily (it sees a row's committed features only when it next drafts for the
row: one batched call), so rows the lookups serve cost it nothing. Its sampled chains carry their
q; hindsight reads a sampled row's draft by the emitted tokens, which for a chain drawn from q
undercounts its acceptance (sum of q * p, not of min(q, p)): the head is judged conservatively
there. The target's step returns its hidden states on every step while a head that reads them is
given (a host copy the lookups and a draft model do not need); a draft model catches up the same
way, its next draft's feed being what the row committed since its last one.

Which text suits which: n-gram (the most recent copy of the last few tokens) wins where the answer
quotes its prompt in order (summaries), suffix (the prompt's and earlier answers' continuations
of the context's longest suffix, a tree) where the text repeats with variants (code edits, JSON).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time

import numpy as np

from specrt.runtime.drafts.base import DraftInput
from specrt.runtime.drafts.ngram import NgramProposer
from specrt.runtime.drafts.suffix import SuffixProposer
from specrt.runtime.estimators import DraftTimes
from specrt.runtime.verification import ON_DEMAND, DraftTree

PROBE_EVERY, PROBE_DRAFT = 8, 3  # a head not judged worth it drafts this many tokens after 8 steps,
PROBE_MOST = 64  # then after twice as many as the last wait, up to this many
FIRST_PROBES = 3  # the back-off starts after these: the drafts its judgement needs (BACKED, aged 0.98)
WINDOW = 32  # the head's calls and the target's steps kept for its time share
PRIOR_SHARE = 0.2  # the head's time over a target step until measured


class AutoProposer:
    name = "auto"
    needs_features = False  # True with a head (an instance's)
    cost_per_token = False  # lookups: about the same for any length (a head's time is its own judgement's)
    lookup = True  # its members are; a head drafts only where the lookups' drafts are judged

    def __init__(self, methods: dict | None = None, head=None):
        """methods: the lookups (their commit ignores the trees: the chosen method's); head: a
        trained head's proposer or a draft model's, for the rows no lookup serves (module
        docstring)."""
        self.methods = methods or {"suffix": SuffixProposer(), "ngram": NgramProposer()}
        self.head = None if head is None else HeadMember(head)
        self.needs_features = head is not None and head.needs_features
        self.chosen = collections.Counter()  # trees given per method (for the benchmark)

    def begin(self, rows, prompts, prefilled):
        for method in self.methods.values():
            method.begin(rows, prompts, prefilled)
        if self.head is not None:
            self.head.begin(rows, prompts, prefilled)

    def propose(self, inp: DraftInput) -> list[DraftTree]:
        if self.needs_features:
            self.head.stash(inp)
        per_method = [method.propose(inp) for method in self.methods.values()]
        names = list(self.methods)

        def value(tree: DraftTree) -> float:
            return inp.judge(tree.evidence, len(tree))[1] if inp.judge is not None else 0.0

        out, values, picked = [], [], []
        for i in range(len(inp.rows)):
            offered = [(k, trees[i]) for k, trees in enumerate(per_method) if len(trees[i])]
            if not offered:
                out.append(DraftTree.empty())
                values.append(None)
                picked.append(None)
                continue
            k, best = max(offered, key=lambda kt: (value(kt[1]), -kt[0]))  # ties: the first method
            best.rivals = tuple(tree for j, tree in offered if j != k)
            out.append(best)
            values.append(value(best))
            picked.append(names[k])
        if self.head is not None:
            for i, tree in self.head.serve(inp, out, values).items():
                tree.rivals = (out[i], *out[i].rivals) if len(out[i]) else ()  # hindsight reads them
                out[i], picked[i] = tree, self.head.name
        self.chosen.update(name for name in picked if name is not None)
        return out

    def commit(self, rows, trees, verdicts, step):
        for method in self.methods.values():
            method.commit(rows, trees, verdicts, step)
        if self.head is not None:
            self.head.commit(rows, trees, verdicts, step)

    def end(self, rows, outputs):
        for method in self.methods.values():
            method.end(rows, outputs)
        if self.head is not None:
            self.head.end(rows, outputs)


class HeadMember:
    """A trained head inside auto: which rows it drafts for, its time, the features it has not
    seen yet (module docstring)."""

    def __init__(self, head):
        self.head, self.name = head, head.name
        self.evidence = (head.name, ON_DEMAND)
        self.times = DraftTimes(WINDOW, per_token=head.cost_per_token)  # its calls: (tokens per row, seconds)
        self.step_s: collections.deque = collections.deque(maxlen=WINDOW)
        self.unseen: collections.defaultdict[int, list[np.ndarray]] = collections.defaultdict(list)
        self.wanting = 0  # steps with rows no lookup served
        self.wait, self.next_probe = PROBE_EVERY, PROBE_EVERY  # the probes' back-off, in such steps
        self.probes = 0
        self._proposed_at: float | None = None

    def begin(self, rows, prompts, prefilled):
        for b in rows:
            self.unseen.pop(b, None)
        self.head.begin(rows, prompts, prefilled)

    def stash(self, inp: DraftInput) -> None:
        """The features of the positions committed since the rows' previous proposal, kept until
        the head next drafts for the row."""
        for b, feats in zip(inp.rows, inp.features):
            self.unseen[b].append(feats)

    def share(self, n: int) -> float:
        """The head's time for an n-token draft over a target step's."""
        if not self.times.calls or not self.step_s:
            return PRIOR_SHARE
        d0, d1 = self.times.line()
        return (d0 + d1 * n) / max(statistics.median(self.step_s), 1e-9)

    def judged(self, judge, most: int) -> tuple[int, float]:
        """The draft length the head is worth most at, and that worth: the judge's speedup of its
        best prefix with the head's time for it in the step's cost (`own`), m among 1, 2, 4, 8 and
        the length best before the head's time (a judgement reads the estimates: ~9 us each here,
        so not every length). Nothing when even that best does not beat plain decoding. (Dividing
        the speedup by 1 + the head's share instead, as before, counted a dear draft's time
        twice: a draft model's 0.4 of a step per token was judged never to pay.)"""
        n, speedup = judge(self.evidence, most)
        if n == 0 or speedup <= 1.0:
            return 0, 0.0
        best = (0, 0.0)
        for m in sorted({1, 2, 4, 8, n} & set(range(1, most + 1))):
            k, worth = judge(self.evidence, m, self.share)
            if k and worth > best[1]:
                best = (k, worth)
        return best

    def serve(self, inp: DraftInput, trees: list[DraftTree], values: list) -> dict[int, DraftTree]:
        """The head's drafts for the rows it wins (by index in inp.rows): with a judge, where its
        judged speedup after its time beats the row's lookup draft's and 1 (or, on the rows with
        no lookup draft worth verifying, where a probe is due); with a fixed N, where no lookup
        drafted."""
        if inp.judge is None:
            rows, n = [i for i, tree in enumerate(trees) if not len(tree)], inp.max_tokens
        else:
            n, worth = self.judged(inp.judge, inp.max_tokens)
            wanting = [i for i, v in enumerate(values) if v is None or v <= 1.0]
            rows = [i for i, v in enumerate(values) if worth > max(1.0, v or 0.0)]
            if wanting:
                self.wanting += 1
            if rows:  # it pays: probe soon again once it stops paying
                self.wait, self.next_probe = PROBE_EVERY, self.wanting + PROBE_EVERY
            elif wanting and self.wanting >= self.next_probe:
                rows, n = wanting, min(PROBE_DRAFT, inp.max_tokens)
                self.probes += 1
                if self.probes >= FIRST_PROBES:  # before, it cannot be judged: no back-off yet
                    self.wait = min(2 * self.wait, PROBE_MOST)
                self.next_probe = self.wanting + self.wait
        self._proposed_at = time.perf_counter()
        if not rows or n < 1:
            return {}
        t0, gaps = time.perf_counter(), getattr(self.head, "gap_seconds", 0.0)
        sub = dataclasses.replace(
            inp,
            rows=[inp.rows[i] for i in rows],
            contexts=[inp.contexts[i] for i in rows],
            max_tokens=n,
            budgets=[inp.budgets[i] for i in rows],
            rngs=[inp.rngs[i] for i in rows],
        )
        if self.head.needs_features:
            sub = dataclasses.replace(sub, features=[np.concatenate(self.unseen.pop(inp.rows[i])) for i in rows])
        drafted = self.head.draft(sub, self.head.catch_up(sub))
        # its time per drafted token leaves out a draft model's prefill of a long gap (`gap_seconds`:
        # the prompt, or the tokens the lookups' steps committed), paid once for the row's text
        # whenever it next drafts: counted per drafted token, a 0.5B's prompt made every later
        # draft look dear, and it only ever probed (multi-turn 24.7 tokens/s with it, 29.4 without)
        self.times.observe(n, time.perf_counter() - t0 - (getattr(self.head, "gap_seconds", 0.0) - gaps))
        self._proposed_at = time.perf_counter()
        for tree in drafted:
            tree.evidence = self.evidence
        return dict(zip(rows, drafted))

    def commit(self, rows, trees, verdicts, step):
        if self._proposed_at is not None:  # from the end of the proposal to here: the target step
            self.step_s.append(time.perf_counter() - self._proposed_at)
            self._proposed_at = None
        self.head.commit(rows, trees, verdicts, step)

    def end(self, rows, outputs):
        for b in rows:
            self.unseen.pop(b, None)
        self.head.end(rows, outputs)
