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
             with the tree's ancestor mask (rows may draft different amounts); with the floor,
             each tree depth first, so the best guess at every depth is its leading chain
    accept   greedy: the path matching the target's argmax (with the floor, cut where it leaves
             the leading chain, whose logits alone are plain decoding's bits:
             verification.on_leading_chain); sampling: recursive rejection (verification.py):
             the output follows the target exactly (a constrained row's target masked at every
             node)
    commit   the cache keeps the root and the accepted path (`KVCache.keep_path`), the rows emit
             their tokens, and the proposer hears the verdicts (so a draft with state rolls back)
and `observe` feeds what the step cost and accepted to the metrics and the cost model. A row's
life around its steps is `join` (its prompt is in) and `leave` (it finished or was cancelled).

Both runners, this decoder and the Generator (plain decoding: a decoder with no draft, N = 0),
have the static conveniences of runtime/generates.py (`generate_ids`, `iter_generate`, `stream`,
`generate`: the batching engine with every request arriving at step 0).
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.backends.base import StepOutput
from specrt.runtime.batching import Request
from specrt.runtime.drafts.base import DraftInput, Proposer, follower
from specrt.runtime.estimators import step_priors
from specrt.runtime.generates import Generates
from specrt.runtime.grammar import Matcher
from specrt.runtime.hindsight import Hindsight
from specrt.runtime.kv_cache import KVCache
from specrt.runtime.logprobs import token_logprobs
from specrt.runtime.metrics import SpecMetrics
from specrt.runtime.policy import AutoPolicy, CostModel, FixedPolicy
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
    """The speculative bookkeeping of a batch (`SpeculativeDecoder.new_state`): its rows (what
    each produced), its cache, each row's sampling, random generator and metrics, and the cost
    model; rows come and go (`join`, `leave`)."""

    prompts: list[list[int]]  # per row
    rows: Rows
    cache: KVCache | None  # the rows' cache (the batching engine's view of the rows in use)
    sampling: list[SamplingParams]  # per row
    rng: list[np.random.Generator | None]  # per row
    cost: CostModel
    row_metrics: list[SpecMetrics | None]  # per row, while it runs (None: plain decoding)
    metrics: SpecMetrics = dataclasses.field(default_factory=SpecMetrics)  # every row's steps
    # per row: the target's features at the positions committed since the proposer last saw the
    # row (the prompt's at first); None unless the proposer needs features
    pending: list[list[np.ndarray]] | None = None
    step_times: list[float] = dataclasses.field(default_factory=list)
    drafted_per_step: list[float] = dataclasses.field(default_factory=list)
    hindsight: Hindsight = dataclasses.field(default_factory=Hindsight)  # a lookup's drafts, read as rows emit
    caps: dict[int, int] = dataclasses.field(default_factory=dict)  # per row, its request's max_draft if it set one
    logprobs: dict[int, int] = dataclasses.field(default_factory=dict)  # per row asking: its top_logprobs
    grammars: dict[int, Matcher] = dataclasses.field(default_factory=dict)  # per constrained row (grammar.py)


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
    new_tokens: list[list[int]]
    logprobs: dict[int, list] = dataclasses.field(default_factory=dict)  # per row asking: a TokenLogprob per token
    forced: dict[int, int] = dataclasses.field(default_factory=dict)  # per row: its grammar's tokens ahead of the draft
    guessed: set[int] = dataclasses.field(default_factory=set)  # rows whose tree is the floor's guess alone


