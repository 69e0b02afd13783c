"""One step, row by row: what a row does in a speculative step (`RowStep`), and what the step did
(`StepRecord`: its rows' steps and the batch's figures).

    steps = [RowStep(b, row) for b, row in rows]     # made once per running row of the step
    decoder.draft(state, steps, cache)               # each verb reads and fills their fields
    record = StepRecord(rows=steps, batch=cache.batch, positions=..., ...)
    for s in record.rows: s.slot, s.row, s.tree, s.verdict, s.new_tokens

The speculative decoder's verbs (runtime/speculative.py) hand the step objects to one another,
so a piece of per-row, per-step data is one field here and the verb that fills it; the first
token a row makes after its prompt is a step of the same kind (its tree empty). What outlives
the step belongs to the row (runtime/row.py); the batched interfaces (the proposer's, the
policy's) get lists built from the steps.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specrt.runtime.backends.base import StepOutput
from specrt.runtime.row import Row
from specrt.runtime.verification import DraftTree, Verdict


@dataclasses.dataclass(eq=False)
class RowStep:
    """One running row's part of one step, filled verb by verb (the verb that fills each field
    names it: draft, guess, constrain, accept, emit, logprobs)."""

    slot: int  # its row of the batch (and of the cache)
    row: Row
    room: int | None = None  # draft: positions before its next step cut (None: no cut ahead)
    most: int = 0  # draft: the most draft nodes it may verify (its request, the decoder, the cut)
    forced: list[int] = dataclasses.field(default_factory=list)  # draft: its grammar's tokens ahead
    asked: int = 0  # draft: the draft length the policy asked for
    drafted: DraftTree = dataclasses.field(default_factory=DraftTree.empty)  # draft: before the plan cut it
    tree: DraftTree = dataclasses.field(default_factory=DraftTree.empty)  # what the step verifies
    guessed: bool = False  # guess: its tree is the floor's one-token guess alone
    mask: np.ndarray | None = None  # constrain: its grammar's mask at the root and every node
    depths: np.ndarray | None = None  # each node's depth (verify and observe read them)
    verdict: Verdict | None = None  # accept
    new_tokens: list[int] = dataclasses.field(default_factory=list)  # emit: what it appended
    logprobs: list | None = None  # logprobs: a TokenLogprob per new token, when its request asks

    @property
    def depth(self) -> int:
        """How deep its tree goes (0: nothing verified beyond the root)."""
        return int(self.depths.max()) if len(self.tree) else 0


@dataclasses.dataclass
class StepRecord:
    """What one speculative step did, for `observe` and the step observers."""

    rows: list[RowStep]  # the running rows' steps, by slot
    batch: int  # rows the target step computed (the cache's: idle slots among the rows included)
    positions: int  # computed by the target step: batch x the longest row's positions
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    out: StepOutput | None = None  # the target step's output (its features, for step observers)
