"""The cost model's estimators, one job each (runtime/policy.py combines them into speedup(N)):

    Acceptance   per-depth acceptance and fill rates, of the batch and of each row
    StepTimes    T_decode, alpha and beta at a batch size, from the target steps' times
    StepCurve    the least a verification step costs, by the engine's step costs measured at build
    DraftTimes   T_draft(n), from the proposer calls' times
    Calibration  realized over predicted extra tokens per drafting step

Every count decays (exponentially, `decay` per step), so an estimate follows the text as it
changes; a time keeps a window of recent steps. policy.py's docstring has the model they feed.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import statistics

import numpy as np

# observations of a size before its median is believed: auto +1.3 / +0.5 / +1.5 % on float32 /
# gguf / int8-a8 (bench_policy.py --ablate trust, --noise 0.05, 3 seeds, 2026-12-05; never below 0)
TRUST = 3
ROW_EVIDENCE = 4.0  # a row's decayed depth-1 drafts before it may be judged failing
ROW_FAILING = 1 / 3  # ... failing: its rate under this share of the batch's
# decayed drafts of an evidence read in hindsight before it may be verified (policy.py): 2 over 1
# on the 4-bit engine, where a verification step costs two decode steps: worst prompt 0.98x plain
# against 0.93x, 0.95x against 0.89x with noisy, loaded step times (bench_policy.py --noise 0.3
# --bursts, 5 seeds; float32's geometric mean 1.68x against 1.75x, 1.53x against 1.55x loaded)
BACKED = 2.0
# a less-observed size this many times dearer than the priors predict is a spike: auto +1.1 / +1.2
# / +1.1 % on float32 / gguf / int8-a8 (--ablate spike, as for TRUST; never below 0)
SPIKE = 3.0


def _by_size(observations) -> list[tuple[float, float, int]]:
    """(size, robust time, count) per distinct size of (size, seconds) observations, by size."""
    groups: dict[float, list[float]] = collections.defaultdict(list)
    for size, t in observations:
        groups[size].append(t)
    return [(size, _robust(ts), len(ts)) for size, ts in sorted(groups.items())]


def _line(x, y, weights) -> tuple[float, float]:
    """(c0, c1) of the weighted least-squares line y = c0 + c1 * x (at least two distinct x).
    Closed form in plain Python: np.polyfit took a third of a plan's time, and this runs every step."""
    sw = sum(weights)
    mx = sum(w * v for w, v in zip(weights, x)) / sw
    my = sum(w * v for w, v in zip(weights, y)) / sw
    sxx = sum(w * (v - mx) ** 2 for w, v in zip(weights, x))
    c1 = sum(w * (u - mx) * (v - my) for w, u, v in zip(weights, x, y)) / sxx
    return my - c1 * mx, c1


def _robust(times: list[float]) -> float:
    """A size's time: the median once trusted, the fastest before (noise only slows steps).
    (statistics.median: on these few values it is ~20x faster than numpy's, and this runs every step)"""
    return statistics.median(times) if len(times) >= TRUST else min(times)


