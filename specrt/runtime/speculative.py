"""Speculative decoding: prefill, then repeat { propose → verify → accept → commit }.

    spec = SpeculativeDecoder(Generator.from_engine(...), make_proposer("suffix"), make_policy("auto"))
    result = spec.generate("Rewrite this code ...", max_new_tokens=256)
    print(result.text, result.metrics.summary())

One step of `SpeculativeDecoder.step`, for the active rows of a batch (a static one here, or the
rows continuous batching runs together: runtime/batching.py, on the same `SpecState`):
    propose  the policy picks each row's N from the cost model; the proposer drafts a tree per
             row (greedy rows in one call, a seeded sampled row with its own generator)
    verify   one target step over [root, draft nodes...] per row, at positions length + depth
             with the tree's ancestor mask (rows may draft different amounts)
    accept   greedy: the path matching the target's argmax; sampling: recursive rejection
             (verification.py): the output follows the target exactly
    commit   the cache keeps the root and the accepted path (`KVCache.keep_path`), the rows emit
             their tokens, and the proposer hears the verdicts (so a draft with state rolls back)
and `observe` feeds what the step cost and accepted to the metrics and the cost model.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import numpy as np

from specrt.engines.ort import BATCH_VARIANCE_LIMIT
from specrt.errors import SpecrtError
from specrt.runtime.backends.base import StepOutput
from specrt.runtime.drafts.base import DraftInput, Proposer
from specrt.runtime.generator import GenerationResult, Generator, Rows, Started, Stream, generation, text_stream
from specrt.runtime.kv_cache import KVCache
from specrt.runtime.metrics import SpecMetrics
from specrt.runtime.policy import AutoPolicy, CostModel, FixedPolicy
from specrt.runtime.sampling import SamplingParams, probs_from_logits
from specrt.runtime.verification import DraftTree, Verdict, accept_greedy, accept_sampling


def batch_variance_warning(caps) -> str | None:
    """A warning when the backend's logits for a position depend on how many positions a step
    computes (measured when its engine was built): then verification can disagree with plain
    decoding on near ties, and speculative output is not guaranteed to equal plain output."""
    measured = caps.batch_invariance
    if not measured or measured["relative"] <= BATCH_VARIANCE_LIMIT:
        return None
    return (
        f"this engine's logits change by up to {measured['relative']:.1%} of their range between one-position and "
        "multi-position "
        "steps (int8 activations?), so speculative output may differ from plain output; for exact speculative "
        "decoding "
        f"use a float32 engine or a weight-only one (build-engines --quantize int4, not an -a8 scheme)."
    )


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
    """The speculative bookkeeping of a batch: its rows (what each produced), its cache, each
    row's sampling and randomness, the cost model. A static batch (`iter_generate`) builds one
    from `Started` (its rows share the request's sampling and random generator); continuous
    batching (batching.py) keeps one whose rows come and go, each with its own."""

    prompts: list[list[int]]  # per row
    rows: Rows
    cache: KVCache  # the rows' cache (continuous batching: a view of the rows in use)
    sampling: list[SamplingParams]  # per row
    rng: list[np.random.Generator]  # per row (may be one shared generator)
    cost: CostModel
    metrics: SpecMetrics = dataclasses.field(default_factory=SpecMetrics)
    # per row: the target's features at the positions committed since the proposer last saw the
    # row (the prompt's at first); None unless the proposer needs features
    pending: list[list[np.ndarray]] | None = None
    step_times: list[float] = dataclasses.field(default_factory=list)
    drafted_per_step: list[float] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, st: Started, sampling: SamplingParams, cost: CostModel) -> "SpecState":
        B = len(st.prompts)
        pending = None if st.prefilled.hidden is None else [[h] for h in st.prefilled.hidden]
        return cls(st.prompts, st.rows, st.cache, [sampling] * B, [st.rng] * B, cost, pending=pending)


@dataclasses.dataclass
class StepRecord:
    """What one speculative step did, for `observe`."""

    rows: list[int]
    asked: dict[int, int]  # per row, the draft length the policy asked for
    trees: dict[int, DraftTree]
    depths: dict[int, np.ndarray]  # per row, each node's depth
    verdicts: dict[int, Verdict]
    positions: int  # computed by the target step: rows x the longest row's positions
    draft_seconds: float
    verify_seconds: float
    new_tokens: list[list[int]]


class SpeculativeDecoder:
    def __init__(self, generator: Generator, proposer: Proposer, policy=None):
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
        self.exactness_warning = batch_variance_warning(generator.session.caps)
        if self.exactness_warning:
            warnings.warn(self.exactness_warning, stacklevel=2)

    @property
    def eos_ids(self):
        return self.gen.eos_ids

    # -- the generation --------------------------------------------------------------------------

    def iter_generate(
        self, prompts: list[list[int]], max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams()
    ) -> Stream[list[list[int]], list[GenerationResult]]:
        """Iterating yields, after every step, the new tokens of each row (possibly none); `result`
        is then one GenerationResult per row, each carrying the batch's SpecMetrics."""
        # room for the longest output plus one unverified draft
        return generation(
            self.gen,
            prompts,
            max_new_tokens,
            sampling,
            self._loop,
            headroom=self.policy.max_draft + 1,
            hidden=self.proposer.needs_features,
        )

    def new_cost_model(self) -> CostModel:
        return CostModel(max(self.policy.max_draft, 1), draft_per_token=self.proposer.cost_per_token)

    def _loop(self, st: Started, sampling: SamplingParams):
        rows = list(range(len(st.prompts)))
        state = SpecState.of(st, sampling, self.new_cost_model())
        self.proposer.begin(rows, st.prompts, st.prefilled)
        try:
            yield [st.rows.emit(b, [st.first[b]]) for b in rows]
            while st.rows.active.any():
                yield self.step(state).new_tokens
        finally:
            self.proposer.end(rows, st.rows.out)
        return st.rows.results(st.prefill_seconds, state.step_times, self.finish(state))

    def step(self, state: SpecState) -> StepRecord:
        """One speculative step over the active rows: propose → verify → accept → commit."""
        rows = [int(b) for b in np.flatnonzero(state.rows.active)]
        t0 = time.perf_counter()
        plan = self.policy.plan(state.cost, rows)
        trees = self.propose(state, rows, plan)
        t1 = time.perf_counter()
        depths = {b: trees[b].depths() for b in rows}  # once per step: verify and observe read them
        out = self.verify(state, rows, trees, depths)
        verdicts = self.accept(state, rows, trees, out)
        new_tokens = self.commit(state, rows, trees, verdicts, out)
        # the step is dense: every row is computed at the longest row's length
        positions = len(rows) * max(len(trees[b]) + 1 for b in rows)
        elapsed = time.perf_counter() - t1
        record = StepRecord(rows, plan, trees, depths, verdicts, positions, t1 - t0, elapsed, new_tokens)
        self.observe(state, record)
        return record

    # -- the verbs -------------------------------------------------------------------------------

    def propose(self, state: SpecState, rows: list[int], plan: dict[int, int]) -> dict[int, DraftTree]:
        """A draft tree per row, of at most as many nodes as the plan gives the row (0: none). Rows
        that draft are proposed for together, one call per sampling setting (greedy rows
        together; a sampled row with its own random generator alone, so its draws are the same
        as when it runs by itself)."""
        trees = {b: DraftTree.empty() for b in rows}
        groups: dict[tuple, list[int]] = {}
        for b in rows:
            if plan[b] > 0:
                sampling = state.sampling[b]
                key = ("greedy",) if sampling.greedy else (id(sampling), id(state.rng[b]))
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
                [state.prompts[b] + state.rows.out[b] for b in group],
                n,
                [int(state.rows.budget[b]) - len(state.rows.out[b]) for b in group],
                state.sampling[group[0]],
                state.rng[group[0]],
                features,
            )
            drafted = self.proposer.propose(inp)
            if len(drafted) != len(group):
                raise SpecrtError(
                    f"draft method {self.proposer.name!r} returned {len(drafted)} trees for {len(group)} rows"
                )
            trees.update({b: tree.truncate(plan[b]) for b, tree in zip(group, drafted)})
        return trees

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
        sampled = any(not state.sampling[b].greedy for b in rows)  # greedy: the argmax is all accept reads
        return self.gen.session.forward(
            state.cache, feed, shapes, hidden=self.proposer.needs_features, want_logits=sampled
        )

    def accept(
        self, state: SpecState, rows: list[int], trees: dict[int, DraftTree], out: StepOutput
    ) -> dict[int, Verdict]:
        verdicts = {}
        for b in rows:
            n, sampling = len(trees[b]) + 1, state.sampling[b]
            if sampling.greedy:
                verdicts[b] = accept_greedy(trees[b], out.argmax()[b, :n])
            else:
                verdicts[b] = accept_sampling(trees[b], probs_from_logits(out.logits[b, :n], sampling), state.rng[b])
        return verdicts

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
            if state.pending is not None:  # the root's and the accepted nodes' features
                state.pending[b].append(out.hidden_states[b, [0, *(1 + i for i in verdicts[b].accepted)]])
        self.proposer.commit(rows, [trees[b] for b in rows], [verdicts[b] for b in rows], out)
        return new_tokens

    # -- bookkeeping -----------------------------------------------------------------------------

    def observe(self, state: SpecState, r: StepRecord) -> None:
        """The step's cost and acceptance, into the metrics and the cost model."""
        cost, metrics = state.cost, state.metrics
        if any(r.asked[b] > 0 for b in r.rows):  # how far the estimates were off, before they move
            cost.observe_gain(r.rows, r.asked, {b: len(r.verdicts[b].accepted) for b in r.rows})
        with cost.batched_step():  # the rows' verdicts age the estimates by one step, not one per row
            for b in r.rows:
                tree, verdict = r.trees[b], r.verdicts[b]
                depth = int(r.depths[b].max()) if len(tree) else 0
                metrics.observe_draft(len(tree), len(verdict.accepted), depth)
                if r.asked[b] > 0:  # asked and not drafted counts too: the cost model plans by what it asks
                    cost.observe_acceptance(depth, len(verdict.accepted), b, asked=r.asked[b], positions=len(tree))
        drafted = sum(len(r.trees[b]) for b in r.rows) / len(r.rows)
        cost.observe_step(r.positions, len(r.rows), r.verify_seconds)
        cost.observe_draft(drafted, r.draft_seconds)
        state.drafted_per_step.append(drafted)
        metrics.step_seconds += r.verify_seconds
        metrics.draft_seconds += r.draft_seconds
        state.step_times.append(r.verify_seconds + r.draft_seconds)

    def finish(self, state: SpecState) -> SpecMetrics:
        """The metrics, with the cost model's fitted numbers and its predicted speedup."""
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

    # -- conveniences ----------------------------------------------------------------------------

    def generate_ids(self, prompts, max_new_tokens=128, sampling=SamplingParams()) -> list[GenerationResult]:
        return self.iter_generate(prompts, max_new_tokens, sampling).run()

    def stream(
        self, prompt: str, max_new_tokens=128, sampling=SamplingParams(), chat=True, system=None
    ) -> Stream[str, GenerationResult]:
        """Text pieces; `result` is then the GenerationResult with metrics."""
        return text_stream(
            self.gen, self.iter_generate([self.gen.encode_prompt(prompt, chat, system)], max_new_tokens, sampling)
        )

    def generate(
        self, prompt: str, max_new_tokens=128, sampling=SamplingParams(), chat=True, system=None
    ) -> GenerationResult:
        ids = self.gen.encode_prompt(prompt, chat, system)
        result = self.generate_ids([ids], max_new_tokens, sampling)[0]
        result.text = self.gen.decode(result.token_ids)
        return result
