"""Speculative decoding: prefill, then repeat { propose → verify → accept → commit }.

    spec = SpeculativeDecoder(Generator.from_engine(...), make_proposer("suffix"), make_policy("auto"))
    result = spec.generate("Rewrite this code ...", max_new_tokens=256)
    print(result.text, result.metrics.summary())

One step of `SpeculativeDecoder.step`, for the running rows the batching engine hands it with
their cache (runtime/batching.py, the one generation loop); each row's part of the step is a
`RowStep` (runtime/row_step.py) that every verb reads and fills:
    propose  the policy picks each row's N from the cost model; the proposer drafts a tree per
             row (greedy rows in one call, a seeded sampled row with its own generator)
    guess    with the step floor (runtime/session.py: every step computes two positions per
             row at least), a row with nothing to verify gets a one-token guess, for free
    constrain  a row with a grammar (runtime/grammar.py): the tokens it forces go in front of
             the draft, and each node gets the grammar's mask after its path
    verify   one target step over [root, draft nodes...] per row, at positions length + depth
             with the tree's ancestor mask (rows may draft different amounts); bitwise (the
             session's exactness), each tree depth first, so the best guess at every depth is
             its leading chain
    accept   greedy: the path matching the target's argmax (bitwise, cut where it leaves
             the leading chain, whose logits alone are plain decoding's bits:
             verification.on_leading_chain); sampling: recursive rejection (verification.py):
             the output follows the target exactly (a constrained row's target masked at every
             node)
    commit   the cache keeps the root and the accepted path (`KVCache.keep_path`), the rows emit
             their tokens, and the proposer hears the verdicts (so a draft with state rolls back)
and `observe` feeds what the step cost and accepted to the metrics and the cost model. A row's
life around its steps is `join` (its prompt is in: its first token is a step whose tree is empty,
the prefill having computed the root's logits: accept, emit and logprobs make it as they make
every other) and `leave` (it finished or was cancelled). What belongs to one request is its Row
(runtime/row.py: its tokens among it), what it does in one step its RowStep; the decoder's
`SpecState` holds only what it learns across the batch's steps (the cost model, hindsight,
metrics), and nothing of it is written by the engine.

The static conveniences (`generate_ids`, `iter_generate`, `stream`, `generate`: the batching
engine with every request arriving at step 0) are functions over a decoder (runtime/generates.py),
offered as methods here and on the Generator (plain decoding: a decoder with no draft, N = 0).
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime import generates
from specrt.runtime.acceptance_report import RequestAcceptance
from specrt.runtime.backends.base import StepOutput
from specrt.runtime.drafts.base import DraftInput, Proposer, follower
from specrt.runtime.hindsight import Hindsight
from specrt.runtime.kv_cache import KVCache
from specrt.runtime.logprobs import token_logprobs
from specrt.runtime.metrics import SpecMetrics
from specrt.runtime.policy import AutoPolicy, CostModel, FixedPolicy
from specrt.runtime.row import Row
from specrt.runtime.row_step import RowStep, StepRecord
from specrt.runtime.sampling import SamplingParams, probs_from_logits
from specrt.runtime.session import Prefilled, exactness_warning
from specrt.runtime.target import Target
from specrt.runtime.verification import DraftTree, accept_greedy, accept_sampling, on_leading_chain


def make_policy(num_draft: int | str, max_draft: int = 16):
    """`num_draft`: an int (fixed N, 0 = plain decoding) or "auto"."""
    if num_draft == "auto":
        return AutoPolicy(max_draft=max_draft)
    try:
        n = int(num_draft)
    except (TypeError, ValueError):
        raise SpecrtError(f"num_draft must be a number >= 0 or 'auto', got {num_draft!r}") from None
    if n < 0:
        raise SpecrtError(f"num_draft must be >= 0, got {n}")
    return FixedPolicy(n)


@dataclasses.dataclass
class SpecState:
    """What the decoder keeps for a batch (`SpeculativeDecoder.new_state`) between its steps: the
    cost model, the lookups' drafts under hindsight, the batch's metrics and step times. The rows
    and their cache are the batching engine's; each step gets them as arguments."""

    batch: int  # its slots: the rows a step may compute
    cost: CostModel
    features: bool = False  # its steps return the target's features (the draft's or an observer's need)
    metrics: SpecMetrics = dataclasses.field(default_factory=SpecMetrics)  # every row's steps
    step_times: list[float] = dataclasses.field(default_factory=list)
    drafted_per_step: list[float] = dataclasses.field(default_factory=list)
    hindsight: Hindsight = dataclasses.field(default_factory=Hindsight)  # a lookup's drafts, read as rows emit