class Acceptance:
    """Per-depth acceptance a_j (depth j asked for and depth j-1 accepted: how often j was) and
    fill f_j (asked for depth j or more: how often the draft had j positions), as decayed counts
    over the batch, and each row's own acceptance counts (decayed per target step, drafted or
    not, so a row that stopped drafting is tried again once its old failures have faded)."""

    def __init__(self, max_draft: int, decay: float, prior: float = 0.5):
        """prior: depth 1's rate before anything is observed (two pseudo-observations)."""
        self.max_draft, self.decay, self.prior = max_draft, decay, prior
        self.tried = np.zeros(max_draft)
        self.hit = np.zeros(max_draft)
        self.reach = np.zeros(max_draft)
        self.fill = np.zeros(max_draft)
        self._rows: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}  # row -> (tried, hit, at step)
        self.steps = 0  # target steps seen (a row's evidence decays per step)
        self._batched = False  # inside batched_step
        self._rates: np.ndarray | None = None  # rates() of the current counts

    def observe(self, drafted_depth: int, accepted: int, row: int | None, asked: int, positions: int) -> None:
        """One row's verified draft (CostModel.observe_acceptance says what the numbers are)."""
        tested = min(asked, accepted + 1, self.max_draft)  # depths asked for whose verdict we know
        if not self._batched:  # one row's draft per step: it is the step
            self.age()
        self.tried[:tested] += 1
        self.hit[: min(accepted, self.max_draft)] += 1
        self._rates = None
        self.reach[: min(asked, self.max_draft)] += 1
        self.fill[: min(positions, asked, self.max_draft)] += 1
        if row is not None:
            tried, hit = self.row_counts(row)
            tried[:tested] += 1
            hit[: min(accepted, self.max_draft)] += 1
            self._rows[row] = (tried, hit, self.steps)

    def observe_path(self, start: int, hits: int, missed: bool) -> None:
        """Verdicts read along one draft (runtime/hindsight.py): depths start+1 .. start+hits
        accepted, and depth start+hits+1 tried and not accepted when `missed`."""
        end = min(start + hits, self.max_draft)
        if end > start:
            self.tried[start:end] += 1
            self.hit[start:end] += 1
        if missed and end < self.max_draft:
            self.tried[end] += 1
        self._rates = None

    def age(self, steps: int = 1) -> None:
        """The batch's counts age by `steps` steps. A batch ages them once per step before its
        rows' observations (`batched_step`), so the memory is ~1 / (1 - decay) steps whatever the
        batch size (per row it would be a few steps of a large batch: noisy estimates, and the
        largest of noisy estimates is the one the policy picks)."""
        if steps:
            f = self.decay**steps
            for counts in (self.tried, self.hit, self.reach, self.fill):
                counts *= f
            self._rates = None

    @contextlib.contextmanager
    def batched_step(self):
        """The rows' observations of one step, aged once (see `age`)."""
        self.age()
        self._batched = True
        try:
            yield
        finally:
            self._batched = False

    def next_step(self) -> None:
        """A target step ran (drafted or not): the rows' own counts are one step older."""
        self.steps += 1

    def row_counts(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """A row's counts decayed to now (copies)."""
        if row not in self._rows:
            return np.zeros(self.max_draft), np.zeros(self.max_draft)
        tried, hit, at = self._rows[row]
        f = self.decay ** (self.steps - at)
        return tried * f, hit * f

    def forget_row(self, row: int) -> None:
        self._rows.pop(row, None)

    def rates(self) -> np.ndarray:
        """(max_draft,) the batch's a_j (read-only; computed once per change of the counts: a
        batch's policy reads it for every row, several times a step). The prior of depth j is two
        pseudo-observations at the rate of depth j-1: depths not yet drafted are expected to
        behave like the deepest one seen, so N can grow into them."""
        if self._rates is None:
            rates, prior = [], self.prior
            for hit, tried in zip(self.hit.tolist(), self.tried.tolist()):  # lists: ~4x faster than indexing
                prior = (hit + 2.0 * prior) / (tried + 2.0)
                rates.append(prior)
            self._rates = np.array(rates)
            self._rates.flags.writeable = False
        return self._rates

    def row_rates(self, row: int) -> np.ndarray:
        """(max_draft,) the row's own a_j: its counts, the batch's rates as a prior worth two."""
        tried, hit = self.row_counts(row)
        return (hit + 2.0 * self.rates()) / (tried + 2.0)

    def failing(self, row: int) -> bool:
        """The row's drafts keep failing where the batch's succeed: its decayed depth-1 rate under
        ROW_FAILING of the batch's, once it has ROW_EVIDENCE depth-1 drafts."""
        tried, _ = self.row_counts(row)
        return bool(tried[0] >= ROW_EVIDENCE and self.row_rates(row)[0] < ROW_FAILING * self.rates()[0])

    def fill_rates(self) -> np.ndarray:
        """(max_draft,) f_j (prior 1)."""
        return (self.fill + 2.0) / (self.reach + 2.0)


class StepTimes:
    """The target steps' times: plain steps by batch size and verification steps by positions
    (a window of each), and from them T_decode, alpha and beta at a batch size (policy.py's
    docstring), priors where nothing was measured."""

    def __init__(self, window: int, alpha_prior: float, beta_prior: float):
        self.plain: collections.deque = collections.deque(maxlen=window)  # (batch, seconds)
        self.spec: collections.deque = collections.deque(maxlen=window)  # (positions, seconds, batch)
        self.alpha_prior, self.beta_prior = alpha_prior, beta_prior

    def observe(self, positions: int, batch: int, seconds: float) -> None:
        if positions == batch:
            self.plain.append((batch, seconds))
        else:
            self.spec.append((positions, seconds, batch))

    def _prior(self, positions: float, batch: int) -> float:
        """Relative cost of a verification step of `positions` positions by the priors."""
        return 1 + self.beta_prior + self.alpha_prior * (positions / batch - 1)

    def _sizes(self, decode: float | None, batch: int, spec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sizes, robust time per size, count per size) of verification steps (positions,
        seconds), spikes left out."""
        kept = [
            (size, value, count)
            for size, value, count in _by_size(spec)
            # a size seen less than TRUST times and far over the priors: more likely a slow moment
            if count >= TRUST or decode is None or value <= SPIKE * decode * self._prior(size, batch)
        ]
        sizes, times, counts = (np.array(c, np.float64) for c in zip(*kept)) if kept else (np.zeros(0),) * 3
        return sizes, times, counts

    def fit(self, batch: int) -> tuple[float, float, float] | None:
        """(T_decode in seconds, alpha, beta) at `batch` rows; None before any step."""
        plain = [t for b, t in self.plain if b == batch]
        decode = _robust(plain) if plain else None
        # without a plain step, judge spikes against the fastest verification step (scaled by the
        # priors): noise only ever makes a step slower
        # the verification steps at this batch size where they are enough for a line (the cost of
        # a position is not the same at every batch size: on a CPU a few rows read the weights
        # once, many compute), of every batch size otherwise
        spec = [(p, t) for p, t, b in self.spec if b == batch]
        if len({p for p, _ in spec}) < 2:
            spec = [(p, t) for p, t, _ in self.spec]
        guess = decode or min((t / self._prior(z, batch) for z, t in spec), default=None)
        sizes, times, counts = self._sizes(guess, batch, spec)
        line = None
        if len(sizes) >= 2:  # a line through the verification steps
            c0, c1 = _line(sizes.tolist(), times.tolist(), counts.tolist())
            line = c0, max(c1, 0.0)
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
            return decode, c1 * batch / decode, max((c0 + c1 * batch) / decode - 1.0, 0.0)
        if len(sizes) == 1 and plain and sizes[0] > batch:
            # one verification size seen: its measured extra cost r, split between beta and alpha
            # in the proportion of the priors (exact for that size, which is all a fixed N uses)
            n = sizes[0] / batch - 1  # draft tokens per row
            r = max(float(times[0]) / decode - 1.0, 0.0)
            beta = r * self.beta_prior / (self.beta_prior + self.alpha_prior * n)
            return decode, (r - beta) / n, beta
        return decode, self.alpha_prior, self.beta_prior

    def seen(self) -> float:
        """The most positions per row of the verification steps in the window (0: none)."""
        return max((p / b for p, _, b in self.spec), default=0.0)

    def _jump(self, line: tuple[float, float]) -> float:
        """beta where it was measured: the verification line at P = B over the plain step, at the
        batch sizes that have plain steps (median); the prior where none has."""
        plain: dict[int, list[float]] = collections.defaultdict(list)
        for b, t in self.plain:
            plain[b].append(t)
        jumps = [max((line[0] + line[1] * b) / _robust(ts) - 1.0, 0.0) for b, ts in plain.items()]
        return statistics.median(jumps) if jumps else self.beta_prior


class StepCurve:
    """The engine's step cost by positions as its build measured it (Capabilities.step_ms: ms at
    batch 1 by the positions a step computes), read as the least a verification step of P
    positions costs over the plain step's P0: curve(P) / curve(P0) - 1, linear between the
    measured sizes and past the last along its last segment (a batch's P: its rows times their
    positions, as its products see them).

    Why a floor under StepTimes' line: the line is fitted through the sizes the drafts happened
    to have. On the 1.5B (gguf-k) a run of 2- and 3-position steps, which cost about what a plain
    one does (38 ms against 36), fitted alpha 0, and the next 16-token copy was verified as if
    free: 3.4 plain steps for it, none of its tokens accepted (story 0.96x plain). The measured
    curve is not a prior: where the line prices a length dearer (a slower machine), the line wins."""

    def __init__(self, step_ms: dict | None):
        points = sorted((int(q), float(ms)) for q, ms in (step_ms or {}).items() if float(ms) > 0)
        self.sizes = [q for q, _ in points]
        self.ms = [ms for _, ms in points]

    def __bool__(self) -> bool:
        return len(self.sizes) >= 2

    def at(self, positions):
        """ms of a step of this many positions: a number in plain Python (it runs per judged length,
        on a handful of numbers), an array of them with numpy (the N-plan's expected positions)."""
        q, ms = self.sizes, self.ms
        if np.ndim(positions):
            p = np.asarray(positions, np.float64)
            past = ms[-1] + (ms[-1] - ms[-2]) * (p - q[-1]) / (q[-1] - q[-2])
            return np.where(p > q[-1], past, np.interp(p, q, ms))
        i = min(max(bisect.bisect_right(q, positions), 1), len(q) - 1)
        if positions <= q[0]:
            return ms[0]
        return ms[i - 1] + (ms[i] - ms[i - 1]) * (positions - q[i - 1]) / (q[i] - q[i - 1])

    def extra(self, positions, plain: float):
        """The least extra cost of a step of `positions` (a number or an array) over the plain
        step's `plain` positions, relative to it."""
        if not self:
            return 0.0 * positions
        over = self.at(positions) / self.at(plain) - 1.0
        return np.maximum(over, 0.0) if np.ndim(over) else max(over, 0.0)


class DraftTimes:
    """The proposer calls' times (a window): T_draft(n) = d0 + d1 * n, a line through them when
    the proposer pays per drafted token (a model runs once per token), a constant for lookups."""

    def __init__(self, window: int, per_token: bool):
        self.calls: collections.deque = collections.deque(maxlen=window)  # (draft tokens per row, seconds)
        self.per_token = per_token

    def observe(self, tokens_per_row: float, seconds: float) -> bool:
        """One proposer call; False (nothing kept) when it drafted nothing."""
        if tokens_per_row > 0:
            self.calls.append((tokens_per_row, seconds))
        return tokens_per_row > 0

    def line(self) -> tuple[float, float]:
        """(d0, d1) in seconds."""
        if not self.calls:
            return 0.0, 0.0
        ns, ts, counts = (np.array(c, np.float64) for c in zip(*_by_size(self.calls)))
        if not self.per_token:
            return statistics.median(ts), 0.0
        if len(ns) >= 2:
            d0, d1 = _line(ns.tolist(), ts.tolist(), counts.tolist())
            return max(d0, 0.0), max(d1, 0.0)
        return 0.0, float(ts[0] / ns[0])  # one length seen: all of it per token


@dataclasses.dataclass
class Calibration:
    """Realized over predicted extra tokens per drafting step (decayed sums, a prior of 1 worth
    two tokens, at most 1.5): the acceptance estimates run high in a batch of mixed requests (the
    policy asks for N where they happen to be highest, and the rows that copy their context keep
    them up), so predictions are scaled by what the steps really gave."""

    decay: float
    predicted: float = 0.0
    realized: float = 0.0

    def observe(self, predicted: float, realized: float) -> None:
        self.predicted = self.predicted * self.decay + predicted
        self.realized = self.realized * self.decay + realized

    def ratio(self) -> float:
        return min((self.realized + 2.0) / (self.predicted + 2.0), 1.5)
