"""The GPU check's bitwise block: what the README claims of the PyTorch backend, PASS or FAIL.

Greedy output of one model and dtype (bfloat16 on a GPU; float32 and bfloat16 in the CPU mode),
each request's tokens and log probabilities (3 alternatives: through a log-softmax, the logits'
bits) against the same request generated alone with plain decoding:

    batched      BATCH requests arriving at different steps on a continuous batch of BATCH rows
    suffix       speculative, the suffix draft (a repeat of an earlier request: its answer in the
                 draft's tree) and the n-gram draft, continuous batch of 2, draft length 4
    ngram        the n-gram (prompt lookup) draft on the same requests
    prefix       a prompt whose first blocks an earlier request's prefill left in the prefix cache

A run whose drafts were never accepted tested rejection alone (plain output with extra steps),
and a prefix run whose pool served nothing tested no prefix cache: either is a FAIL of its own
("drafts accepted", "prefix cache hit"), so the block cannot pass by testing nothing. The
drafted, accepted and guessed tokens of every speculative run are recorded.

The prompts should make drafts pay: random weights that copy (gpu_check.load: runs of one token
with switches between them, so drafts are both accepted and rejected).
"""

from __future__ import annotations

from gpu_blocks import distinct_requests

from specrt.runtime.batching import BatchEngine, Request
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.prefix_cache import BLOCK, PrefixCache
from specrt.runtime.speculative import SpeculativeDecoder, make_policy

BATCH = 8  # rows of the continuous batch (the 8-16)
TOKENS = 40
DRAFT = 4


def answers(runner, requests: list[list[int]], max_batch: int, arrivals: list[int], prefix=None, budget=TOKENS):
    """Per request (its tokens' log probabilities, metrics) through the batching engine, each
    submitted at its arrival step."""
    engine = BatchEngine(runner, max_batch=max_batch, prefill_budget=16, prefix_cache=prefix)
    got: dict[int, list] = {}
    metrics: dict[int, object] = {}
    order, step = {}, 0
    try:
        while len(order) < len(requests) or not engine.idle:
            for i, p in enumerate(requests):
                if arrivals[i] == step:
                    order[engine.submit(Request(p, budget, logprobs=3))] = i
            for e in engine.step():
                got.setdefault(order[e.rid], []).extend(e.logprobs or [])
                if e.result is not None:
                    metrics[order[e.rid]] = e.result.metrics
            step += 1
    finally:
        engine.close()
    return [(got.get(i, []), metrics.get(i)) for i in range(len(requests))]


def first_difference(got: list, want: list) -> int | None:
    """The first index where two lists of TokenLogprob differ (token, log probability or an
    alternative), None where they are equal."""
    if got == want:
        return None
    return next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def spec_counts(runs: list) -> dict:
    ms = [m for _, m in runs if m is not None]
    return {
        "drafted": sum(m.drafted_tokens for m in ms),
        "accepted": sum(m.accepted_tokens for m in ms),
        "guessed": sum(m.guessed_tokens for m in ms),
        "guessed_accepted": sum(m.guessed_accepted for m in ms),
        "steps": sum(m.steps for m in ms),
    }


def bitwise_block(make_backend, prompts: list[list[int]], label: str, batch: int = BATCH, tokens: int = TOKENS):
    """make_backend() -> a backend of the model in the dtype under test; `tokens` per request.
    (verdict, details)."""
    gen = Generator(make_backend())
    gen.eos_ids = frozenset()  # `tokens` per request: equal lengths, every position compared
    rows = distinct_requests(prompts, batch)
    alone = [answers(gen, [p], 1, [0], budget=tokens)[0] for p in rows]
    checks, found, lines = {}, {}, []

    def compare(name: str, runs: list, want: list) -> None:
        diffs = [first_difference(r[0], w[0]) for r, w in zip(runs, want)]
        bad = [(i, d) for i, d in enumerate(diffs) if d is not None]
        checks[f"{name} == plain alone, logits included"] = not bad
        found[name] = {"requests": len(runs), "differ": [{"request": i, "first_index": d} for i, d in bad]}
        where = ", ".join(f"request {i} at token {d}" for i, d in bad[:4])
        differ = f" (differ: {where})" if bad else ""
        lines.append(f"{label} {name}: {len(runs) - len(bad)}/{len(runs)} bitwise{differ}")

    compare(f"batched ({batch} rows)", answers(gen, rows, batch, [i // 2 for i in range(batch)], budget=tokens), alone)
    # suffix: every request twice, the second after the first has finished (its answer in the tree)
    for draft in ("suffix", "ngram"):
        runner = SpeculativeDecoder(gen, make_proposer(draft), make_policy(DRAFT))
        if draft == "suffix":
            asked, arrivals, want = rows[:4] * 2, [0, 1, 2, 3] + [tokens + 8 + i for i in range(4)], alone[:4] * 2
        else:
            asked, arrivals, want = rows, list(range(len(rows))), alone
        runs = answers(runner, asked, 2, arrivals, budget=tokens)
        compare(draft, runs, want)
        counts = spec_counts(runs)
        found[draft]["counts"] = counts
        checks[f"{draft}: drafts accepted (else only rejection was tested)"] = counts["accepted"] > 0
        lines.append(
            f"{label} {draft}: drafted {counts['drafted']}, accepted {counts['accepted']}, guessed "
            f"{counts['guessed']} (right {counts['guessed_accepted']}), {counts['steps']} steps"
        )
    # the prefix cache: a first request's prompt blocks serve a second that shares them
    pool = PrefixCache(64 << 20)
    shared = (rows[0] * 4)[: 2 * BLOCK + 5]
    longer = shared[: 2 * BLOCK + 1] + rows[1][:7]
    runs = answers(gen, [shared, longer], 1, [0, tokens + 4], prefix=pool, budget=tokens)
    compare("prefix-cached", runs[1:], [answers(gen, [longer], 1, [0], budget=tokens)[0]])
    checks["prefix cache hit (else no cached prompt was tested)"] = pool.hit > 0
    found["prefix-cached"]["hit_tokens"] = int(pool.hit)
    lines.append(f"{label} prefix cache: {pool.hit} prompt tokens served from the pool")
    ok = all(checks.values())
    return ("PASS" if ok else "FAIL"), {"checks": checks, "runs": found, "lines": lines}
