"""Sampled speculative output against the target's own distribution, at the model's real size.

    result = two_token_check(gen, spec, ids, rounds=24, rows=8, temperature=0.7)

The first two tokens a speculative decoder samples after a prompt are drawn `rounds x rows`
times (rows of one batch share a step; each round its own seed) and binned by the target's exact
joint: the first token among the K1 likeliest at the prompt, the second among the K2 likeliest
after that first token, an "other" cell for the rest of each, so every draw lands in a cell. The
cells' probabilities come from the target's own logits (one forward per first-token candidate,
at the same temperature), and a chi-square test (rare cells pooled) compares the counts with
them. The draft's sampled chains carry their real q to verification, so what the test checks is
that acceptance with resampling from norm((p - q)+) keeps the target's distribution, at a size
the unit tests (tiny models, tests/test_speculative.py) do not reach.

The drafts must be accepted for the check to mean anything: the result says how many were.
"""

from __future__ import annotations

import numpy as np

from specrt.runtime.sampling import SamplingParams, probs_from_logits

K1, K2 = 6, 4  # first-token and second-token candidates given cells of their own


def exact_cells(gen, ids: list[int], params: SamplingParams) -> tuple[dict, np.ndarray]:
    """(cell index of (t1, t2) pairs, with (t1, -1) and (-1, -1) for "other", cell probabilities)."""
    session = gen.session
    cache = session.new_cache(1, len(ids) + 2)
    p1 = probs_from_logits(session.forward(cache, [ids]).logits[0, -1], params)
    first = np.argsort(-p1, kind="stable")[:K1]
    prompt = cache.lengths.copy()
    index, probs = {}, []
    for t1 in first.tolist():  # each candidate on the prompt's cache, rolled back after it
        p2 = probs_from_logits(session.forward(cache, [[t1]]).logits[0, -1], params)
        cache.rollback(prompt)
        second = np.argsort(-p2, kind="stable")[:K2]
        for t2 in second.tolist():
            index[(t1, t2)] = len(probs)
            probs.append(p1[t1] * p2[t2])
        index[(t1, -1)] = len(probs)
        probs.append(p1[t1] * max(0.0, 1.0 - float(p2[second].sum())))
    index[(-1, -1)] = len(probs)
    probs.append(max(0.0, 1.0 - float(p1[first].sum())))
    session.release(cache)
    probs = np.asarray(probs, np.float64)
    return index, probs / probs.sum()


def two_token_check(gen, spec, ids: list[int], rounds: int, rows: int, temperature: float) -> dict:
    """The chi-square check (module docstring): counts, expected counts, p-value, drafts accepted."""
    from scipy.stats import chisquare

    params = SamplingParams(temperature=temperature)
    index, probs = exact_cells(gen, ids, params)
    counts = np.zeros(len(probs))
    drafted = accepted = 0
    for r in range(rounds):
        # 3 tokens: the first comes from the prompt's step, and a draft is kept to the budget
        # left after it (two tokens would leave one: nothing drafted for the second)
        out = spec.generate_ids([ids] * rows, 3, SamplingParams(temperature=temperature, seed=r))
        for res in out:
            t1, t2 = res.token_ids[:2]
            cell = index.get((t1, t2), index.get((t1, -1), index[(-1, -1)]))
            counts[cell] += 1
        drafted += out[0].metrics.drafted_tokens
        accepted += out[0].metrics.accepted_tokens
    expected = probs * counts.sum()
    keep, rare = expected >= 5, expected < 5
    obs, exp = np.append(counts[keep], counts[rare].sum()), np.append(expected[keep], expected[rare].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return {
        "temperature": temperature,
        "samples": int(counts.sum()),
        "cells": int(len(obs)),
        "observed": obs.astype(int).tolist(),
        "expected": [round(float(e), 1) for e in exp],
        "p_value": float(chisquare(obs, exp).pvalue),
        "drafted": int(drafted),
        "accepted": int(accepted),
    }
