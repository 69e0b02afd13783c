"""Speculation length: a fixed N, or `auto`, which picks N each step from the cost model

    speedup(N) = E[tokens per step | N] / (T_draft/T_decode + 1 + beta_B + alpha_B * N)

with everything measured online:
    E[tokens | N] = 1 + sum_{i<=N} prod_{j<=i} a_j, a_j the acceptance rate at depth j given
                    depth j-1 was accepted (exponentially decayed counts; the prior of depth j is
                    two pseudo-observations at the rate of depth j-1, so depths not yet drafted
                    are expected to behave like the deepest one seen, and N can grow into them);
    T_decode      median time of recent plain steps (no draft) at this batch size B;
    alpha, beta   a line t(P) = c0 + c1 * P fitted to recent steps that verified drafts
                    (P = positions in the step over the whole batch): alpha_B = c1 * B / T_decode
                    is the cost of one more draft position per row, beta_B = t(B) / T_decode - 1
                    the fixed extra cost of any verification step. beta is the refinement of
                    the textbook model: on a CPU a step of Q = 2 costs ~12 % more than Q = 1
                    (matrix-vector vs matrix-matrix kernels), then ~4 % per position, and a
                    line through Q = 1 gets both the small and the large drafts wrong. A larger
                    batch makes alpha_B larger, so speculation turns itself down;
    T_draft       decayed mean of the proposer's time per step.
N = 0 (plain decoding, speedup 1) is always a candidate, so speculation that does not pay is
switched off; while off, every `probe_every`-th step drafts a little to keep the estimates current.
With a single verification size seen, its measured cost is split between alpha and beta in the
ratio of the priors; before any verification step (or plain step) the priors alpha = 0.05 and
beta = 0.1 stand in.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepCost:
    decode: float  # T_decode (seconds) at this batch size
    alpha: float  # per extra draft position per row, relative to T_decode
    beta: float  # fixed extra cost of a verification step, relative to T_decode
    draft_ratio: float  # T_draft / T_decode

    def relative(self, n: np.ndarray) -> np.ndarray:
        """Cost of a step with n draft tokens per row, in plain decode steps."""
        n = np.asarray(n, dtype=np.float64)
        return 1.0 + np.where(n > 0, self.beta + self.draft_ratio + self.alpha * n, 0.0)


class CostModel:
    """Online estimates of T_decode, alpha, beta, T_draft and per-depth acceptance."""

    def __init__(self, max_draft: int, decay: float = 0.98, window: int = 96, alpha_prior: float = 0.05, beta_prior: float = 0.1):
        self.max_draft = max_draft
        self.decay = decay
        self.tried = np.zeros(max_draft)  # decayed counts: depth j was drafted and j-1 accepted
        self.hit = np.zeros(max_draft)  # ... and depth j was accepted
        self.plain_steps: collections.deque = collections.deque(maxlen=window)  # (batch, seconds)
        self.spec_steps: collections.deque = collections.deque(maxlen=window)  # (positions, seconds)
        self.draft_s: float | None = None
        self.alpha_prior, self.beta_prior = alpha_prior, beta_prior
        self._fits: dict[int, StepCost | None] = {}  # per batch size, cleared by each new step

    def observe_acceptance(self, drafted_depth: int, accepted: int) -> None:
        self.tried *= self.decay
        self.hit *= self.decay
        tested = min(drafted_depth, accepted + 1, self.max_draft)  # depths whose verdict we saw
        self.tried[:tested] += 1
        self.hit[: min(accepted, self.max_draft)] += 1

    def observe_step(self, positions: int, batch: int, seconds: float, draft_seconds: float) -> None:
        """One target step over `positions` positions for `batch` rows (positions == batch: no draft)."""
        if positions == batch:
            self.plain_steps.append((batch, seconds))
        else:
            self.spec_steps.append((positions, seconds))
            self.draft_s = draft_seconds if self.draft_s is None else 0.9 * self.draft_s + 0.1 * draft_seconds
        self._fits.clear()

    def cost(self, batch: int) -> StepCost | None:
        if batch not in self._fits:
            self._fits[batch] = self._fit(batch)
        return self._fits[batch]

    def _fit(self, batch: int) -> StepCost | None:
        plain = [t for b, t in self.plain_steps if b == batch]
        spec = np.array(self.spec_steps, dtype=np.float64).reshape(-1, 2)
        if plain:
            decode = float(np.median(plain))
        elif len(spec):  # no plain step yet: back out T_decode from the verification steps with the priors
            rel = 1 + self.beta_prior + self.alpha_prior * (spec[:, 0] / batch - 1)
            decode = float(np.median(spec[:, 1] / rel))
        else:
            return None
        sizes = np.unique(spec[:, 0])
        if len(sizes) >= 2:  # a line through the verification steps
            c1, c0 = np.polyfit(spec[:, 0], spec[:, 1], 1)
            c1 = max(float(c1), 0.0)
            alpha = c1 * batch / decode
            beta = max((c0 + c1 * batch) / decode - 1.0, 0.0)
        elif len(sizes) == 1 and plain and sizes[0] > batch:
            # one verification size seen: its measured extra cost r, split between beta and alpha
            # in the proportion of the priors (exact for that size, which is all a fixed N uses)
            n = sizes[0] / batch - 1  # draft tokens per row
            r = max(float(np.median(spec[:, 1])) / decode - 1.0, 0.0)
            beta = r * self.beta_prior / (self.beta_prior + self.alpha_prior * n)
            alpha = (r - beta) / n
        else:
            alpha, beta = self.alpha_prior, self.beta_prior
        ratio = (self.draft_s or 0.0) / decode
        return StepCost(decode, alpha, beta, ratio)

    def acceptance(self) -> np.ndarray:
        rates = np.empty(self.max_draft)
        prior = 0.5
        for j in range(self.max_draft):
            rates[j] = (self.hit[j] + 2.0 * prior) / (self.tried[j] + 2.0)
            prior = rates[j]
        return rates

    def expected_tokens(self) -> np.ndarray:
        """(max_draft + 1,) E[tokens per step] for N = 0 .. max_draft."""
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.acceptance()))])

    def speedups(self, batch: int) -> np.ndarray:
        cost = self.cost(batch) or StepCost(1.0, self.alpha_prior, self.beta_prior, 0.0)
        return self.expected_tokens() / cost.relative(np.arange(self.max_draft + 1))


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
