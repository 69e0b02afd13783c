"""Log probabilities of emitted tokens: what OpenAI's `logprobs` and `top_logprobs` report.

Each emitted token's log probability under the target's distribution at the position it was
emitted from: the log-softmax of the target's raw logits there (temperature 1, before top-k and
top-p: the model's distribution, as vLLM and OpenAI report it), in float64. Under speculation the
positions are those of the verification step: the root's for the first token of a step, then one
per accepted draft token (the bonus or resampled token comes from the position after the last
accepted one), so the figures are the target's own, never the draft's.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MAX_TOP = 20  # OpenAI's bound on top_logprobs


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the `top` most likely tokens there, most likely first


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(..., V) logits -> (..., V) float64 log probabilities (max-shifted: no overflow). The one
    log-softmax of the package and its benchmarks (logprobs, quality reports, perplexity)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits (n, V) at the positions the n tokens were emitted from; `top` alternatives each."""
    logp = log_softmax(logits[: len(tokens)])
    out = []
    for row, t in zip(logp, tokens):
        best = np.argpartition(-row, top - 1)[:top] if top else np.zeros(0, np.int64)
        best = best[np.argsort(-row[best], kind="stable")]
        out.append(TokenLogprob(int(t), float(row[t]), tuple((int(i), float(row[i])) for i in best)))
    return out
