"""The GPU check's speed blocks: step time over batch x positions, and decoding tokens/s.

Every cell is one step shape (batch B, Q new positions after `past` committed ones, greedy: only
the tokens come back, never the logits) run eagerly and through CUDA graphs on one cache
capacity. Three numbers per cell:

    wall    median time of a whole step as the runtime runs it: inputs to the device, the step,
            the KV append, the tokens read back (the one host sync), the rollback
    gpu     the device's own time: `repeats` steps enqueued back to back (replays, or eager
            forwards) with no host read between them, bracketed by two CUDA events, divided by
            `repeats`; an eager step that the host cannot launch fast enough shows its launch
            time here too (the GPU waits between kernels)
    host    wall - gpu: what the host adds per step (Python, launches, copies, the sync)

Without CUDA `gpu` and `host` are None: the sweep still runs (the CPU mode of the check).
"""

from __future__ import annotations

import statistics
import time

import torch
from gpu_blocks import distinct_requests

from specrt.runtime.backends.base import graphable
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.session import StepSession
from specrt.runtime.speculative import SpeculativeDecoder, make_policy

BATCHES = (1, 2, 4, 8, 16)
POSITIONS = (1, 2, 3, 5, 9, 17, 33)
PAST = 256  # committed positions before every timed step
CAPACITY = 512  # one cache capacity for eager and graph steps (a multiple of the pool's bucket)


def timed_inputs(session: StepSession, cache, tokens: list[list[int]]) -> tuple:
    """The backend's inputs of the step `session.forward(cache, tokens, want_logits=False)` runs:
    padded to the session's floor and step multiple as it pads them (a one-position step of a
    floored session computes two positions; timing one position would time a step the runtime
    never runs)."""
    return StepSession.step_inputs(cache, tokens, floor=session.floor, multiple=session.multiple)[:4]


def gpu_ms(session: StepSession, cache, host_inputs: tuple, repeats: int) -> float | None:
    """The device time of one step of `host_inputs` (timed_inputs), from `repeats` enqueued back
    to back between two CUDA events (no host read between them); None without CUDA."""
    backend = session.backend
    if not torch.cuda.is_available() or backend.caps.cache_device is None:
        return None
    inputs = backend.device_inputs(*host_inputs, cache)
    with torch.inference_mode():
        backend.enqueue(inputs, cache)  # warm (a graph is captured here if not yet)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            backend.enqueue(inputs, cache)
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / repeats


def time_cell(session: StepSession, cache, batch: int, q: int, repeats: int) -> dict:
    """One cell: wall ms (median), gpu ms, host ms, and whether it ran through a graph."""
    backend = session.backend
    vocab = backend.config.vocab_size
    tokens = [[(7 * i + 13 * b) % (vocab - 3) + 3 for i in range(q)] for b in range(batch)]
    base = cache.lengths.copy()
    walls = []
    for i in range(repeats + 3):  # 3 warm-up steps (a graph is captured in the first)
        t = time.perf_counter()
        session.forward(cache, tokens, want_logits=False)
        cache.rollback(base)
        if i >= 3:
            walls.append((time.perf_counter() - t) * 1e3)
    wall = statistics.median(walls)
    host_inputs = timed_inputs(session, cache, tokens)
    gpu = gpu_ms(session, cache, host_inputs, repeats)
    computed = host_inputs[0].shape[1]  # with the floor's padding
    graphed = graphable(getattr(backend, "cuda_graphs", False), computed, computed, getattr(backend, "max_graph_q", 0))
    return {
        "batch": batch,
        "positions": q,
        "computed": computed,
        "ran": "graph" if graphed else "eager",
        "wall_ms": wall,
        "gpu_ms": gpu,
        "host_ms": None if gpu is None else wall - gpu,
    }


def sweep(make_backend, modes, batches=BATCHES, positions=POSITIONS, repeats: int = 10, deadline=None) -> dict:
    """{mode: [cells]} for each mode ("eager", "graphs"); cells past `deadline` (a perf_counter
    time) are left out and counted under "not_run"."""
    out, not_run = {}, 0
    for mode in modes:
        backend = make_backend(mode == "graphs")
        session = StepSession(backend)
        cells = []
        for b in batches:
            if deadline is not None and time.perf_counter() > deadline:
                not_run += len(positions)
                continue
            cache = session.new_cache(b, CAPACITY)
            prefix = [(5 * i + b) % (backend.config.vocab_size - 3) + 3 for i in range(PAST)]
            session.forward(cache, [prefix] * b, last_only=True)
            for q in positions:
                if deadline is not None and time.perf_counter() > deadline:
                    not_run += 1
                    continue
                cells.append({"mode": mode, **time_cell(session, cache, b, q, repeats)})
            session.release(cache)
        out[mode] = cells
    return {"cells": out, "not_run": not_run}


