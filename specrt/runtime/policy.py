"""Speculation length: a fixed N, or `auto`, which picks N each step from the cost model

    speedup(N) = E[tokens per step | N] / (1 + beta_B + alpha_B * positions_B(N) + T_draft(N) / T_decode)

with everything measured online:
    E[tokens | N] = 1 + sum_{i<=N} prod_{j<=i} a_j, a_j the rate at which depth j is accepted
                    when asked for and depth j-1 was accepted; a depth the draft did not fill
                    (a lookup without a match, a chain cut short) counts as not accepted, since
                    what is asked for is N (exponentially decayed counts; the prior of depth j
                    is two pseudo-observations at the rate of depth j-1, so depths not yet
                    drafted are expected to behave like the deepest one seen, and N can grow
                    into them);
    the positions a step verifies: a row asked for N drafts f_j of the time at least j tokens
                    (f: the fill rates, decayed counts, prior 1), and the step is dense (every
                    row is computed at the longest row's length), so B rows verify
                    E[max len] = sum_{j<=N} (1 - (1 - f_j)^B) positions past the root: one row
                    alone pays for what it drafted, a batch for its longest draft;
    T_decode      time of a plain step (no draft) at this batch size B;
    alpha, beta   a line t(P) = c0 + c1 * P through the verification steps (P = positions in the
                    step over the whole batch): alpha_B = c1 * B / T_decode is the cost of one
                    more draft position per row, beta_B = t(B) / T_decode - 1 the fixed extra
                    cost of any verification step. beta is the refinement of the textbook model:
                    on a CPU a step of Q = 2 costs ~12 % more than Q = 1 (matrix-vector vs
                    matrix-matrix kernels), then ~4 % per position. A larger batch makes alpha_B
                    larger, so speculation turns itself down;
    T_draft(N)    the proposer's time per step, d0 + d1 * N: a line through the drafts' times
                    when the proposer pays per drafted token (`cost_per_token`: a model runs once
                    per token), a constant for lookups.
N = 0 (plain decoding, speedup 1) is always a candidate, so speculation that does not pay is
switched off; while off, every `probe_every`-th step drafts a little to keep the estimates current.

In a batch (a static one, or the rows continuous batching runs together) the step is dense: the
graph computes B x Q positions, Q the longest row's, so the verification steps are observed at
B x Q positions and every drafting row drafts the batch's N (a shorter draft in one row saves
nothing while another row sets Q). A larger batch makes alpha_B larger, so N shrinks and then
speculation turns itself off. What a row can still do is stop drafting when its drafts keep
failing while its batch's succeed (`CostModel.failing`: its own decayed depth-1 rate, the batch's
as a prior worth two observations, under a third of the batch's): its drafts cost host work and
draft-model time for nothing. A row's evidence decays with every step, drafted or not, so a row
that stopped is tried again once its old failures have faded.

The estimates run high in a batch of mixed requests (the policy asks for N where they happen to
be highest, and the rows that copy their context keep them up), so each drafting step also
compares the extra tokens they predicted for the lengths asked with what the rows got, and
predictions are scaled by that decayed ratio (`calibration`, prior 1).

Lookups (the copy drafts: drafts/base.py `lookup`) are planned the other way round: every row
drafts first, up to max_draft, and the plan sees each draft and its evidence (DraftTree.evidence:
the method and the length of the context's suffix the copy continues) before it decides:

    reach_k(n)    E[accepted | the first n nodes of a draft of evidence k], from a_j of that
                    evidence: acceptance is learnt per evidence, not per batch or row, since
                    how far a copy is accepted follows how long its match is (a 1-token match
                    ~0.4 tokens, 8 or more tokens ~8-13, on the benchmark's answers);
    speedup(N)    (1 + mean_b reach_b(min(N, len_b))) / (1 + beta_B + alpha_B * N)
                    for N up to the longest draft (the step is dense: its positions are the
                    longest row's, and a shorter draft rides along for free); the lookups' own
                    time is spent already, whatever the plan;

and the counts come from hindsight (runtime/hindsight.py): every draft, verified or not, is read
against the tokens its row goes on to emit, so each evidence's acceptance is learnt from every
step, at no cost, and is not biased by which drafts the plan chose (so no calibration: scaling by
realized over predicted tokens cost 0.4 %, 3.2 % and 5.3 % on float32, gguf --split and gguf,
bench_policy.py's ablation over 3 seeds). Hence the rule that replaces probing: a draft is verified only on evidence
(`CostModel.backed`: hindsight read drafts like it), never on a prior alone, and drafts of a
method after a shorter match count for a longer one (a copy that has just begun is judged by how
its shorter matches fared, `CostModel._counts`). Rerun on 2026-12-05 under the step floor
(`bench_policy.py --ablate ... --noise 0.05`, 3 seeds, 36 runs, the geometric mean of auto over
auto without the rule, float32 / gguf / int8-a8): pooling +13.0 / +7.3 / +4.8 %, hindsight
+5.3 / +1.7 / +1.3 %, the gate +1.3 / -1.6 / +0.2 % (kept for float32; it costs the level-0 4-bit
engine). The plan also tells the lookups, by evidence, how
much of a draft is worth making (`AutoPolicy.judge`), and `auto` uses the same judgement to pick
between its members' drafts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specrt.runtime import estimators
from specrt.runtime.estimators import Acceptance, Calibration, DraftTimes, StepCurve, StepTimes
from specrt.runtime.verification import ON_DEMAND, DraftTree


@dataclasses.dataclass(frozen=True)
class StepCost:
    decode: float  # T_decode (seconds) at this batch size
    alpha: float  # per extra draft position per row, relative to T_decode
    beta: float  # fixed extra cost of a verification step, relative to T_decode
    draft0: float  # T_draft's fixed part, relative to T_decode
    draft1: float = 0.0  # T_draft per drafted token, relative to T_decode
    free: int = 0  # draft positions per row every step computes (CostModel's `free`): not paid for
    curve: StepCurve | None = None  # the build's step costs: the least a step of a size costs
    batch: int = 1  # the rows of the step (the curve reads the step's positions, all rows')
    seen: float = 0.0  # the most positions per row a timed step had past `free` (StepTimes' sizes): the line's
    # verification(n) as worked out, by n: a fit serves up to REFIT_STEPS steps of judgements, each
    # pricing every length of a draft (with the curve ~3 us a length: 70 us a judgement, 18 without)
    _prices: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def jump(self) -> float:
        """beta where a step may compute one position; 0 under the floor (the plain step has it)."""
        return 0.0 if self.free else self.beta

    def verification(self, n: float) -> float:
        """The extra cost of verifying n draft positions per row, relative to T_decode: the
        line's, or past the sizes it was fitted through the build's curve's where that is dearer
        (estimators.StepCurve)."""
        price = self._prices.get(n)
        if price is None:
            paid = n - self.free
            price = self._prices[n] = max(self.jump + self.alpha * paid, self.least(n)) if paid > 0 else 0.0
        return price

    def least(self, n):
        """What the build's step costs say n draft positions per row cost at least, past the sizes
        the line was fitted through (0 within them, or without the costs). Within them the line
        stands: a line through a convex curve runs over it in the middle, and max(line, curve)
        there overpriced the middle lengths (SmolLM2's int8-a8, bench_policy.py: gmean -3 to -4 %)."""
        if not self.curve:
            return 0.0 * n
        timed = 1 + n - self.free <= self.seen  # StepTimes counts positions past the free ones
        if not np.ndim(n) and timed:
            return 0.0
        price = self.curve.extra(self.batch * (1 + n), self.batch * (1 + self.free))
        return np.where(timed, 0.0, price) if np.ndim(n) else price

    def draft_ratio(self, n) -> np.ndarray:
        """T_draft(n) / T_decode."""
        n = np.asarray(n, dtype=np.float64)
        return np.where(n > 0, self.draft0 + self.draft1 * n, 0.0)

    def relative(self, n: np.ndarray) -> np.ndarray:
        """Cost of a step with n draft tokens per row, in plain decode steps."""
        n = np.asarray(n, dtype=np.float64)
        return 1.0 + np.vectorize(self.verification, otypes=[np.float64])(n) + self.draft_ratio(n)


class CostModel:
    """speedup(N) from the estimators of runtime/estimators.py, fed by the speculative loop."""

    def __init__(
        self,
        max_draft: int,
        decay: float = 0.98,
        window: int = 96,
        alpha_prior: float = 0.05,
        beta_prior: float = 0.1,
        draft_per_token: bool = False,
        free: int = 0,
        step_ms: dict | None = None,
    ):
        """free: draft positions per row a step computes whatever the plan (the session's floor
        less the root: a guess rides there, SpeculativeDecoder.guess). Step costs are read past
        them: a step of the floor is the plain step, and the first `free` drafts cost nothing.
        Nor is beta (the jump from a one-position step to a multi-position one: matrix-vector to
        matrix-matrix kernels) charged then: no step computes one position, the plain step paid it.
        step_ms: the engine's step costs measured at build (Capabilities.step_ms): the least a
        verification step's size costs, whatever the line through this run's steps says."""
        self.max_draft, self.decay, self.free = max_draft, decay, free
        self.curve = StepCurve(step_ms)
        self.accept = Acceptance(max_draft, decay)
        self._evidence: dict[tuple, list] = {}  # lookups' drafts: [acceptance, step aged to] by evidence
        self._pooled: dict[tuple, tuple] = {}  # evidence -> (stamp, counts): _counts of this step
        self.readings = 0  # hindsight's readings so far (a new one changes the counts)
        self.steps = StepTimes(window, alpha_prior, beta_prior)
        self.drafts = DraftTimes(window, draft_per_token)
        self.calibrated = Calibration(decay)
        self._fits: dict[int, tuple[StepCost | None, int]] = {}  # per batch size: the fit, and its step

    def observe_acceptance(
        self,
        drafted_depth: int,
        accepted: int,
        row: int | None = None,
        asked: int | None = None,
        positions: int | None = None,
    ) -> None:
        """One row's verified draft: how many tokens were asked for (default: the depth), how deep
        the draft went, how many positions it had (a tree: its nodes; default: the depth) and how
        many were accepted (of `row`, when given, also into that row's own counts)."""
        asked = drafted_depth if asked is None else asked
        positions = drafted_depth if positions is None else positions
        self.accept.observe(drafted_depth, accepted, row, asked, positions)

    def batched_step(self):
        """The rows' observations of one step, aged once (Acceptance.age)."""
        return self.accept.batched_step()

    # -- drafts the plan sees before it decides (lookups): acceptance by their evidence -----------

    def evidence(self, key: tuple) -> Acceptance:
        """The acceptance of drafts with this evidence (DraftTree.evidence), from its prior on,
        its counts aged to this step (every target step ages them, as the batch's; lazily, as
        most evidence is not seen on most steps)."""
        entry = self._evidence.get(key)
        if entry is None:
            entry = self._evidence[key] = [Acceptance(self.max_draft, self.decay, evidence_prior(key)), 0]
        acc, at = entry
        if not on_demand(key):
            acc.age(self.accept.steps - at)
        entry[1] = self.accept.steps
        return acc

    def _counts(self, key: tuple) -> tuple[list[float], list[float]]:
        """(tried, hit) by depth of the drafts of this evidence or of the same method after a
        shorter match: a longer match is accepted at least as well, so a copy that has just
        begun is judged by how the row's shorter matches fared (each bucket of match length
        alone would wait for a draft of that very length). Read once per step and evidence."""
        stamp = (self.accept.steps, self.readings)
        cached = self._pooled.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        tried, hit = np.zeros(self.max_draft), np.zeros(self.max_draft)
        for other in list(self._evidence):
            if other == key or (len(key) > 1 and len(other) > 1 and other[0] == key[0] and other[1] < key[1]):
                acc = self.evidence(other)
                tried += acc.tried
                hit += acc.hit
        counts = tried.tolist(), hit.tolist()
        self._pooled[key] = stamp, counts
        return counts

    def rates_of(self, key: tuple) -> list[float]:
        """The acceptance by depth of a draft of this evidence: its pooled counts (`_counts`),
        each depth's prior two observations at the rate of the depth before (the first: the
        evidence's prior)."""
        tried, hit = self._counts(key)
        rates, prior = [], evidence_prior(key)
        for h, t in zip(hit, tried):
            prior = (h + 2.0 * prior) / (t + 2.0)
            rates.append(prior)
        return rates

    def backed(self, key: tuple) -> bool:
        """Whether hindsight has read enough drafts of this evidence (estimators.BACKED decayed
        drafts, shorter matches of its method included) for their acceptance to be believed:
        a draft is verified on what drafts like it did, never on a prior alone."""
        return self._counts(key)[0][0] >= estimators.BACKED

    def observe_reading(self, r) -> None:
        """What hindsight read of a draft (runtime/hindsight.Reading), into its evidence's counts:
        a draft that ended short of its size missed the depth after its last hit. A member that
        drafts only when served (`on_demand`) ages by its own drafts, at the first reading of each."""
        acc = self.evidence(r.evidence)
        if r.depth == 0 and on_demand(r.evidence):
            acc.age()
        acc.observe_path(r.depth, r.hits, r.ended and r.depth + r.hits < r.size)
        self.readings += 1

    def reach(self, tree, length: int | None = None) -> list[float]:
        """E[accepted tokens] when the first n nodes of `tree` are verified, n = 0 .. len(tree), by
        the acceptance of drafts with its evidence (`tree` may be the evidence, with the draft's
        `length`). (Plain Python here and in draft_speedups: on 17 numbers numpy's calls cost
        more than the arithmetic, and this runs every step.)"""
        evidence, length = (tree, length) if length is not None else (tree.evidence, len(tree))
        out, p, total = [0.0], 1.0, 0.0
        for a in self.rates_of(evidence)[:length]:
            p *= a
            total += p
            out.append(total)
        return out

    def draft_speedups(self, batch: int, reaches: list[list[float]], own=None) -> list[float]:
        """speedup(N) for N = 0 .. the longest draft, when each row verifies the first min(N, its
        draft's length) nodes of its draft (`reach`: what each prefix is expected to give). The
        step is dense, so its positions are the longest row's; the lookups are paid already.
        `own(N)`: the time a draft of N tokens still costs, over a target step's (a model drafting
        inside auto), in the denominator beside the verification's."""
        cost = self.cost(batch) or self.prior_cost(batch)
        scale = 1.0 / len(reaches)  # not calibrated: hindsight reads every draft, chosen or not
        out = [1.0]
        for n in range(1, max(len(r) for r in reaches)):
            gain = sum(r[n] if n < len(r) else r[-1] for r in reaches)
            out.append((1.0 + scale * gain) / (1.0 + cost.verification(n) + (own(n) if own else 0.0)))
        return out

    def forget_row(self, row: int) -> None:
        """The row's request is over (continuous batching hands its slot to another)."""
        self.accept.forget_row(row)

    def row_acceptance(self, row: int) -> np.ndarray:
        return self.accept.row_rates(row)

    def failing(self, row: int) -> bool:
        return self.accept.failing(row)

    def acceptance(self) -> np.ndarray:
        return self.accept.rates()

    def fill_rates(self) -> np.ndarray:
        return self.accept.fill_rates()

    def observe_step(self, positions: int, batch: int, seconds: float) -> None:
        """One target step over `positions` positions for `batch` rows (positions == batch: no
        draft; the floor's free positions are not counted: a step of the floor is the plain one)."""
        self.steps.observe(max(positions - self.free * batch, batch), batch, seconds)
        self.accept.next_step()

    def observe_draft(self, tokens_per_row: float, seconds: float) -> None:
        """One proposer call that drafted `tokens_per_row` tokens per row on average."""
        self.drafts.observe(tokens_per_row, seconds)

    def cost(self, batch: int) -> StepCost | None:
        """The step and draft costs at this batch size, refitted every step at first and every
        REFIT_STEPS target steps from step REFIT_STEPS**2 on (a fit reads the whole window of
        times: ~50 us a step here, a third of a plan)."""
        fit, at = self._fits.get(batch, (None, -REFIT_STEPS))
        if fit is None or self.accept.steps - at >= min(REFIT_STEPS, 1 + at // REFIT_STEPS):
            times = self.steps.fit(batch)
            if times is not None:
                decode, alpha, beta = times
                d0, d1 = self.drafts.line()
                drafts = d0 / decode, d1 / decode
                fit = StepCost(decode, alpha, beta, *drafts, self.free, self.curve, batch, self.steps.seen())
            self._fits[batch] = fit, self.accept.steps
        return fit

    def prior_cost(self, batch: int) -> StepCost:
        """The costs before any step was timed: the priors (and the build's curve)."""
        alpha, beta = self.steps.alpha_prior, self.steps.beta_prior
        return StepCost(1.0, alpha, beta, 0.0, free=self.free, curve=self.curve, batch=batch)

    def observe_gain(self, rows: list[int], asked: list[int], accepted: list[int]) -> None:
        """One drafting step's extra tokens per row (beyond the one every step brings): what the
        acceptance estimates predicted for the lengths asked, and what the rows got. Call before
        the step's verdicts go into the estimates (`asked`, `accepted`: in `rows`' order)."""
        rates = np.stack([self.accept.row_rates(b) for b in rows])
        reach = np.cumsum(np.cumprod(rates, axis=1), axis=1)  # E[accepted | asked n] at column n - 1
        predicted = np.mean([reach[i, n - 1] if n > 0 else 0.0 for i, n in enumerate(asked)])
        self.calibrated.observe(float(predicted), float(np.mean(accepted)))

    def calibration(self) -> float:
        return self.calibrated.ratio()

    def expected_tokens(self) -> np.ndarray:
        """(max_draft + 1,) E[tokens per step] for N = 0 .. max_draft."""
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.acceptance()))])

    def expected_positions(self, batch: int) -> np.ndarray:
        """(max_draft + 1,) draft positions a dense step of `batch` rows verifies per row, for
        N = 0 .. max_draft: the expected longest draft (module docstring)."""
        some = 1.0 - (1.0 - self.fill_rates()) ** batch  # some row drafted depth j
        return np.concatenate([[0.0], np.cumsum(some)])

    def row_expected_tokens(self, rows: list[int], upper: bool = False) -> np.ndarray:
        """(max_draft + 1,) E[tokens per row | N], the mean over the rows of each row's own
        (its acceptance: its counts, the batch's rates as the prior; a failing row drafts nothing,
        so it brings one token whatever N is). `upper`: the most it can grow to before anything
        more is observed (a row's counts decay every step toward the batch's rates, and a row
        stops failing), each row's rates the larger of its own and the batch's."""
        if upper:
            rates = np.stack([np.maximum(self.row_acceptance(b), self.acceptance()) for b in rows])
        else:
            rates = np.stack([np.zeros(self.max_draft) if self.failing(b) else self.row_acceptance(b) for b in rows])
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(rates, axis=1).mean(axis=0))])

    def speedups(self, batch: int, rows: list[int] | None = None, upper: bool = False) -> np.ndarray:
        """speedup(N) for N = 0 .. max_draft; with `rows`, E[tokens] from each row's own acceptance
        (`upper`: the most it can drift to while nothing is observed, `row_expected_tokens`)."""
        cost = self.cost(batch) or self.prior_cost(batch)
        n = np.arange(self.max_draft + 1)
        positions = self.expected_positions(batch)
        k = min(self.free, self.max_draft)  # positions the floor computes whatever N: not paid for
        paid = np.maximum(positions - positions[k], 0.0)
        some = positions[k + 1] - positions[k] if k < self.max_draft else 0.0  # a row drafted past them
        drafts = np.where(n > k, some, 0.0)
        verification = np.maximum(cost.jump * drafts + cost.alpha * paid, cost.least(positions))
        relative = 1.0 + verification + cost.draft_ratio(n)
        expected = self.expected_tokens() if rows is None else self.row_expected_tokens(rows, upper)
        return (1.0 + self.calibration() * (expected - 1.0)) / relative


