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
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import statistics

import numpy as np

TRUST = 3  # observations of a size before its median is believed
ROW_EVIDENCE = 4.0  # a row's decayed depth-1 drafts before it may be judged failing
ROW_FAILING = 1 / 3  # ... failing: its rate under this share of the batch's
SPIKE = 3.0  # a less-observed size this many times dearer than the priors predict is a spike


@dataclasses.dataclass(frozen=True)
class StepCost:
    decode: float  # T_decode (seconds) at this batch size
    alpha: float  # per extra draft position per row, relative to T_decode
    beta: float  # fixed extra cost of a verification step, relative to T_decode
    draft0: float  # T_draft's fixed part, relative to T_decode
    draft1: float = 0.0  # T_draft per drafted token, relative to T_decode

    def draft_ratio(self, n) -> np.ndarray:
        """T_draft(n) / T_decode."""
        n = np.asarray(n, dtype=np.float64)
        return np.where(n > 0, self.draft0 + self.draft1 * n, 0.0)

    def relative(self, n: np.ndarray) -> np.ndarray:
        """Cost of a step with n draft tokens per row, in plain decode steps."""
        n = np.asarray(n, dtype=np.float64)
        return 1.0 + np.where(n > 0, self.beta + self.alpha * n, 0.0) + self.draft_ratio(n)


def _by_size(observations) -> list[tuple[float, float, int]]:
    """(size, robust time, count) per distinct size of (size, seconds) observations, by size."""
    groups: dict[float, list[float]] = collections.defaultdict(list)
    for size, t in observations:
        groups[size].append(t)
    return [(size, _robust(ts), len(ts)) for size, ts in sorted(groups.items())]


def _robust(times: list[float]) -> float:
    """A size's time: the median once trusted, the fastest before (noise only slows steps).
    (statistics.median: on these few values it is ~20x faster than numpy's, and this runs every step)"""
    return statistics.median(times) if len(times) >= TRUST else min(times)


