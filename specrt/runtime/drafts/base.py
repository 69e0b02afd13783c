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

and declares three facts about itself:

    needs_features   whether DraftInput.features is filled (it costs a host copy of the target's
                     hidden states on every step, so lookups leave it False)
    cost_per_token   whether drafting costs time per drafted token (a model runs once per token)
                     or about the same for any length (a lookup); the cost model fits T_draft(N)
                     accordingly
    lookup           whether drafting is cheap enough beside a target step to run on every step
                     (a lookup in the context): then every running row drafts up to the most the
                     policy allows, and the plan decides from the trees and their evidence how
                     much of each to verify (runtime/policy.py); otherwise the plan comes first and
                     only the rows it gives a draft length draft

What the runtime guarantees, and what it asks of a method:

- Calls. `propose` gets the rows that draft this step (a lookup: every running row; otherwise
  those the policy gives at least one token), one call per sampling setting (temperature,
  top-k, top-p): greedy rows together, sampled rows of one setting together. Every row has its
  own random generator (`rngs`, one per request and per row of a static batch): draw a row's
  tokens from its own only, in the order it would alone, and its output is what it would be
  alone, whatever else runs.
- Order. In `begin`, `prompts` and `prefilled` (its logits and hidden rows) follow `rows`.
- Rows come and go. Every generation runs on the batching engine (runtime/batching.py; a
  static batch is one whose requests all arrive at step 0): `begin` names each row as its
  prompt is in (one row a call, also in a static batch, while others may run), and a row
  number that ended may begin again for a new request: keep state per row. `end` comes once per
  row, as each finishes (EOS or its budget) or is cancelled, or the generation is closed.
- The root. A context's last token is the target's own last sample: emitted, but not yet in
  the target's KV cache (the verification step feeds it first, then the tree's nodes). The tree
  drafts the tokens that follow it.
- What a tree carries. A greedy row needs only point masses (`q` None): verification follows the
  target's argmax and never reads q. A sampled row's node with a `q` must carry the distribution
  it was really drawn from given its earlier siblings: a method that draws distinct siblings
  without replacement gives the second sibling q with the first removed and renormalised, the
  third q with both removed, and so on. Anything else makes the output another distribution than
  the target's (tests/test_verification.py catches such a draft). Point masses are always exact.
- What is verified is not your proposal. The loop keeps at most the row's planned number of
  nodes, the first ones in your node order (`DraftTree.truncate`); under a grammar
  (runtime/grammar.py) the tokens it forces come in front (a lookup's draft continues after
  them) or are the whole tree (other methods: a step that has forced tokens verifies those
  alone), and the tree is cut again before the first node the grammar forbids (greedy rows and
  point masses); where a row has nothing to verify, the step's floor verifies a one-token
  guess. Then, where output must be bitwise plain output (`StepSession.exact`, the default,
  runtime/session.py), the tree is re-ordered depth first (`DraftTree.depth_first`:
  every node's first child right after it), so its leading chain is your best guess at every
  depth. `commit` gets that verified tree, and each verdict indexes *its* nodes, not your
  proposal's: `tree.proposed()[verdict.accepted]` are the accepted nodes' indexes in your
  proposal (-1 for a node you did not draft: a forced token, the guess), and the accepted
  tokens are `verdict.tokens(tree)`. A draft with state per proposal node (its own KV cache
  holding the tree) keeps the slots `proposed()` names and rolls back the rest.
- A method with a model of its own (draft_model.py) reads its backend's `config` as the runtime
  reads the target's (runtime/backends/base.py lists the fields).

Methods are looked up by name in `specrt.runtime.drafts.DRAFT_METHODS`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence

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
    sampling: SamplingParams  # the rows' sampling (a sampling draft honours temperature, top-k, top-p)
    rngs: list[np.random.Generator]  # per row: its own randomness (draw row i's tokens from rngs[i] only)
    # per row: the target's features at the positions committed since the row's previous
    # proposal (the whole prompt at the first), oldest first; None unless `needs_features`
    features: list[np.ndarray] | None = None
    # the cost model's judgement of a lookup's draft by its evidence (None: none, a fixed N):
    # judge(evidence, n) -> (how many of the draft's first n nodes to make, the speedup its best
    # prefix promises alone); a lookup need not make the rest (0: no draft); judge(evidence, n,
    # own) also counts a drafting model's time, own(k) over a target step (auto's member)
    judge: Callable[..., tuple[int, float]] | None = None


class Proposer(Protocol):
    name: str
    needs_features: bool
    cost_per_token: bool
    lookup: bool

    def begin(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], prefilled: Prefilled) -> None: ...

    def propose(self, inp: DraftInput) -> list[DraftTree]: ...

    def commit(
        self, rows: Sequence[int], trees: Sequence[DraftTree], verdicts: Sequence[Verdict], step: StepOutput
    ) -> None: ...

    def end(self, rows: Sequence[int], outputs: Sequence[Sequence[int]]) -> None: ...


# a lookup's match length, in the classes the cost model learns acceptance for (each a lower bound)
MATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32)


def match_evidence(method: str, match: int) -> tuple[str, int]:
    """A lookup draft's evidence (DraftTree.evidence): its method and the length of the context's
    suffix it continues, bucketed. How far a copy is accepted follows the match length more than
    anything else a lookup knows: offline, over the 12 benchmark prompts' greedy answers, suffix
    trees after a 1-token match were accepted 0.4 tokens deep, after 3 tokens 2.7, after 8 or
    more 8-13."""
    bucket = max((m for m in MATCH_BUCKETS if m <= match), default=0)
    return method, bucket


def follower(prompt: Sequence[int], out: Sequence[int]) -> int:
    """The cheapest guess at a row's next token: the token that followed the latest earlier
    occurrence of its last token (a one-token copy) in its context (prompt, then output); else
    the last token again. What a step's floor position carries when nothing was drafted
    (SpeculativeDecoder.guess): any token keeps the output exact, a likely one is a free token."""
    last = out[-1] if out else prompt[-1]
    if out:
        tail = [prompt[-1], *out]  # the output, after the prompt's last token
        for i in range(len(tail) - 2, -1, -1):
            if tail[i] == last:
                return int(tail[i + 1])
    for i in range(len(prompt) - 2, -1, -1):
        if prompt[i] == last:
            return int(prompt[i + 1])
    return int(last)


class NoDraft:
    """Plain decoding's proposer: it drafts nothing, so each step verifies the root alone (N = 0)."""

    name, needs_features, cost_per_token, lookup = "none", False, False, False

    def begin(self, rows, prompts, prefilled) -> None:
        pass

    def propose(self, inp: DraftInput) -> list[DraftTree]:
        return [DraftTree.empty() for _ in inp.rows]

    def commit(self, rows, trees, verdicts, step) -> None:
        pass

    def end(self, rows, outputs) -> None:
        pass


class GrammarDrafts(NoDraft):
    """Drafts nothing of its own: a constrained request's tokens its grammar forces are drafted
    in front of every method's draft (runtime/grammar.py), so with this method they are the only
    drafts, and rows without a grammar decode plainly. A lookup: it costs nothing to ask."""

    name, lookup = "grammar", True
