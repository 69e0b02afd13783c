"""The proposer contract: what a draft method gets and gives each step.

A generation tells its proposer, for the rows of its batch:

    begin(rows, prompts, prefilled)     the rows start; `prefilled` holds the logits after each
                                        prompt and, when `needs_features`, every prompt
                                        position's hidden states (the target's features)
    propose(DraftInput) -> [DraftTree]  one tree per row of the input, drafted in one call for the
                                        whole batch (a draft with weights runs one batched forward
                                        per draft token, not one per row)
    commit(rows, trees, verdicts, step) after verification: which nodes each row accepted, and the
                                        verification step (its hidden states when
                                        `needs_features`), so a draft with state of its own (a KV
                                        cache) keeps the accepted part and rolls back the rest
    end(rows, outputs)                  the rows finished; methods that learn across requests
                                        (suffix) keep the outputs

Rows come and go independently under continuous batching (runtime/batching.py): `begin` and
`end` may name single rows while others are running, and a row number that ended may begin
again for a new request, so a method keeps its state per row. `propose` gets the rows that draft
this step (those the policy gives a length); rows of one call share their sampling settings
and random generator (greedy rows together, a seeded sampled row alone).

and declares two facts about itself:

    needs_features   whether DraftInput.features is filled (it costs a host copy of the target's
                     hidden states on every step, so lookups leave it False)
    cost_per_token   whether drafting costs time per drafted token (a model runs once per token)
                     or about the same for any length (a lookup); the cost model fits T_draft(N)
                     accordingly

Trees carry `q` (the distribution each node was drawn from) when the method samples from a
distribution, or None for point masses (lookups); verification keeps the output exact either
way. Methods are looked up by name in `specrt.runtime.drafts.DRAFT_METHODS`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np

from specrt.runtime.backends.base import StepOutput
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.session import Prefilled
from specrt.runtime.verification import DraftTree, Verdict


@dataclasses.dataclass
class DraftInput:
    """What a proposer gets for one step; list fields are parallel to `rows`."""

    rows: list[int]  # batch rows that draft this step
    contexts: list[list[int]]  # per row: prompt + output so far; its last token is the root, not yet verified
    max_tokens: int  # at most this many nodes per tree (N, chosen by the speculation policy)
    budgets: list[int]  # per row: tokens it may still emit; drafting deeper than budget - 1 is wasted
    sampling: SamplingParams  # the request's sampling (a sampling draft honours temperature, top-k, top-p)
    rng: np.random.Generator  # the generation's randomness (seeded runs stay reproducible)
    # per row: the target's features at the positions committed since the row's previous
    # proposal (the whole prompt at the first), oldest first; None unless `needs_features`
    features: list[np.ndarray] | None = None


class Proposer(Protocol):
    name: str
    needs_features: bool
    cost_per_token: bool

    def begin(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], prefilled: Prefilled) -> None: ...

    def propose(self, inp: DraftInput) -> list[DraftTree]: ...

    def commit(
        self, rows: Sequence[int], trees: Sequence[DraftTree], verdicts: Sequence[Verdict], step: StepOutput
    ) -> None: ...

    def end(self, rows: Sequence[int], outputs: Sequence[Sequence[int]]) -> None: ...