EMPTY = DraftTree.empty()
REFIT_STEPS = 8  # target steps a fit of the step costs is kept
PRIOR_MATCH = 2.0  # m / (m + 2): a 1-token match's prior 0.33, 8 tokens 0.8, 32 tokens 0.94


PRIOR_ON_DEMAND = 0.5  # nothing known of a member's drafts: even odds


def on_demand(key: tuple) -> bool:
    """Whether drafts of this evidence are made only when served (auto's head or draft model,
    verification.ON_DEMAND), not on every step as a lookup's. Such evidence ages by its own
    drafts, not by target steps: between its drafts nothing is learnt of it, and a member probed
    every 8-64 steps faded below BACKED between probes (at 0.98 a step), so it was never backed,
    never judged, and only ever probed: the 0.5B draft model inside auto on the 1.5B, 3 probes in
    an answer of 128 tokens, its evidence at most 1.7 drafts."""
    return len(key) > 1 and key[1] == ON_DEMAND


def evidence_prior(key: tuple) -> float:
    """Depth 1's acceptance before any draft of this evidence was read: a lookup that matched m
    tokens of context continues with m / (m + PRIOR_MATCH); a member's drafts, PRIOR_ON_DEMAND
    (m / (m + 2) put them at 0, so three drafts accepted at 0.82 read as 0.49). It shapes an
    estimate that has few readings; it never makes a draft verified (CostModel.backed)."""
    if on_demand(key):
        return PRIOR_ON_DEMAND
    m = key[1] if len(key) > 1 else 1
    return m / (m + PRIOR_MATCH)