class SpeculativeDecoder(Generates):
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

    @property
    def decoder(self) -> "SpeculativeDecoder":
        return self

    @property
    def floored(self) -> bool:
        """Whether every step computes two positions per row or more (runtime/session.py)."""
        return self.gen.session.floor > 1

    @property
    def eos_ids(self):
        return self.gen.eos_ids

    @property
    def needs_features(self) -> bool:
        return self.proposer.needs_features

    # -- a row's life ------------------------------------------------------------------------------

    def new_cost_model(self) -> CostModel:
        # the priors: the engine's step costs measured when it was built, where it has them
        floor = self.gen.session.floor
        priors = step_priors(self.gen.session.caps.step_ms, floor)
        alpha_beta = dict(zip(("alpha_prior", "beta_prior"), priors)) if priors else {}
        return CostModel(
            max(self.policy.max_draft, 1), draft_per_token=self.proposer.cost_per_token, free=floor - 1, **alpha_beta
        )

    def new_state(self, batch: int) -> SpecState:
        """The bookkeeping of a batch of `batch` rows, none of them running yet."""
        rows = Rows(np.zeros(batch, np.int64), np.zeros(batch, np.int64), self.gen.eos_ids)
        rows.active[:] = False
        pending = [[] for _ in range(batch)] if self.needs_features else None
        return SpecState(
            [[] for _ in range(batch)],
            rows,
            None,
            [SamplingParams()] * batch,
            [None] * batch,
            self.new_cost_model(),
            [None] * batch,
            pending=pending,
        )

    def join(
        self,
        state: SpecState,
        b: int,
        request: Request,
        rng: np.random.Generator,
        budget: int,
        prefilled: Prefilled,
        matcher: Matcher | None = None,
    ) -> None:
        """Row b's prompt is in the cache (`prefilled` holds that one row): it starts generating;
        `matcher`: its grammar's state after its first token, when it has one."""
        state.rows.join(b, len(request.prompt), budget)
        state.prompts[b], state.sampling[b], state.rng[b] = request.prompt, request.sampling, rng
        state.row_metrics[b] = SpecMetrics() if self.policy.max_draft else None
        state.caps.pop(b, None)
        if request.max_draft is not None:
            state.caps[b] = max(0, request.max_draft)
        state.logprobs.pop(b, None)
        if request.logprobs is not None:
            state.logprobs[b] = request.logprobs
        state.grammars.pop(b, None)
        if matcher is not None:
            state.grammars[b] = matcher
        if state.pending is not None:
            state.pending[b] = [prefilled.hidden[0]]
        self.proposer.begin([b], [request.prompt], prefilled)

    def leave(self, state: SpecState, b: int) -> None:
        """Row b finished or was cancelled: the proposer and the cost model forget it."""
        self.proposer.end([b], [state.rows.out[b]])
        state.cost.forget_row(b)
        state.hindsight.forget(b)
        state.caps.pop(b, None)
        state.logprobs.pop(b, None)
        state.grammars.pop(b, None)
        state.row_metrics[b] = None
        if state.pending is not None:
            state.pending[b] = []

    def step(self, state: SpecState) -> StepRecord:
        """One speculative step over the active rows: propose → verify → accept → commit."""
        rows = [int(b) for b in np.flatnonzero(state.rows.active)]
        # the rows the step computes: the cache's, idle slots among them included (a dense step
        # pads them to the longest row): what a step costs, and so what the plan weighs
        batch = state.cache.batch
        t0 = time.perf_counter()
        caps = state.caps
        most = {b: min(self.policy.max_draft, caps.get(b, self.policy.max_draft)) for b in rows}
        forced = self.forced(state, rows, most) if state.grammars else {}
        if self.proposer.lookup:  # drafting is cheap: see every row's draft, then decide how much to verify
            judge = self.policy.judge(state.cost, batch)
            # a copy draft continues after the tokens the row's grammar forces
            most = {b: most[b] - len(forced.get(b, ())) for b in rows}
            drafted = self.propose(state, rows, most, judge, forced)
            plan = self.policy.plan(state.cost, rows, drafted, batch)
            trees = {b: tree.truncate(plan[b]).behind(forced.get(b, ())) for b, tree in drafted.items()}
        else:
            plan = self.policy.plan(state.cost, rows, batch=batch)
            # a request's own limit (Request.max_draft); where the grammar forces tokens, they are the draft
            plan = {b: 0 if forced.get(b) else min(n, most[b]) for b, n in plan.items()}
            drafted = trees = self.propose(state, rows, plan)
            trees = {b: DraftTree.chain(forced[b]) if forced.get(b) else tree for b, tree in trees.items()}
        guessed = self.guess(state, rows, trees, drafted) if self.floored else {}
        trees = {**trees, **guessed}
        masks = self.constrain(state, trees) if state.grammars else {}
        if self.floored:  # the best guess at every depth on the leading chain
            trees, masks = self.depth_first(trees, masks)
        t1 = time.perf_counter()
        depths = {b: trees[b].depths() for b in rows}  # once per step: verify and observe read them
        out = self.verify(state, rows, trees, depths)
        verdicts = self.accept(state, rows, trees, out, masks)
        new_tokens = self.commit(state, rows, trees, verdicts, out)
        logprobs = self.logprobs(state, rows, verdicts, out, new_tokens)
        # the step is dense: every row is computed at the longest row's length, the floor at least
        positions = batch * max(self.gen.session.floor, *(len(trees[b]) + 1 for b in rows))
        elapsed = time.perf_counter() - t1
        record = StepRecord(
            rows, plan, trees, depths, verdicts, drafted, batch, positions, t1 - t0, elapsed, new_tokens, logprobs
        )
        record.forced = {b: len(f) for b, f in forced.items() if f}
        record.guessed = set(guessed)
        self.observe(state, record)
        return record

    # -- the verbs -------------------------------------------------------------------------------

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
                sampling = state.sampling[b]
                key = SamplingParams() if sampling.greedy else dataclasses.replace(sampling, seed=None)
                groups.setdefault(key, []).append(b)
        for group in groups.values():
            n = max(plan[b] for b in group)
            features = None
            if state.pending is not None:  # handed over once: the proposer keeps what it needs
                features = [np.concatenate(state.pending[b]) for b in group]
                for b in group:
                    state.pending[b] = []
            inp = DraftInput(
                group,
                [state.prompts[b] + state.rows.out[b] + list(ahead.get(b, ())) for b in group],
                n,
                [int(state.rows.budget[b]) - len(state.rows.out[b]) - len(ahead.get(b, ())) for b in group],
                state.sampling[group[0]],
                [state.rng[b] for b in group],
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
        for b in rows:
            if len(trees[b]) or state.caps.get(b) == 0 or len(out[b]) + 1 >= state.rows.budget[b]:
                continue
            tree = drafted.get(b)
            first = tree.truncate(1) if tree is not None and len(tree) else None
            guessed[b] = first or DraftTree.chain([follower(state.prompts[b], out[b])])
        return guessed

    @staticmethod
    def depth_first(trees: dict[int, DraftTree], masks: dict[int, np.ndarray]):
        """Each tree depth first (verification.DraftTree.depth_first), a grammar's masks with it:
        only the leading chain's logits are plain decoding's bits (verification.on_leading_chain)."""
        trees = {b: t.depth_first() for b, t in trees.items()}
        for b, m in masks.items():
            if trees[b].origin is not None:
                masks[b] = m[np.concatenate([[0], 1 + trees[b].origin])]
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
        sampled = any(not state.sampling[b].greedy or b in state.logprobs or b in state.grammars for b in rows)
        return self.gen.session.forward(
            state.cache, feed, shapes, hidden=self.proposer.needs_features, want_logits=sampled
        )

    def accept(
        self, state: SpecState, rows: list[int], trees: dict[int, DraftTree], out: StepOutput, masks=None
    ) -> dict[int, Verdict]:
        """Each row's verdict; a constrained row's against the target masked at every node (`masks`)."""
        verdicts, masks = {}, masks or {}
        free = [b for b in rows if b not in masks]
        top = out.argmax() if any(state.sampling[b].greedy for b in free) else None  # once, not per row
        for b in rows:
            n, sampling = len(trees[b]) + 1, state.sampling[b]
            # a greedy row's logits exist only when something asked for them (its grammar does)
            masked = np.where(masks[b], out.logits[b, :n], -np.inf) if b in masks else None
            if sampling.greedy:
                verdicts[b] = accept_greedy(trees[b], top[b, :n] if masked is None else masked.argmax(-1))
                if self.floored:  # off the leading chain a node's logits are not plain decoding's bits
                    verdicts[b] = on_leading_chain(trees[b], verdicts[b])
            else:
                logits = out.logits[b, :n] if masked is None else masked
                verdicts[b] = accept_sampling(trees[b], probs_from_logits(logits, sampling), state.rng[b])
        return verdicts

    def forced(self, state: SpecState, rows: list[int], most: dict[int, int]) -> dict[int, list[int]]:
        """Per constrained row, the tokens its grammar forces next, as many as its draft may hold
        and its budget can use (grammar drafts: runtime/grammar.py)."""
        out = state.rows.out
        return {
            b: g.forced(min(most[b], int(state.rows.budget[b]) - len(out[b]) - 1))
            for b, g in state.grammars.items()
            if b in most
        }

    def constrain(self, state: SpecState, trees: dict[int, DraftTree]) -> dict[int, np.ndarray]:
        """Per constrained row, the grammar's mask at the root and at every node (cutting the
        tree before a node it forbids where that is exact: runtime/grammar.py)."""
        masks = {}
        for b, g in state.grammars.items():
            if b in trees:
                cut = state.sampling[b].greedy or trees[b].q is None
                trees[b], masks[b] = g.tree_masks(trees[b], cut)
        return masks

    def commit(
        self,
        state: SpecState,
        rows: list[int],
        trees: dict[int, DraftTree],
        verdicts: dict[int, Verdict],
        out: StepOutput,
    ) -> list[list[int]]:
        """Keep the root and the accepted path in the cache, emit the tokens, tell the proposer;
        returns each row's new tokens."""
        new_tokens: list[list[int]] = [[] for _ in range(state.cache.batch)]
        for b in rows:
            root = int(state.cache.lengths[b]) - len(trees[b]) - 1  # the step appended [root, nodes...]
            state.cache.keep_path(b, root, verdicts[b].accepted)
            new_tokens[b] = state.rows.emit(b, verdicts[b].tokens(trees[b]))
            if b in state.grammars:
                state.grammars[b].advance(new_tokens[b])
            if state.pending is not None:  # the root's and the accepted nodes' features
                state.pending[b].append(out.hidden_states[b, [0, *(1 + i for i in verdicts[b].accepted)]])
        self.proposer.commit(rows, [trees[b] for b in rows], [verdicts[b] for b in rows], out)
        return new_tokens

    def logprobs(self, state: SpecState, rows, verdicts, out: StepOutput, new_tokens) -> dict[int, list]:
        """The rows that ask: each new token's log probability under the target at the position
        it came from (the root's, then one per accepted node; runtime/logprobs.py)."""
        got = {}
        for b in rows:
            if b in state.logprobs and new_tokens[b]:
                at = [0, *(1 + i for i in verdicts[b].accepted)]
                got[b] = token_logprobs(out.logits[b, at], new_tokens[b], state.logprobs[b])
        return got

    # -- bookkeeping -----------------------------------------------------------------------------

    def observe(self, state: SpecState, r: StepRecord) -> None:
        """The step's cost and acceptance, into the metrics and the cost model."""
        metrics = state.metrics
        for b in r.rows:
            tree, verdict = r.trees[b], r.verdicts[b]
            depth = int(r.depths[b].max()) if len(tree) else 0
            for m in (metrics, state.row_metrics[b]):
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
        fitted = state.cost.cost(len(state.prompts))
        if fitted is not None and metrics.steps:
            drafted = np.array(state.drafted_per_step)
            metrics.alpha, metrics.beta = fitted.alpha, fitted.beta
            metrics.draft_ratio = float(fitted.draft_ratio(drafted).mean())
            metrics.decode_step_seconds = fitted.decode
            # the cost model's speedup for the drafts this run made: tokens per step / mean step cost
            metrics.predicted_speedup = metrics.mean_accepted_length / float(fitted.relative(drafted).mean())
        return metrics