class CostModel:
    """Online estimates of T_decode, alpha, beta, T_draft(N) and per-depth acceptance."""

    def __init__(
        self,
        max_draft: int,
        decay: float = 0.98,
        window: int = 96,
        alpha_prior: float = 0.05,
        beta_prior: float = 0.1,
        draft_per_token: bool = False,
    ):
        self.max_draft = max_draft
        self.decay = decay
        self.tried = np.zeros(max_draft)  # decayed counts: depth j was asked for and j-1 accepted
        self.hit = np.zeros(max_draft)  # ... and depth j was accepted
        self.reach = np.zeros(max_draft)  # decayed counts: a row was asked for depth j or more
        self.fill = np.zeros(max_draft)  # ... and drafted at least j positions
        self.plain_steps: collections.deque = collections.deque(maxlen=window)  # (batch, seconds)
        self.spec_steps: collections.deque = collections.deque(maxlen=window)  # (positions, seconds)
        self.drafts: collections.deque = collections.deque(maxlen=window)  # (draft tokens per row, seconds)
        self.alpha_prior, self.beta_prior = alpha_prior, beta_prior
        self.draft_per_token = draft_per_token
        self._fits: dict[int, StepCost | None] = {}  # per batch size, cleared by each new step
        self._rows: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}  # row -> (tried, hit, at step)
        self._steps = 0  # target steps observed (a row's evidence decays per step)
        self._batched = False  # inside batched_step
        self._acceptance: np.ndarray | None = None  # acceptance() of the current counts
        self.gain_predicted = 0.0  # decayed sums over drafting steps: extra tokens per row predicted
        self.gain_realized = 0.0  # ... and got

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
        tested = min(asked, accepted + 1, self.max_draft)  # depths asked for whose verdict we know
        if not self._batched:  # one row's draft per step: it is the step
            self.decay_acceptance()
        self.tried[:tested] += 1
        self.hit[: min(accepted, self.max_draft)] += 1
        self._acceptance = None
        self.reach[: min(asked, self.max_draft)] += 1
        self.fill[: min(positions, asked, self.max_draft)] += 1
        if row is not None:
            tried, hit = self._row_counts(row)
            tried[:tested] += 1
            hit[: min(accepted, self.max_draft)] += 1
            self._rows[row] = (tried, hit, self._steps)

    def decay_acceptance(self) -> None:
        """Age the acceptance counts by one step. A batch calls this once per step before its rows'
        `observe_acceptance` (`batched_step`), so the memory is ~1 / (1 - decay) steps whatever
        the batch size (per row it would be a few steps of a large batch: noisy estimates, and
        the largest of noisy estimates is the one the policy picks)."""
        for counts in (self.tried, self.hit, self.reach, self.fill):
            counts *= self.decay
        self._acceptance = None

    @contextlib.contextmanager
    def batched_step(self):
        """The rows' observations of one step, aged once (see `decay_acceptance`)."""
        self.decay_acceptance()
        self._batched = True
        try:
            yield
        finally:
            self._batched = False

    def _row_counts(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """A row's counts decayed to now (copies)."""
        if row not in self._rows:
            return np.zeros(self.max_draft), np.zeros(self.max_draft)
        tried, hit, at = self._rows[row]
        f = self.decay ** (self._steps - at)
        return tried * f, hit * f

    def forget_row(self, row: int) -> None:
        """The row's request is over (continuous batching hands its slot to another)."""
        self._rows.pop(row, None)

    def row_acceptance(self, row: int) -> np.ndarray:
        """(max_draft,) the row's acceptance rate per depth: its own counts, the batch's rates as a
        prior worth two observations."""
        tried, hit = self._row_counts(row)
        return (hit + 2.0 * self.acceptance()) / (tried + 2.0)

    def failing(self, row: int) -> bool:
        """The row's drafts keep failing where the batch's succeed (module docstring)."""
        tried, _ = self._row_counts(row)
        return bool(tried[0] >= ROW_EVIDENCE and self.row_acceptance(row)[0] < ROW_FAILING * self.acceptance()[0])

    def observe_step(self, positions: int, batch: int, seconds: float) -> None:
        """One target step over `positions` positions for `batch` rows (positions == batch: no draft)."""
        (self.plain_steps if positions == batch else self.spec_steps).append((positions, seconds))
        self._fits.clear()
        self._steps += 1

    def observe_draft(self, tokens_per_row: float, seconds: float) -> None:
        """One proposer call that drafted `tokens_per_row` tokens per row on average."""
        if tokens_per_row > 0:
            self.drafts.append((tokens_per_row, seconds))
            self._fits.clear()

    def cost(self, batch: int) -> StepCost | None:
        if batch not in self._fits:
            self._fits[batch] = self._fit(batch)
        return self._fits[batch]

    def _prior(self, positions: float, batch: int) -> float:
        """Relative cost of a verification step of `positions` positions by the priors."""
        return 1 + self.beta_prior + self.alpha_prior * (positions / batch - 1)

    def _sizes(self, decode: float | None, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sizes, robust time per size, count per size) of the verification steps, spikes left out."""
        kept = [
            (size, value, count)
            for size, value, count in _by_size(self.spec_steps)
            # a size seen less than TRUST times and far over the priors: more likely a slow moment
            if count >= TRUST or decode is None or value <= SPIKE * decode * self._prior(size, batch)
        ]
        sizes, times, counts = (np.array(c, np.float64) for c in zip(*kept)) if kept else (np.zeros(0),) * 3
        return sizes, times, counts

    def _fit(self, batch: int) -> StepCost | None:
        plain = [t for b, t in self.plain_steps if b == batch]
        decode = _robust(plain) if plain else None
        # without a plain step, judge spikes against the fastest verification step (scaled by the
        # priors): noise only ever makes a step slower
        guess = decode or min((t / self._prior(z, batch) for z, t in self.spec_steps), default=None)
        sizes, times, counts = self._sizes(guess, batch)
        line = None
        if len(sizes) >= 2:  # a line through the verification steps (of every batch size)
            c1, c0 = np.polyfit(sizes, times, 1, w=np.sqrt(counts))
            line = float(c0), max(float(c1), 0.0)
        if decode is None:
            if not len(sizes):
                return None
            if line is not None:
                # no plain step at this batch size (a batch that always drafts): the line at P = B,
                # less the verification jump where plain steps were seen (the prior's if nowhere).
                # Backing out through the priors instead let a dear batch look cheap and draft more.
                decode = (line[0] + line[1] * batch) / (1.0 + self._jump(line))
            else:  # no plain step yet: back out T_decode from the verification steps with the priors
                decode = statistics.median(t / self._prior(z, batch) for z, t in zip(sizes, times))
        if line is not None:
            c0, c1 = line
            alpha = c1 * batch / decode
            beta = max((c0 + c1 * batch) / decode - 1.0, 0.0)
        elif len(sizes) == 1 and plain and sizes[0] > batch:
            # one verification size seen: its measured extra cost r, split between beta and alpha
            # in the proportion of the priors (exact for that size, which is all a fixed N uses)
            n = sizes[0] / batch - 1  # draft tokens per row
            r = max(float(times[0]) / decode - 1.0, 0.0)
            beta = r * self.beta_prior / (self.beta_prior + self.alpha_prior * n)
            alpha = (r - beta) / n
        else:
            alpha, beta = self.alpha_prior, self.beta_prior
        d0, d1 = self._draft_line()
        return StepCost(decode, alpha, beta, d0 / decode, d1 / decode)

    def _jump(self, line: tuple[float, float]) -> float:
        """beta where it was measured: the verification line at P = B over the plain step, at the
        batch sizes that have plain steps (median); the prior where none has."""
        plain: dict[int, list[float]] = collections.defaultdict(list)
        for b, t in self.plain_steps:
            plain[b].append(t)
        jumps = [max((line[0] + line[1] * b) / _robust(ts) - 1.0, 0.0) for b, ts in plain.items()]
        return statistics.median(jumps) if jumps else self.beta_prior

    def _draft_line(self) -> tuple[float, float]:
        """T_draft(n) = d0 + d1 * n in seconds."""
        if not self.drafts:
            return 0.0, 0.0
        ns, ts, counts = (np.array(c, np.float64) for c in zip(*_by_size(self.drafts)))
        if not self.draft_per_token:
            return statistics.median(ts), 0.0
        if len(ns) >= 2:
            d1, d0 = np.polyfit(ns, ts, 1, w=np.sqrt(counts))
            return max(float(d0), 0.0), max(float(d1), 0.0)
        return 0.0, float(ts[0] / ns[0])  # one length seen: all of it per token

    def acceptance(self) -> np.ndarray:
        """(max_draft,) the batch's acceptance rate per depth (read-only; computed once per change
        of the counts: a batch's policy reads it for every row, several times a step)."""
        if self._acceptance is None:
            rates = np.empty(self.max_draft)
            prior = 0.5
            for j in range(self.max_draft):
                rates[j] = (self.hit[j] + 2.0 * prior) / (self.tried[j] + 2.0)
                prior = rates[j]
            rates.flags.writeable = False
            self._acceptance = rates
        return self._acceptance

    def observe_gain(self, rows: list[int], asked: dict[int, int], accepted: dict[int, int]) -> None:
        """One drafting step's extra tokens per row (beyond the one every step brings): what the
        acceptance estimates predicted for the lengths asked, and what the rows got. Call before
        the step's verdicts go into the estimates."""
        rates = np.stack([self.row_acceptance(b) for b in rows])
        reach = np.cumsum(np.cumprod(rates, axis=1), axis=1)  # E[accepted | asked n] at column n - 1
        predicted = np.mean([reach[i, asked[b] - 1] if asked[b] > 0 else 0.0 for i, b in enumerate(rows)])
        self.gain_predicted = self.gain_predicted * self.decay + float(predicted)
        self.gain_realized = self.gain_realized * self.decay + float(np.mean([accepted[b] for b in rows]))

    def calibration(self) -> float:
        """Realized over predicted extra tokens (a prior of 1 worth two tokens): the estimates run
        high in a batch (the policy picks N where they happen to be highest, and the rows that copy
        keep them up), so predictions are scaled by what the steps really gave."""
        return min((self.gain_realized + 2.0) / (self.gain_predicted + 2.0), 1.5)

    def expected_tokens(self) -> np.ndarray:
        """(max_draft + 1,) E[tokens per step] for N = 0 .. max_draft."""
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.acceptance()))])

    def fill_rates(self) -> np.ndarray:
        """(max_draft,) f_j: how often a row asked for depth j or more drafted at least j positions."""
        return (self.fill + 2.0) / (self.reach + 2.0)

    def expected_positions(self, batch: int) -> np.ndarray:
        """(max_draft + 1,) draft positions a dense step of `batch` rows verifies per row, for
        N = 0 .. max_draft: the expected longest draft (module docstring)."""
        some = 1.0 - (1.0 - self.fill_rates()) ** batch  # some row drafted depth j
        return np.concatenate([[0.0], np.cumsum(some)])

    def row_expected_tokens(self, rows: list[int]) -> np.ndarray:
        """(max_draft + 1,) E[tokens per row | N], the mean over the rows of each row's own
        (its acceptance: its counts, the batch's rates as the prior; a failing row drafts nothing,
        so it brings one token whatever N is)."""
        rates = np.stack([np.zeros(self.max_draft) if self.failing(b) else self.row_acceptance(b) for b in rows])
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(rates, axis=1).mean(axis=0))])

    def speedups(self, batch: int, rows: list[int] | None = None) -> np.ndarray:
        """speedup(N) for N = 0 .. max_draft; with `rows`, E[tokens] from each row's own acceptance."""
        cost = self.cost(batch) or StepCost(1.0, self.alpha_prior, self.beta_prior, 0.0)
        n = np.arange(self.max_draft + 1)
        positions = self.expected_positions(batch)
        drafts = np.where(n > 0, positions[1], 0.0)  # the chance some row drafted at all
        relative = 1.0 + cost.beta * drafts + cost.alpha * positions + cost.draft_ratio(n)
        expected = self.expected_tokens() if rows is None else self.row_expected_tokens(rows)
        return (1.0 + self.calibration() * (expected - 1.0)) / relative


