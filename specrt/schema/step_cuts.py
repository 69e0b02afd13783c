"""Step cuts: positions a step may not span, where an engine's kernels change how they add.

ONNX Runtime's CPU matrix product (MLAS) picks how it blocks a product's inner dimension from the
product's shape. A step's attention scores are a product whose inner dimension is the head size
and whose columns are the row's total length after the step (its committed positions, its new
ones and their padding). With heads of 256 (Gemma 3), ORT 1.32 on two threads adds the 256 terms
in one run up to a total of 64 and as two halves of 128 past it, and changes again every 256
positions (65, 321, 577, ...: measured by `engines/ort_measure.py` `step_cuts`). So a position's
bits depend on where the step that computes it ends, and speculative output (steps of many
positions) would differ from plain output (steps of one) on near-ties.

The rule that makes every step shape give a position the same bits: mode changes between totals
B and B + 1 put a *cut* at position c = B - 1, and no step computes a position below a cut
together with the cut or anything past it. A row's step over positions [s, e) padded to Q
positions (its total s + Q; Q >= 2, the step floor or the fused graph's own attention pad) keeps
the rule when, for the next cut c > s,

    e <= c  and  s + Q <= c + 1

so position c - 1 is computed by steps that end at most at slot c (two positions: itself and the
padding), and position c only by steps that start there (total c + 2 > B). Positions from c on
are past the mode change in every step. The build finds the cuts of its engine by probing (they
depend on the head size, the thread count and the kernel version) and records them in the
engine's manifest; the session splits a step at them (`pieces`), and the speculative decoder
drafts no further than the next cut (`StepSession.room`).

No heavy imports: engine builders and the runtime read it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np


def expand(cuts: Sequence[int], period: int | None, limit: int) -> tuple[int, ...]:
    """The cuts below `limit`: the probed ones, continued every `period` positions after the
    last of them where the probe found them evenly spaced (None: no continuation)."""
    out = sorted(int(c) for c in cuts if c < limit)
    if period and out:
        c = out[-1] + period
        while c < limit:
            out.append(c)
            c += period
    return tuple(out)


def next_cut(cuts: Sequence[int], position: int) -> int | None:
    """The first cut after `position` (a row's next step starts there), or None."""
    i = bisect.bisect_right(cuts, position)
    return cuts[i] if i < len(cuts) else None


def room(cuts: Sequence[int], position: int) -> int | None:
    """The most positions a step starting at `position` may compute for the row without a
    split (the cut's own position is not among them); None: no cut ahead."""
    c = next_cut(cuts, position)
    return None if c is None else c - position


def pieces(
    lengths: Sequence[int], counts: Sequence[int], cuts: Sequence[int], floor: int = 2, whole: Sequence[int] = ()
) -> list[list[tuple[int, int]]]:
    """A step of counts[b] new tokens per row after lengths[b] committed positions, as steps that
    keep the rule: per step, per row, the (start, stop) of the row's tokens it computes (empty
    where start == stop). One step where the step keeps the rule as it is. Rows in `whole` (a
    draft tree: its nodes' positions are not one after another) are never split: a row whose
    tokens cross its next cut raises ValueError (the caller drafts no further than the cut)."""
    done = [0] * len(counts)
    steps: list[list[tuple[int, int]]] = []
    while True:
        left = [b for b in range(len(counts)) if done[b] < counts[b]]
        if not left:
            return steps or [[(0, 0)] * len(counts)]
        # the widest step every row with tokens left allows: its total may reach its cut's slot
        widest, want = None, {}
        for b in left:
            s = int(lengths[b]) + done[b]
            c = next_cut(cuts, s)
            want[b] = counts[b] - done[b]
            if c is None:
                continue
            if b in whole and want[b] > c - s:
                raise ValueError(f"row {b}'s {want[b]} tree positions from {s} cross the step cut at {c}")
            if b not in whole:
                want[b] = min(want[b], c - s)
            widest = c + 1 - s if widest is None else min(widest, c + 1 - s)
        if widest is not None and widest < floor:
            raise ValueError(f"a step floor of {floor} cannot keep the cuts (room for {widest})")
        step = [(done[b], done[b]) for b in range(len(counts))]
        for b in left:
            take = want[b] if widest is None else min(want[b], widest)
            if b in whole and take < want[b]:
                continue  # a later step, narrow enough for its tree
            step[b] = (done[b], done[b] + take)
        for b in left:
            done[b] = step[b][1]
        steps.append(step)


def joined(steps: list[list[tuple[int, int]]], outs: list[np.ndarray], width: int) -> np.ndarray:
    """The outputs (B, Q_k, ...) of the steps `pieces` made, put together as the one step's
    (B, width, ...): row b's tokens [start, stop) of step k are step k's first stop - start."""
    first = outs[0]
    out = np.zeros((first.shape[0], width, *first.shape[2:]), first.dtype)
    for step, got in zip(steps, outs):
        for b, (a, c) in enumerate(step):
            out[b, a:c] = got[b, : c - a]
    return out