def sweep_lines(result: dict) -> list[str]:
    """The sweep as a table: one line per (batch, Q), eager and graph columns side by side."""

    def fmt(v):
        return "   -  " if v is None else f"{v:6.2f}"

    cells = {(c["mode"], c["batch"], c["positions"]): c for cs in result["cells"].values() for c in cs}
    lines = [f"{'B':>3}{'Q':>5} {'eager wall / gpu / host ms':>28}  {'graphs wall / gpu / host ms':>29}  graph speedup"]
    for b, q in sorted({(k[1], k[2]) for k in cells}):
        e, g = cells.get(("eager", b, q)), cells.get(("graphs", b, q))
        computed = (e or g).get("computed", q)
        shown = f"{q}" if computed == q else f"{q}>{computed}"  # the floor's padding computed
        cols = []
        for c in (e, g):
            if c is None:
                cols.append(f"{'not run':>28}")
            else:
                tag = "" if c["mode"] == "eager" or c["ran"] == "graph" else " (eager: Q > graph limit)"
                cols.append(f"{fmt(c['wall_ms'])} / {fmt(c['gpu_ms'])} / {fmt(c['host_ms'])}{tag}")
        speedup = f"{e['wall_ms'] / g['wall_ms']:.2f}x" if e and g else ""
        lines.append(f"{b:>3}{shown:>5} {cols[0]:>28}  {cols[1]:>29}  {speedup}")
    if result["not_run"]:
        lines.append(f"{result['not_run']} cells not run (the block's time budget ran out)")
    return lines


DECODE_BATCHES = (1, 4, 16, 64)
METHODS = ("plain", "suffix", "ngram")


def decode_speed(
    make_backend, modes, prompts: list[list[int]], batches=DECODE_BATCHES, tokens: int = 128, deadline=None
) -> list[dict]:
    """Plain and speculative decoding tokens/s per batch and mode, the rows' prompts taken in turn
    from `prompts`. suffix: the same requests answered once before by the same draft (their
    answers in its tree: a repeated request, the case suffix decoding is for); ngram: prompt
    lookup. Each method runs its generation twice untimed first (the second with the draft as
    the timed run finds it: its shapes captured, caches pooled), so the timed run captures
    nothing: `captured` counts graphs captured while timing, and the block demands 0. A
    speculative run's tokens must equal plain's (`equal`)."""
    rows = []
    for mode in modes:
        gen = Generator(make_backend(mode == "graphs"))
        gen.eos_ids = frozenset()  # a fixed number of tokens per row
        for b in batches:
            if deadline is not None and time.perf_counter() > deadline:
                break  # the block's time budget ran out: the larger batches are not run
            batch = distinct_requests(prompts, b)
            plain_tokens, plain_speed = None, None
            for method in METHODS:
                runner = gen if method == "plain" else SpeculativeDecoder(gen, make_proposer(method), make_policy(4))
                for _ in range(2):
                    runner.generate_ids(batch, tokens)
                before = captures(gen)
                t = time.perf_counter()
                results = runner.generate_ids(batch, tokens)
                seconds = time.perf_counter() - t
                got = [r.token_ids for r in results]
                speed = sum(len(t) for t in got) / seconds
                if method == "plain":  # METHODS' first
                    plain_tokens, plain_speed = got, speed
                ms = [r.metrics for r in results if r.metrics is not None and r.metrics.steps]
                accepted = sum(m.accepted_tokens for m in ms) if ms else None
                steps = sum(m.steps for m in ms) if ms else None
                rows.append(
                    {
                        "mode": mode,
                        "method": method,
                        "batch": b,
                        "tokens_per_s": speed,
                        "speedup": speed / plain_speed,
                        "mean_accepted_length": None if not steps else (accepted + steps) / steps,
                        "captured": None if before is None else captures(gen) - before,
                        "equal": got == plain_tokens,
                    }
                )
    return rows


def crossings(rows: list[dict]) -> dict:
    """Per mode and draft, the smallest batch where speculation stopped paying (speedup < 1),
    None where it paid at every batch run."""
    out = {}
    for r in rows:
        if r["method"] == "plain":
            continue
        key = f"{r['mode']} {r['method']}"
        if r["speedup"] < 1 and out.get(key) is None:
            out[key] = r["batch"]
        out.setdefault(key, None)
    return out


def captures(gen) -> int | None:
    """Graphs the generator's backend has captured so far (None: a backend that does not count)."""
    return getattr(gen.session.backend, "captures", None)


def decode_lines(rows: list[dict]) -> list[str]:
    lines = [f"{'mode':<8}{'method':<8}{'batch':>6}{'tokens/s':>11}{'speedup':>9}{'accepted length':>17}  equal"]
    for r in rows:
        acc = "" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        lines.append(
            f"{r['mode']:<8}{r['method']:<8}{r['batch']:>6}{r['tokens_per_s']:>11.1f}{r['speedup']:>8.2f}x{acc:>17}"
            f"  {'yes' if r['equal'] else 'NO'}"
        )
    for key, batch in crossings(rows).items():
        lines.append(f"{key}: {'pays at every batch run' if batch is None else f'stops paying at batch {batch}'}")
    return lines
