"""Speculation length: a fixed N, or `auto`, which picks N each step from the cost model

    speedup(N) = E[tokens per step | N] / (T_draft/T_decode + 1 + alpha_B * N)

with everything measured online:
    E[tokens | N] = 1 + sum_{i<=N} prod_{j<=i} a_j, a_j the acceptance rate at depth j given
                    depth j-1 was accepted (exponentially decayed counts; the prior of depth j is
                    two pseudo-observations at the rate of depth j-1, so depths not yet drafted
                    are expected to behave like the deepest one seen, and N can grow into them);
    step cost     t(Q) = c0 + c1 * Q fitted by least squares to recent steps (Q = positions in
                    the step over the whole batch); T_decode = t(B) and
                    alpha_B = c1 * B / (c0 + c1 * B), so a larger batch makes each extra verified
                    position relatively dearer and speculation turns itself down;
    T_draft       decayed mean of the proposer's time per step.
N = 0 (plain decoding, speedup 1) is always a candidate, so speculation that does not pay is
switched off; while off, every `probe_every`-th step drafts a little to keep the acceptance
estimates current.
"""

from __future__ import annotations

import collections

import numpy as np


class CostModel:
    """Online estimates of alpha, T_decode, T_draft and per-depth acceptance."""

    def __init__(self, max_draft: int, decay: float = 0.98, window: int = 64, alpha_prior: float = 0.05):
        self.max_draft = max_draft
        self.decay = decay
        self.tried = np.zeros(max_draft)  # decayed counts: depth j was drafted and j-1 accepted
        self.hit = np.zeros(max_draft)  # ... and depth j was accepted
        self.steps: collections.deque = collections.deque(maxlen=window)  # (positions, seconds)
        self.draft_s = None
        self.alpha_prior = alpha_prior
        self._cost: tuple[float, float] | None = None  # fitted (c0, c1), cleared by each new step

    def observe_acceptance(self, drafted_depth: int, accepted: int) -> None:
        self.tried *= self.decay
        self.hit *= self.decay
        tested = min(drafted_depth, accepted + 1, self.max_draft)  # depths whose verdict we saw
        self.tried[:tested] += 1
        self.hit[: min(accepted, self.max_draft)] += 1

    def observe_step(self, positions: int, seconds: float, draft_seconds: float) -> None:
        self.steps.append((positions, seconds))
        self.draft_s = draft_seconds if self.draft_s is None else 0.9 * self.draft_s + 0.1 * draft_seconds
        self._cost = None

    def step_cost(self) -> tuple[float, float] | None:
        """(c0, c1) of t(Q) = c0 + c1 * Q; None before any step. Until several distinct Q have
        been seen, one step's time is split between c0 and c1 with the prior alpha."""
        if self._cost is None:
            self._cost = self._fit_step_cost()
        return self._cost

    def _fit_step_cost(self) -> tuple[float, float] | None:
        if not self.steps:
            return None
        q = np.array([s[0] for s in self.steps], dtype=np.float64)
        t = np.array([s[1] for s in self.steps], dtype=np.float64)
        if len(np.unique(q)) < 3:
            t1 = float(np.median(t / (1 + self.alpha_prior * (q - 1))))  # cost of Q = 1
            return t1 * (1 - self.alpha_prior), t1 * self.alpha_prior
        c1, c0 = np.polyfit(q, t, 1)
        return max(float(c0), 1e-6), max(float(c1), 0.0)

    def acceptance(self) -> np.ndarray:
        rates = np.empty(self.max_draft)
        prior = 0.5
        for j in range(self.max_draft):
            rates[j] = (self.hit[j] + 2.0 * prior) / (self.tried[j] + 2.0)
            prior = rates[j]
        return rates

    def decode_seconds(self, batch: int) -> float | None:
        cost = self.step_cost()
        return None if cost is None else cost[0] + cost[1] * batch

    def alpha(self, batch: int) -> float:
        cost = self.step_cost()
        if cost is None:
            return self.alpha_prior
        c0, c1 = cost
        return c1 * batch / (c0 + c1 * batch)

    def draft_ratio(self, batch: int) -> float:
        dec = self.decode_seconds(batch)
        if dec is None or self.draft_s is None:
            return 0.0
        return self.draft_s / dec

    def expected_tokens(self) -> np.ndarray:
        """(max_draft + 1,) E[tokens per step] for N = 0 .. max_draft."""
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.acceptance()))])

    def speedups(self, batch: int) -> np.ndarray:
        n = np.arange(self.max_draft + 1)
        cost = 1.0 + self.alpha(batch) * n + np.where(n > 0, self.draft_ratio(batch), 0.0)
        return self.expected_tokens() / cost


class FixedPolicy:
    def __init__(self, num_draft: int):
        self.max_draft = num_draft

    def num_draft(self, model: CostModel, batch: int) -> int:
        return self.max_draft


class AutoPolicy:
    def __init__(self, max_draft: int = 16, probe_every: int = 8, probe_draft: int = 2):
        self.max_draft = max_draft
        self.probe_every, self.probe_draft = probe_every, probe_draft
        self._off_steps = 0

    def num_draft(self, model: CostModel, batch: int) -> int:
        n = int(np.argmax(model.speedups(batch)))
        if n == 0:
            self._off_steps += 1
            if self._off_steps % self.probe_every == 0:
                return self.probe_draft
        else:
            self._off_steps = 0
        return n