class SpeculativeDecoder:
    def __init__(self, generator: Target, proposer: Proposer, policy=None):
        self.gen = generator
        self.proposer = proposer
        self.policy = policy if policy is not None else AutoPolicy()
        limit = generator.session.caps.max_verify
        if limit is not None and self.policy.max_draft + 1 > limit:
            raise SpecrtError(
                f"this engine verifies at most {limit} positions in one step ({limit - 1} draft tokens and the "
                "root), but up to "
                f"{self.policy.max_draft} draft tokens were asked for; use --max-draft/--num-draft {limit - 1} or "
                "less, or rebuild "
                f"the engine with --max-verify {self.policy.max_draft + 1}"
            )
        drafts = self.policy.max_draft > 0
        self.exactness_warning = exactness_warning(generator.session) if drafts else None
        if self.exactness_warning:
            warnings.warn(self.exactness_warning, stacklevel=2)

    # -- the static conveniences (runtime/generates.py) ---------------------------------------------

    def iter_generate(self, prompts, max_new_tokens=128, sampling=SamplingParams(), grammar=None):
        return generates.iter_generate(self, prompts, max_new_tokens, sampling, grammar)

    def generate_ids(self, prompts, max_new_tokens=128, sampling=SamplingParams(), grammar=None):
        return generates.iter_generate(self, prompts, max_new_tokens, sampling, grammar).run()

    def stream(self, prompt, max_new_tokens=128, sampling=SamplingParams(), chat=True, system=None, grammar=None):
        return generates.stream(self, prompt, max_new_tokens, sampling, chat, system, grammar)

    def generate(self, prompt, max_new_tokens=128, sampling=SamplingParams(), chat=True, system=None, grammar=None):
        return generates.generate(self, prompt, max_new_tokens, sampling, chat, system, grammar)

    @property
    def floored(self) -> bool:
        """Whether every step computes two positions per row or more (runtime/session.py)."""
        return self.gen.session.floor > 1

    @property
    def bitwise(self) -> bool:
        """Whether greedy output must be plain decoding's bits (the session's exactness): then
        only a tree's leading chain is (verification.on_leading_chain)."""
        return self.gen.session.exact == "bitwise"

    @property
    def eos_ids(self):
        return self.gen.eos_ids

    @property
    def needs_features(self) -> bool:
        return self.proposer.needs_features

    # -- a row's life ------------------------------------------------------------------------------

    def new_cost_model(self) -> CostModel:
        # the generic priors: seeding them from the engine's step costs measured at build was below
        # the noise in two ablation runs (2026-12-02: +1.3 / -1.1 / -0.2 %; 2026-12-05: -0.3 / +0.6 /
        # +0.7 % on float32 / gguf / int8-a8, and it lowered the geometric mean under load), so it went;
        # those costs are the least a step's size is priced at instead (estimators.StepCurve)
        caps = self.gen.session.caps
        most, per_token = max(self.policy.max_draft, 1), self.proposer.cost_per_token
        return CostModel(most, draft_per_token=per_token, free=self.gen.session.floor - 1, step_ms=caps.step_ms)

    def new_state(self, batch: int, features: bool = False) -> SpecState:
        """The bookkeeping of a batch of `batch` slots; `features`: its steps return the target's
        features even where the draft reads none (a step observer's need, runtime/batching.py)."""
        return SpecState(batch, self.new_cost_model(), features=features or self.needs_features)

    def join(self, state: SpecState, b: int, row: Row, out: StepOutput, features: np.ndarray | None = None):
        """`row`'s prompt is in the cache's row b (`out`: the prefill's last step, that one row;
        `features`: every prompt position's, when the state keeps them): it starts generating, and
        its first token is made as every other is, a step whose tree is empty (the prefill
        computed the root's logits). Returns that step's record."""
        row.metrics = SpecMetrics() if self.policy.max_draft else None
        if row.request.acceptance and self.policy.max_draft:
            row.acceptance = RequestAcceptance(self.most(row), detailed=row.request.acceptance == "detailed")
        row.features = [features] if self.needs_features else []
        hidden = None if features is None else [features]
        self.proposer.begin([b], [row.prompt], Prefilled(out.logits[:, 0], hidden))
        out, steps = out.at_row(b), [RowStep(b, row)]
        self.constrain(steps)
        self.accept(steps, out)
        self.emit(steps)
        self.logprobs(steps, out)
        return StepRecord(rows=steps, batch=1, positions=1)

    def leave(self, state: SpecState, b: int, row: Row) -> None:
        """`row` (in slot b) finished or was cancelled: the proposer and the cost model forget it."""
        self.proposer.end([b], [row.out])
        state.cost.forget_row(b)
        state.hindsight.forget(b)

    def step(self, state: SpecState, cache: KVCache, rows: list[tuple[int, Row]]) -> StepRecord:
        """One speculative step over the running rows (slot, row) on their cache (`cache`: the
        rows in use, idle slots among them included): propose → verify → accept → commit."""
        steps = [RowStep(b, row) for b, row in rows]
        t0 = time.perf_counter()
        self.draft(state, steps, cache)
        if self.floored:
            self.guess(steps)
        self.constrain(steps)
        if self.bitwise:  # the best guess at every depth on the leading chain
            self.depth_first(steps)
        t1 = time.perf_counter()
        for s in steps:  # once per step: verify and observe read them
            s.depths = s.tree.depths()
        out = self.verify(state, steps, cache)
        self.accept(steps, out)
        self.emit(steps)
        self.commit(steps, cache, out)
        self.logprobs(steps, out)
        self.tally(steps)
        # the step is dense: every row is computed at the longest row's length, the floor at least
        longest = max(self.gen.session.floor, *(len(s.tree) + 1 for s in steps))
        record = StepRecord(
            rows=steps,
            batch=cache.batch,
            positions=cache.batch * longest,
            draft_seconds=t1 - t0,
            verify_seconds=time.perf_counter() - t1,
            out=out,
        )
        self.observe(state, record)
        return record

    def most(self, row: Row) -> int:
        """The most draft tokens a step verifies for `row`: the decoder's, or its request's own cap."""
        return self.policy.max_draft if row.cap is None else min(self.policy.max_draft, row.cap)

    # -- the verbs -------------------------------------------------------------------------------

    def draft(self, state: SpecState, steps: list[RowStep], cache: KVCache) -> None:
        """Each row's draft tree and how much of it to verify (fills room, most, forced, asked,
        drafted, tree). A lookup drafts first (it is cheap: the plan sees every row's draft, then
        cuts it); any other draft is asked for the planned length."""
        room = self.gen.session.room(cache)
        for s in steps:
            s.most, s.room = self.most(s.row), room[s.slot]
            if s.room is not None:  # a tree stops before the row's next step cut (the root is one of its positions)
                s.most = max(0, min(s.most, s.room - 1))
        self.forced(steps)
        slots = [s.slot for s in steps]
        if self.proposer.lookup:
            # a copy draft continues after the tokens the row's grammar forces
            self.propose(steps, [s.most - len(s.forced) for s in steps], self.policy.judge(state.cost, cache.batch))
            plan = self.policy.plan(state.cost, slots, [s.drafted for s in steps], cache.batch)
            for s, n in zip(steps, plan):
                s.asked, s.tree = n, s.drafted.truncate(n).behind(s.forced)
            return
        plan = self.policy.plan(state.cost, slots, batch=cache.batch)
        for s, n in zip(steps, plan):  # a request's own limit; where the grammar forces tokens, they are the draft
            s.asked = 0 if s.forced else min(n, s.most)
        self.propose(steps, [s.asked for s in steps])
        for s in steps:
            s.tree = DraftTree.imposed(s.forced) if s.forced else s.drafted

    def propose(self, steps: list[RowStep], sizes: list[int], judge=None) -> None:
        """Each row's draft tree (`drafted`) of at most its size's nodes (0: none). Rows that draft
        are proposed for together, one call per sampling setting; each row draws from its own
        random generator, so its draws are the same as when it runs by itself. `judge`: the cost
        model's, for a lookup (DraftInput.judge). A grammar's forced tokens are the draft's
        context (a lookup continues after them)."""
        groups: dict[SamplingParams, list[tuple[RowStep, int]]] = {}
        for s, size in zip(steps, sizes):
            if size > 0:  # one call per setting; each row draws from its own generator
                sampling = s.row.sampling
                key = SamplingParams() if sampling.greedy else dataclasses.replace(sampling, seed=None)
                groups.setdefault(key, []).append((s, size))
        for group in groups.values():
            rows = [s.row for s, _ in group]
            inp = DraftInput(
                [s.slot for s, _ in group],
                [r.prompt + r.out + s.forced for (s, _), r in zip(group, rows)],
                max(size for _, size in group),
                [r.left - len(s.forced) for (s, _), r in zip(group, rows)],
                rows[0].sampling,
                [r.rng for r in rows],
                # handed over once: the proposer keeps what it needs
                [r.take_features() for r in rows] if self.needs_features else None,
                judge,
            )
            drafted = self.proposer.propose(inp)
            if len(drafted) != len(group):
                raise SpecrtError(
                    f"draft method {self.proposer.name!r} returned {len(drafted)} trees for {len(group)} rows"
                )
            for (s, size), tree in zip(group, drafted):
                s.drafted = tree.truncate(size)

    def guess(self, steps: list[RowStep]) -> None:
        """A one-token guess for each row with nothing to verify: the step's floor computes a
        second position anyway (runtime/session.py), so the guess costs nothing and a right one
        is a token more. The first node of what a lookup drafted and the plan cut, else a
        one-token copy from the row's context (drafts/base.py `follower`); verified like any
        draft (a point mass, so sampling stays exact). None for a row whose request asked for no
        drafts, nor for one with a single token of budget left, nor on a step cut."""
        for s in steps:
            if len(s.tree) or s.row.cap == 0 or s.row.left <= 1 or (s.room is not None and s.room < 2):
                continue
            first = s.drafted.truncate(1) if len(s.drafted) else None
            s.tree, s.guessed = first or DraftTree.imposed([follower(s.row.prompt, s.row.out)]), True

    @staticmethod
    def depth_first(steps: list[RowStep]) -> None:
        """Each tree depth first (verification.DraftTree.depth_first), a grammar's mask with it:
        only the leading chain's logits are plain decoding's bits (verification.on_leading_chain)."""
        for s in steps:
            order = s.tree.preorder()
            if order is not None:
                s.tree = s.tree.reordered(order)
                if s.mask is not None:
                    s.mask = s.mask[np.concatenate([[0], 1 + order])]

    def verify(self, state: SpecState, steps: list[RowStep], cache: KVCache) -> StepOutput:
        """One target step over [root, draft nodes...] of every running row (root at depth 0)."""
        feed: list[list[int]] = [[] for _ in range(cache.batch)]
        shapes: list = [None] * cache.batch
        for s in steps:
            feed[s.slot] = [s.row.out[-1], *s.tree.tokens.tolist()]
            shapes[s.slot] = (np.concatenate([[0], s.depths]), s.tree.ancestor_mask())
        # greedy: the argmax is all accept reads, unless a row asks for its tokens' logprobs
        sampled = any(
            not s.row.sampling.greedy or s.row.top_logprobs is not None or s.row.matcher is not None for s in steps
        )
        return self.gen.session.forward(cache, feed, shapes, hidden=state.features, want_logits=sampled)

    def accept(self, steps: list[RowStep], out: StepOutput) -> None:
        """Each row's verdict; a constrained row's against the target masked at every node."""
        free = [s for s in steps if s.mask is None]
        top = out.argmax() if any(s.row.sampling.greedy for s in free) else None  # once, not per row
        for s in steps:
            n, row = len(s.tree) + 1, s.row
            # a greedy row's logits exist only when something asked for them (its grammar does)
            masked = None if s.mask is None else np.where(s.mask, out.logits[s.slot, :n], -np.inf)
            if row.sampling.greedy:
                s.verdict = accept_greedy(s.tree, top[s.slot, :n] if masked is None else masked.argmax(-1))
                if self.bitwise:  # off the leading chain a node's logits are not plain decoding's bits
                    s.verdict = on_leading_chain(s.tree, s.verdict)
            else:
                logits = out.logits[s.slot, :n] if masked is None else masked
                s.verdict = accept_sampling(s.tree, probs_from_logits(logits, row.sampling), row.rng)

    @staticmethod
    def forced(steps: list[RowStep]) -> None:
        """Per constrained row, the tokens its grammar forces next, as many as its draft may hold
        and its budget can use (grammar drafts: runtime/grammar.py)."""
        for s in steps:
            if s.row.matcher is not None:
                s.forced = s.row.matcher.forced(min(s.most, s.row.left - 1))

    @staticmethod
    def constrain(steps: list[RowStep]) -> None:
        """Per constrained row, the grammar's mask at the root and at every node (cutting the
        tree before a node it forbids where that is exact: runtime/grammar.py)."""
        for s in steps:
            if s.row.matcher is not None:
                cut = s.row.sampling.greedy or s.tree.q is None
                s.tree, s.mask = s.row.matcher.tree_masks(s.tree, cut)

    def emit(self, steps: list[RowStep]) -> None:
        """Each row's new tokens (the accepted path and the bonus, up to EOS or its budget), its
        grammar advanced over them."""
        for s in steps:
            s.new_tokens = s.row.emit(s.verdict.tokens(s.tree), self.eos_ids)
            if s.row.matcher is not None:
                s.row.matcher.advance(s.new_tokens)

    def commit(self, steps: list[RowStep], cache: KVCache, out: StepOutput) -> None:
        """Keep the root and the accepted path in the cache, the draft's features of them, and
        tell the proposer."""
        for s in steps:
            root = int(cache.lengths[s.slot]) - len(s.tree) - 1  # the step appended [root, nodes...]
            cache.keep_path(s.slot, root, s.verdict.accepted)
            if self.needs_features:  # the root's and the accepted nodes' features
                s.row.features.append(out.hidden_states[s.slot, [0, *(1 + i for i in s.verdict.accepted)]])
        self.proposer.commit([s.slot for s in steps], [s.tree for s in steps], [s.verdict for s in steps], out)

    @staticmethod
    def logprobs(steps: list[RowStep], out: StepOutput) -> None:
        """The rows that ask: each new token's log probability under the target at the position
        it came from (the root's, then one per accepted node; runtime/logprobs.py)."""
        for s in steps:
            top = s.row.top_logprobs
            if top is not None and s.new_tokens:
                at = [0, *(1 + i for i in s.verdict.accepted)]
                s.logprobs = token_logprobs(out.logits[s.slot, at], s.new_tokens, top)

    @staticmethod
    def tally(steps: list[RowStep]) -> None:
        """The rows whose request asked for its acceptance report: what the step verified and
        accepted of its draft (runtime/acceptance_report.py)."""
        for s in steps:
            if s.row.acceptance is not None:
                s.row.acceptance.observe(len(s.tree), len(s.verdict.accepted))

    # -- bookkeeping -----------------------------------------------------------------------------

    def observe(self, state: SpecState, r: StepRecord) -> None:
        """The step's cost and acceptance, into the metrics and the cost model."""
        for s in r.rows:
            accepted = len(s.verdict.accepted)
            for m in (state.metrics, s.row.metrics):
                if m is not None and s.guessed:
                    m.observe_guess(accepted)
                elif m is not None:
                    m.observe_draft(len(s.tree), accepted, s.depth)
                    if s.forced:
                        m.observe_forced(len(s.forced), accepted)
        drafted = sum(len(s.tree) for s in r.rows if not s.guessed) / len(r.rows)
        if self.policy.max_draft:  # a decoder that never drafts (plain) has no use for the cost model
            self._teach(state, r, drafted)
        state.drafted_per_step.append(drafted)
        state.metrics.step_seconds += r.verify_seconds
        state.metrics.draft_seconds += r.draft_seconds
        state.step_times.append(r.verify_seconds + r.draft_seconds)

    def _teach(self, state: SpecState, r: StepRecord, drafted: float) -> None:
        cost = state.cost
        if self.proposer.lookup:  # every draft, verified or not, read against what its row emitted (hindsight.py)
            for s in r.rows:
                out = s.row.out
                start = len(out) - len(s.new_tokens) + len(s.forced)  # drafted after the forced tokens
                for tree in (s.drafted, *s.drafted.rivals):
                    state.hindsight.draft(s.slot, tree, start)
                for reading in state.hindsight.read(s.slot, out):
                    cost.observe_reading(reading)
        # asked and not drafted counts too: the cost model plans by what it asks
        asked = [] if self.proposer.lookup else [s for s in r.rows if s.asked > 0]
        if asked:  # how far the estimates were off, before they move
            accepted = [len(s.verdict.accepted) for s in r.rows]
            cost.observe_gain([s.slot for s in r.rows], [s.asked for s in r.rows], accepted)
        with cost.batched_step():  # the rows' verdicts age the estimates by one step, not one per row
            for s in asked:
                cost.observe_acceptance(s.depth, len(s.verdict.accepted), s.slot, asked=s.asked, positions=len(s.tree))
        cost.observe_step(r.positions, r.batch, r.verify_seconds)
        cost.observe_draft(drafted, r.draft_seconds)

    def finish(self, state: SpecState) -> SpecMetrics | None:
        """The batch's metrics, with the cost model's fitted numbers and its predicted speedup
        (None for plain decoding: nothing drafts)."""
        if not self.policy.max_draft:
            return None
        metrics = state.metrics
        fitted = state.cost.cost(state.batch)
        if fitted is not None and metrics.steps:
            drafted = np.array(state.drafted_per_step)
            metrics.alpha, metrics.beta = fitted.alpha, fitted.beta
            metrics.draft_ratio = float(fitted.draft_ratio(drafted).mean())
            metrics.decode_step_seconds = fitted.decode
            # the cost model's speedup for the drafts this run made: tokens per step / mean step cost
            metrics.predicted_speedup = metrics.mean_accepted_length / float(fitted.relative(drafted).mean())
        return metrics