class FixedPolicy:
    def __init__(self, num_draft: int):
        self.max_draft = num_draft

    def plan(self, model: CostModel, rows: list[int]) -> dict[int, int]:
        """Draft tokens per row: N for every row."""
        return dict.fromkeys(rows, self.max_draft)


class AutoPolicy:
    def __init__(self, max_draft: int = 16, probe_every: int = 8, probe_draft: int = 2):
        self.max_draft = max_draft
        self.probe_every, self.probe_draft = probe_every, probe_draft
        self._off_steps = 0

    def num_draft(self, model: CostModel, batch: int, rows: list[int] | None = None) -> int:
        n = int(np.argmax(model.speedups(batch, rows)))
        if n == 0:
            self._off_steps += 1
            if self._off_steps % self.probe_every == 0:
                return self.probe_draft
        else:
            self._off_steps = 0
        return n

    def plan(self, model: CostModel, rows: list[int]) -> dict[int, int]:
        """Draft tokens per row: the batch's N (`num_draft`), except for rows whose drafts keep
        failing (`CostModel.failing`), which draft nothing; a probe drafts a little on every row."""
        n = self.num_draft(model, len(rows), rows)
        if n == 0 or self._off_steps > 0:  # off, or probing while off
            return dict.fromkeys(rows, n)
        return {b: 0 if model.failing(b) else n for b in rows}