class FixedPolicy:
    def __init__(self, num_draft: int):
        self.max_draft = num_draft
        self.setting = num_draft  # what --num-draft said

    def plan(self, model: CostModel, rows: list[int], trees=None, batch: int | None = None) -> list[int]:
        """Draft tokens per row: N for every row."""
        return [self.max_draft] * len(rows)

    def judge(self, model: CostModel, batch: int):
        return None  # every draft is verified to N


class AutoPolicy:
    """N per step from the cost model (module docstring); while speculation is off, a probe
    drafts `probe_draft` tokens every `probe_every` steps. While off, the estimates move only by
    the rows' own counts fading toward the batch's (nothing drafts, so nothing else is
    observed): when even the most they can fade to does not pay, the plan is not worked out
    again before the next probe (its reading of the estimates took ~0.25 ms a step here, on
    an 11-16 ms step), unless the batch changes."""

    setting = "auto"  # what --num-draft said

    def __init__(self, max_draft: int = 16, probe_every: int = 8, probe_draft: int = 2):
        self.max_draft = max_draft
        self.probe_every, self.probe_draft = probe_every, probe_draft
        self._off_steps = 0
        self._quiet: int | None = None  # off, and stays off at this batch size until the next probe

    def num_draft(self, model: CostModel, batch: int, rows: list[int] | None = None) -> int:
        if self._quiet == batch and (self._off_steps + 1) % self.probe_every:
            self._off_steps += 1
            return 0
        self._quiet = None
        n = int(np.argmax(model.speedups(batch, rows)))
        if n == 0:
            self._off_steps += 1
            if self._off_steps % self.probe_every == 0:
                return self.probe_draft
            if rows is None or int(np.argmax(model.speedups(batch, rows, upper=True))) == 0:
                self._quiet = batch
        else:
            self._off_steps = 0
        return n

    def plan(self, model: CostModel, rows: list[int], trees=None, batch: int | None = None) -> list[int]:
        """Draft tokens per row (in `rows`' order): the batch's N (`num_draft`), except for rows whose drafts keep
        failing (`CostModel.failing`), which draft nothing; a probe drafts a little on every row.
        `trees`: a lookup's drafts, one per row, already made: how much of each to verify (`plan_drafts`).
        `batch`: the rows the step computes (default: `rows`), whose costs the plan weighs."""
        batch = batch or len(rows)
        if trees is not None:
            return self.plan_drafts(model, rows, trees, batch)
        n = self.num_draft(model, batch, rows)
        if n == 0 or self._off_steps > 0:  # off, or probing while off
            return [n] * len(rows)
        return [0 if model.failing(b) else n for b in rows]

    def judge(self, model: CostModel, batch: int):
        """DraftInput.judge: a draft of this evidence and length, alone at this batch size's
        costs, is worth its prefix of the best speedup (CostModel.draft_speedups); a lookup need
        not make the rest (growing a suffix tree is ~60 us here, beside a 10 ms step). In a batch
        a row's draft counts for less than alone (its gain is shared by the batch's step), so
        what is not worth making alone is not worth it there either. Drafts of evidence not
        backed by hindsight are worth making in full (hindsight reads them) and promise nothing
        (they are not verified). `own`: a drafting member's time (CostModel.draft_speedups)."""

        def judge(evidence: tuple, most: int, own=None) -> tuple[int, float]:
            if not model.backed(evidence):
                return most, 1.0
            speedups = model.draft_speedups(batch, [model.reach(evidence, most)], own)
            n = max(range(len(speedups)), key=speedups.__getitem__)
            return n, speedups[n]

        return judge

    def plan_drafts(self, model: CostModel, rows: list[int], trees, batch: int | None = None) -> list[int]:
        """The N that maximizes the step's speedup when each row verifies the first min(N, its
        length) nodes of its draft, each draft judged by its evidence (CostModel.draft_speedups)."""
        # a draft is verified on evidence only: its acceptance read in hindsight, never its prior alone
        backed = [t if len(t) and model.backed(t.evidence) else EMPTY for t in trees]
        # every backed draft rides along up to the step's length (the step is dense: they cost nothing
        # more). A bet no deeper than twice the depths hindsight had read (a horizon) went on
        # 2026-12-05: under the step floor it bought -1.0 to +1.6 % on a steady clock and cost 3 % of
        # the geometric mean under load, with the worst prompt unchanged (bench_policy.py)
        n = self._best(model, batch or len(rows), backed)
        return [min(n, len(t)) for t in backed]

    @staticmethod
    def _best(model: CostModel, batch: int, trees: list) -> int:
        if not any(len(t) for t in trees):
            return 0
        speedups = model.draft_speedups(batch, [model.reach(t) for t in trees])
        return max(range(len(speedups)), key=speedups.__getitem__)  # the first of equals, as argmax
