"""Speculative decoding: prefill, then repeat { propose → verify → accept → commit }.

    spec = SpeculativeDecoder(Generator.from_engine(...), make_proposer("suffix"), make_policy("auto"))
    result = spec.generate("Rewrite this code ...", max_new_tokens=256)
    print(result.text, result.metrics.summary())

One step of `SpeculativeDecoder.step`, for the active rows of a batch (its `SpecState`: the rows
the batching engine runs together, runtime/batching.py, the one generation loop):
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
(runtime/row.py); the state holds only what belongs to the batch.

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
from specrt.runtime.backends.base import StepOutput
from specrt.runtime.drafts.base import DraftInput, Proposer, follower
from specrt.runtime.hindsight import Hindsight
from specrt.runtime.kv_cache import KVCache
from specrt.runtime.logprobs import token_logprobs
from specrt.runtime.metrics import SpecMetrics
from specrt.runtime.policy import AutoPolicy, CostModel, FixedPolicy
from specrt.runtime.row import Row
from specrt.runtime.sampling import SamplingParams, probs_from_logits
from specrt.runtime.session import Prefilled, exactness_warning
from specrt.runtime.target import Rows, Target
from specrt.runtime.verification import DraftTree, Verdict, accept_greedy, accept_sampling, on_leading_chain


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
    """The bookkeeping of a batch (`SpeculativeDecoder.new_state`): its slots (each a Row while a
    request holds it, runtime/row.py: whatever belongs to one request is there), the rows' tokens
    (`Rows`), its cache, the cost model, the lookups' drafts under hindsight, and the batch's
    metrics and step times."""

    slots: list[Row | None]  # the batching engine's slots (the same list)
    rows: Rows
    cost: CostModel
    features: bool = False  # its steps return the target's features (the draft's or an observer's need)
    cache: KVCache | None = None  # the rows' cache (the batching engine's view of the rows in use)
    metrics: SpecMetrics = dataclasses.field(default_factory=SpecMetrics)  # every row's steps
    step_times: list[float] = dataclasses.field(default_factory=list)
    drafted_per_step: list[float] = dataclasses.field(default_factory=list)
    hindsight: Hindsight = dataclasses.field(default_factory=Hindsight)  # a lookup's drafts, read as rows emit

    def constrained(self, rows) -> dict[int, Row]:
        """The rows among `rows` with a grammar."""
        return {b: self.slots[b] for b in rows if self.slots[b].matcher is not None}


@dataclasses.dataclass
class StepRecord:
    """What one speculative step did, for `observe`."""

    rows: list[int]
    asked: dict[int, int]  # per row, the draft length the policy asked for
    trees: dict[int, DraftTree]
    depths: dict[int, np.ndarray]  # per row, each node's depth
    verdicts: dict[int, Verdict]
    drafted: dict[int, DraftTree]  # per row, what a lookup drafted before the plan cut it (else: the trees)
    batch: int  # rows the target step computed (the cache's: idle slots among the rows included)
    positions: int  # computed by the target step: batch x the longest row's positions
    draft_seconds: float
    verify_seconds: float
    new_tokens: dict[int, list[int]]  # per row, the tokens it emitted
    out: StepOutput | None = None  # the target step's output (its features, for step observers)
    logprobs: dict[int, list] = dataclasses.field(default_factory=dict)  # per row asking: a TokenLogprob per token
    forced: dict[int, int] = dataclasses.field(default_factory=dict)  # per row: its grammar's tokens ahead of the draft
    guessed: set[int] = dataclasses.field(default_factory=set)  # rows whose tree is the floor's guess alone


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
        # +0.7 % on float32 / gguf / int8-a8, and it lowered the geometric mean under load), so it went
        return CostModel(
            max(self.policy.max_draft, 1), draft_per_token=self.proposer.cost_per_token, free=self.gen.session.floor - 1
        )

    def new_state(self, slots: list[Row | None], features: bool = False) -> SpecState:
        """The bookkeeping of a batch whose slots are `slots` (none of them generating yet);
        `features`: its steps return the target's features even where the draft reads none (a
        step observer's need, runtime/batching.py)."""
        rows = Rows(np.zeros(len(slots), np.int64), np.zeros(len(slots), np.int64), self.gen.eos_ids)
        rows.active[:] = False
        return SpecState(slots, rows, self.new_cost_model(), features=features or self.needs_features)

    def join(self, state: SpecState, b: int, out: StepOutput, features: np.ndarray | None = None) -> StepRecord:
        """Row b's prompt is in the cache (`out`: the prefill's last step, that one row; `features`:
        every prompt position's, when the state keeps them): it starts generating, and its first
        token is made as every other is, a step whose tree is empty (the prefill computed the
        root's logits). Returns that step's record."""
        row = state.slots[b]
        state.rows.join(b, len(row.prompt), row.budget)
        row.metrics = SpecMetrics() if self.policy.max_draft else None
        row.features = [features] if self.needs_features else []
        hidden = None if features is None else [features]
        self.proposer.begin([b], [row.prompt], Prefilled(out.logits[:, 0], hidden))
        out, trees = out.at_row(b), {b: DraftTree.empty()}
        masks = self.constrain(state, trees)
        verdicts = self.accept(state, [b], trees, out, masks)
        new_tokens = self.emit(state, [b], trees, verdicts)
        logprobs = self.logprobs(state, [b], verdicts, out, new_tokens)
        return StepRecord([b], {b: 0}, trees, {}, verdicts, trees, 1, 1, 0.0, 0.0, new_tokens, logprobs=logprobs)

    def leave(self, state: SpecState, b: int) -> None:
        """Row b finished or was cancelled: the proposer and the cost model forget it."""
        self.proposer.end([b], [state.rows.out[b]])
        state.cost.forget_row(b)
        state.hindsight.forget(b)

    def step(self, state: SpecState) -> StepRecord:
        """One speculative step over the active rows: propose → verify → accept → commit."""
        rows = [int(b) for b in np.flatnonzero(state.rows.active)]
        # the rows the step computes: the cache's, idle slots among them included (a dense step
        # pads them to the longest row): what a step costs, and so what the plan weighs
        batch = state.cache.batch
        t0 = time.perf_counter()
        plan, drafted, trees, forced = self.draft(state, rows, batch)
        guessed = self.guess(state, rows, trees, drafted) if self.floored else {}
        trees = {**trees, **guessed}
        masks = self.constrain(state, trees)
        if self.bitwise:  # the best guess at every depth on the leading chain
            trees, masks = self.depth_first(trees, masks)
        t1 = time.perf_counter()
        depths = {b: trees[b].depths() for b in rows}  # once per step: verify and observe read them
        out = self.verify(state, rows, trees, depths)
        verdicts = self.accept(state, rows, trees, out, masks)
        new_tokens = self.emit(state, rows, trees, verdicts)
        self.commit(state, rows, trees, verdicts, out)
        logprobs = self.logprobs(state, rows, verdicts, out, new_tokens)
        # the step is dense: every row is computed at the longest row's length, the floor at least
        positions = batch * max(self.gen.session.floor, *(len(trees[b]) + 1 for b in rows))
        record = StepRecord(
            rows, plan, trees, depths, verdicts, drafted, batch, positions, t1 - t0, time.perf_counter() - t1,
            new_tokens, out, logprobs, {b: len(f) for b, f in forced.items() if f}, set(guessed),
        )  # fmt: skip
        self.observe(state, record)
        return record

    # -- the verbs -------------------------------------------------------------------------------

    def draft(self, state: SpecState, rows: list[int], batch: int):
        """Each row's draft tree and how much of it to verify: (the plan: per row the draft length
        the policy asked for, what was drafted, the trees to verify, the tokens each constrained
        row's grammar forces ahead of its draft). A lookup drafts first (it is cheap: the plan
        sees every row's draft, then cuts it); any other draft is asked for the planned length."""
        caps = {b: state.slots[b].cap for b in rows}
        most = {b: self.policy.max_draft if caps[b] is None else min(self.policy.max_draft, caps[b]) for b in rows}
        # a tree stops before the row's next step cut (the root is one of the step's positions)
        room = self.gen.session.room(state.cache)
        most = {b: most[b] if room[b] is None else max(0, min(most[b], room[b] - 1)) for b in rows}
        forced = self.forced(state, rows, most)
        if self.proposer.lookup:
            judge = self.policy.judge(state.cost, batch)
            # a copy draft continues after the tokens the row's grammar forces
            most = {b: most[b] - len(forced.get(b, ())) for b in rows}
            drafted = self.propose(state, rows, most, judge, forced)
            plan = self.policy.plan(state.cost, rows, drafted, batch)
            trees = {b: tree.truncate(plan[b]).behind(forced.get(b, ())) for b, tree in drafted.items()}
            return plan, drafted, trees, forced
        plan = self.policy.plan(state.cost, rows, batch=batch)
        # a request's own limit (Request.max_draft); where the grammar forces tokens, they are the draft
        plan = {b: 0 if forced.get(b) else min(n, most[b]) for b, n in plan.items()}
        drafted = self.propose(state, rows, plan)
        trees = {b: DraftTree.imposed(forced[b]) if forced.get(b) else tree for b, tree in drafted.items()}
        return plan, drafted, trees, forced

    def propose(
        self, state: SpecState, rows: list[int], plan: dict[int, int], judge=None, ahead=None
    ) -> dict[int, DraftTree]:
        """A draft tree per row, of at most as many nodes as the plan gives the row (0: none). Rows
        that draft are proposed for together, one call per sampling setting; each row draws from
        its own random generator, so its draws are the same as when it runs by itself. `judge`:
        the cost model's, for a lookup (DraftInput.judge); `ahead`: per row, tokens the draft
        comes after (a grammar's forced tokens: the lookup reads them as context)."""
        ahead = ahead or {}
        trees = {b: DraftTree.empty() for b in rows}
        groups: dict[SamplingParams, list[int]] = {}
        for b in rows:
            if plan[b] > 0:  # one call per setting; each row draws from its own generator
                sampling = state.slots[b].sampling
                key = SamplingParams() if sampling.greedy else dataclasses.replace(sampling, seed=None)
                groups.setdefault(key, []).append(b)
        out, budget = state.rows.out, state.rows.budget
        for group in groups.values():
            slots = [state.slots[b] for b in group]
            n = max(plan[b] for b in group)
            # handed over once: the proposer keeps what it needs
            features = [s.take_features() for s in slots] if self.needs_features else None
            inp = DraftInput(
                group,
                [s.prompt + out[b] + list(ahead.get(b, ())) for b, s in zip(group, slots)],
                n,
                [int(budget[b]) - len(out[b]) - len(ahead.get(b, ())) for b in group],
                slots[0].sampling,
                [s.rng for s in slots],
                features,
                judge,
            )
            drafted = self.proposer.propose(inp)
            if len(drafted) != len(group):
                raise SpecrtError(
                    f"draft method {self.proposer.name!r} returned {len(drafted)} trees for {len(group)} rows"
                )
            trees.update({b: tree.truncate(plan[b]) for b, tree in zip(group, drafted)})
        return trees

    def guess(
        self, state: SpecState, rows: list[int], trees: dict[int, DraftTree], drafted: dict[int, DraftTree]
    ) -> dict[int, DraftTree]:
        """A one-token guess for each row with nothing to verify: the step's floor computes a
        second position anyway (runtime/session.py), so the guess costs nothing and a right one
        is a token more. The first node of what a lookup drafted and the plan cut, else a
        one-token copy from the row's context (drafts/base.py `follower`); verified like any
        draft (a point mass, so sampling stays exact). None for a row whose request asked for no
        drafts, nor for one with a single token of budget left."""
        out, guessed = state.rows.out, {}
        room = self.gen.session.room(state.cache)
        for b in rows:
            if len(trees[b]) or state.slots[b].cap == 0 or len(out[b]) + 1 >= state.rows.budget[b]:
                continue
            if room[b] is not None and room[b] < 2:
                continue  # the guess would sit on a step cut
            tree = drafted.get(b)
            first = tree.truncate(1) if tree is not None and len(tree) else None
            guessed[b] = first or DraftTree.imposed([follower(state.slots[b].prompt, out[b])])
        return guessed

    @staticmethod
    def depth_first(trees: dict[int, DraftTree], masks: dict[int, np.ndarray]):
        """Each tree depth first (verification.DraftTree.depth_first), a grammar's masks with it:
        only the leading chain's logits are plain decoding's bits (verification.on_leading_chain)."""
        orders = {b: t.preorder() for b, t in trees.items()}
        trees = {b: t if orders[b] is None else t.reordered(orders[b]) for b, t in trees.items()}
        for b, m in masks.items():
            if orders[b] is not None:
                masks[b] = m[np.concatenate([[0], 1 + orders[b]])]
        return trees, masks

    def verify(
        self, state: SpecState, rows: list[int], trees: dict[int, DraftTree], depths: dict[int, np.ndarray]
    ) -> StepOutput:
        """One target step over [root, draft nodes...] of every active row (root at depth 0)."""
        B = state.cache.batch
        feed: list[list[int]] = [[] for _ in range(B)]
        shapes: list = [None] * B
        for b in rows:
            feed[b] = [state.rows.out[b][-1], *trees[b].tokens.tolist()]
            shapes[b] = (np.concatenate([[0], depths[b]]), trees[b].ancestor_mask())
        # greedy: the argmax is all accept reads, unless a row asks for its tokens' logprobs
        slots = [state.slots[b] for b in rows]
        sampled = any(not s.sampling.greedy or s.top_logprobs is not None or s.matcher is not None for s in slots)
        return self.gen.session.forward(state.cache, feed, shapes, hidden=state.features, want_logits=sampled)

    def accept(
        self, state: SpecState, rows: list[int], trees: dict[int, DraftTree], out: StepOutput, masks=None
    ) -> dict[int, Verdict]:
        """Each row's verdict; a constrained row's against the target masked at every node (`masks`)."""
        verdicts, masks = {}, masks or {}
        free = [b for b in rows if b not in masks]
        top = out.argmax() if any(state.slots[b].sampling.greedy for b in free) else None  # once, not per row
        for b in rows:
            n, row = len(trees[b]) + 1, state.slots[b]
            # a greedy row's logits exist only when something asked for them (its grammar does)
            masked = np.where(masks[b], out.logits[b, :n], -np.inf) if b in masks else None
            if row.sampling.greedy:
                verdicts[b] = accept_greedy(trees[b], top[b, :n] if masked is None else masked.argmax(-1))
                if self.bitwise:  # off the leading chain a node's logits are not plain decoding's bits
                    verdicts[b] = on_leading_chain(trees[b], verdicts[b])
            else:
                logits = out.logits[b, :n] if masked is None else masked
                verdicts[b] = accept_sampling(trees[b], probs_from_logits(logits, row.sampling), row.rng)
        return verdicts

    def forced(self, state: SpecState, rows: list[int], most: dict[int, int]) -> dict[int, list[int]]:
        """Per constrained row, the tokens its grammar forces next, as many as its draft may hold
        and its budget can use (grammar drafts: runtime/grammar.py)."""
        out, budget = state.rows.out, state.rows.budget
        return {
            b: r.matcher.forced(min(most[b], int(budget[b]) - len(out[b]) - 1))
            for b, r in state.constrained(rows).items()
        }

    def constrain(self, state: SpecState, trees: dict[int, DraftTree]) -> dict[int, np.ndarray]:
        """Per constrained row, the grammar's mask at the root and at every node (cutting the
        tree before a node it forbids where that is exact: runtime/grammar.py)."""
        masks = {}
        for b, row in state.constrained(trees).items():
            cut = row.sampling.greedy or trees[b].q is None
            trees[b], masks[b] = row.matcher.tree_masks(trees[b], cut)
        return masks

    def emit(
        self, state: SpecState, rows: list[int], trees: dict[int, DraftTree], verdicts: dict[int, Verdict]
    ) -> dict[int, list[int]]:
        """Each row's new tokens (the accepted path and the bonus, up to EOS or its budget), its
        grammar advanced over them."""
        new_tokens = {}
        for b in rows:
            new_tokens[b] = state.rows.emit(b, verdicts[b].tokens(trees[b]))
            if state.slots[b].matcher is not None:
                state.slots[b].matcher.advance(new_tokens[b])
        return new_tokens

    def commit(
        self,
        state: SpecState,
        rows: list[int],
        trees: dict[int, DraftTree],
        verdicts: dict[int, Verdict],
        out: StepOutput,
    ) -> None:
        """Keep the root and the accepted path in the cache, the draft's features of them, and
        tell the proposer."""
        for b in rows:
            root = int(state.cache.lengths[b]) - len(trees[b]) - 1  # the step appended [root, nodes...]
            state.cache.keep_path(b, root, verdicts[b].accepted)
            if self.needs_features:  # the root's and the accepted nodes' features
                state.slots[b].features.append(out.hidden_states[b, [0, *(1 + i for i in verdicts[b].accepted)]])
        self.proposer.commit(rows, [trees[b] for b in rows], [verdicts[b] for b in rows], out)

    def logprobs(self, state: SpecState, rows, verdicts, out: StepOutput, new_tokens) -> dict[int, list]:
        """The rows that ask: each new token's log probability under the target at the position
        it came from (the root's, then one per accepted node; runtime/logprobs.py)."""
        got = {}
        for b in rows:
            top = state.slots[b].top_logprobs
            if top is not None and new_tokens[b]:
                at = [0, *(1 + i for i in verdicts[b].accepted)]
                got[b] = token_logprobs(out.logits[b, at], new_tokens[b], top)
        return got

    # -- bookkeeping -----------------------------------------------------------------------------

    def observe(self, state: SpecState, r: StepRecord) -> None:
        """The step's cost and acceptance, into the metrics and the cost model."""
        metrics = state.metrics
        for b in r.rows:
            tree, verdict = r.trees[b], r.verdicts[b]
            depth = int(r.depths[b].max()) if len(tree) else 0
            for m in (metrics, state.slots[b].metrics):
                if m is not None and b in r.guessed:
                    m.observe_guess(len(verdict.accepted))
                elif m is not None:
                    m.observe_draft(len(tree), len(verdict.accepted), depth)
                    if b in r.forced:
                        m.observe_forced(r.forced[b], len(verdict.accepted))
        drafted = sum(len(r.trees[b]) for b in r.rows if b not in r.guessed) / len(r.rows)
        if self.policy.max_draft:  # a decoder that never drafts (plain) has no use for the cost model
            self._teach(state, r, drafted)
        state.drafted_per_step.append(drafted)
        metrics.step_seconds += r.verify_seconds
        metrics.draft_seconds += r.draft_seconds
        state.step_times.append(r.verify_seconds + r.draft_seconds)

    def _teach(self, state: SpecState, r: StepRecord, drafted: float) -> None:
        cost, lookup = state.cost, self.proposer.lookup
        if not lookup and any(r.asked[b] > 0 for b in r.rows):  # how far the estimates were off, before they move
            cost.observe_gain(r.rows, r.asked, {b: len(r.verdicts[b].accepted) for b in r.rows})
        if lookup:  # every draft, verified or not, read against what its row emitted (hindsight.py)
            for b in r.rows:
                out = state.rows.out[b]
                start = len(out) - len(r.new_tokens[b]) + r.forced.get(b, 0)  # drafted after the forced tokens
                for tree in (r.drafted[b], *r.drafted[b].rivals):
                    state.hindsight.draft(b, tree, start)
                for reading in state.hindsight.read(b, out):
                    cost.observe_reading(reading)
        with cost.batched_step():  # the rows' verdicts age the estimates by one step, not one per row
            for b in r.rows:
                tree, verdict = r.trees[b], r.verdicts[b]
                # asked and not drafted counts too: the cost model plans by what it asks
                if not lookup and r.asked[b] > 0:
                    depth = int(r.depths[b].max()) if len(tree) else 0
                    cost.observe_acceptance(depth, len(verdict.accepted), b, asked=r.asked[b], positions=len(tree))
        cost.observe_step(r.positions, r.batch, r.verify_seconds)
        cost.observe_draft(drafted, r.draft_seconds)

    def finish(self, state: SpecState) -> SpecMetrics | None:
        """The batch's metrics, with the cost model's fitted numbers and its predicted speedup
        (None for plain decoding: nothing drafts)."""
        if not self.policy.max_draft:
            return None
        metrics = state.metrics
        fitted = state.cost.cost(len(state.slots))
        if fitted is not None and metrics.steps:
            drafted = np.array(state.drafted_per_step)
            metrics.alpha, metrics.beta = fitted.alpha, fitted.beta
            metrics.draft_ratio = float(fitted.draft_ratio(drafted).mean())
            metrics.decode_step_seconds = fitted.decode
            # the cost model's speedup for the drafts this run made: tokens per step / mean step cost
            metrics.predicted_speedup = metrics.mean_accepted_length / float(fitted.relative(drafted).mean())
        return metrics
