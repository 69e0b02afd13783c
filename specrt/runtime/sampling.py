"""Turning logits into a next token: greedy, or sampling with temperature, top-k and top-p.

`probs_from_logits` is the one place the sampling distribution is defined; speculative
verification applies the same function to the target and the draft, so plain and speculative
sampling draw from the same distribution. Randomness comes in as a numpy Generator.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from specrt.errors import SpecrtError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # 1 means no nucleus cut
    seed: int | None = None

    def __post_init__(self):
        # NaN passes any range check written as `x < lo` (every comparison with NaN is False),
        # and a NaN temperature samples nothing: finiteness is checked first
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise SpecrtError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise SpecrtError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SpecrtError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SpecrtError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise SpecrtError(f"seed must be an integer >= 0 (or None for a fresh one), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """(..., V) logits -> (..., V) float64 probabilities after temperature, top-k and top-p.

    Top-k keeps the k largest logits; top-p then keeps the smallest set of the most likely tokens
    whose mass reaches p (the token that crosses p included), and renormalises.
    """
    x = logits.astype(np.float64) / params.temperature
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = np.partition(x, V - params.top_k, axis=-1)[..., V - params.top_k : V - params.top_k + 1]
        x = np.where(x < kth, -np.inf, x)
    x = x - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
        keep_sorted = before < params.top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def sample_from_probs(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row of (..., V) probabilities, by inverting the CDF with one uniform each."""
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(p.shape[:-1] + (1,)) * cdf[..., -1:]
    return np.minimum((cdf <= u).sum(axis=-1), p.shape[-1] - 1)


def next_tokens(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> np.ndarray:
    """(B, V) logits -> (B,) int64 tokens."""
    if params.greedy:
        return logits.argmax(axis=-1).astype(np.int64)
    return sample_from_probs(probs_from_logits(logits, params), rng).astype(np.int64)
