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

from specrt.runtime.backends.base import graphable
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.session import StepSession
from specrt.runtime.speculative import SpeculativeDecoder, make_policy

BATCHES = (1, 2, 4, 8, 16)
POSITIONS = (1, 2, 3, 5, 9, 17, 33)
PAST = 256  # committed positions before every timed step
CAPACITY = 512  # one cache capacity for eager and graph steps (a multiple of the pool's bucket)


def gpu_ms(backend, cache, tokens, repeats: int) -> float | None:
    """The device time of one step, from `repeats` enqueued back to back between two CUDA events
    (no host read between them); None without CUDA."""
    if not torch.cuda.is_available() or backend.caps.cache_device is None:
        return None
    # the step StepSession.forward runs (logits at every position), its inputs on the device once
    inputs = backend.device_inputs(*StepSession.step_inputs(cache, tokens)[:4], cache)
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
    gpu = gpu_ms(backend, cache, tokens, repeats)
    graphed = graphable(getattr(backend, "cuda_graphs", False), q, q, getattr(backend, "max_graph_q", 0))
    return {
        "batch": batch,
        "positions": q,
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
    lines = [
        f"{'B':>3}{'Q':>4}  {'eager wall / gpu / host ms':>28}  {'graphs wall / gpu / host ms':>29}  graph speedup"
    ]
    for b, q in sorted({(k[1], k[2]) for k in cells}):
        e, g = cells.get(("eager", b, q)), cells.get(("graphs", b, q))
        cols = []
        for c in (e, g):
            if c is None:
                cols.append(f"{'not run':>28}")
            else:
                tag = "" if c["mode"] == "eager" or c["ran"] == "graph" else " (eager: Q > graph limit)"
                cols.append(f"{fmt(c['wall_ms'])} / {fmt(c['gpu_ms'])} / {fmt(c['host_ms'])}{tag}")
        speedup = f"{e['wall_ms'] / g['wall_ms']:.2f}x" if e and g else ""
        lines.append(f"{b:>3}{q:>4}  {cols[0]:>28}  {cols[1]:>29}  {speedup}")
    if result["not_run"]:
        lines.append(f"{result['not_run']} cells not run (the block's time budget ran out)")
    return lines


def decode_speed(make_backend, modes, prompt: list[int], batches=(1, 8), tokens: int = 128) -> list[dict]:
    """Plain and speculative (suffix draft) decoding tokens/s on a repetitive prompt, per batch and
    mode. The warm-up runs the timed generation itself (same rows, same tokens: every shape and
    cache capacity the timed run meets), so the timed run captures nothing: `captured` counts
    the graphs captured while timing, and the check demands 0 (a warm-up of 8 tokens against 128
    timed recaptured inside the timing)."""
    rows = []
    for mode in modes:
        gen = Generator(make_backend(mode == "graphs"))
        gen.eos_ids = frozenset()  # a fixed number of tokens per row
        for method in ("plain", "suffix"):
            # a fresh draft for the warm-up and for the timed run: the suffix draft learns from the
            # answers it saw, so a warmed one would draft other trees (shapes) than it captured
            def fresh():
                return gen if method == "plain" else SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(4))

            for b in batches:
                fresh().generate_ids([prompt] * b, tokens)  # warm: the timed run's shapes captured, caches pooled
                runner, before = fresh(), captures(gen)
                t = time.perf_counter()
                results = runner.generate_ids([prompt] * b, tokens)
                seconds = time.perf_counter() - t
                m = results[0].metrics
                accepted = (m.accepted_tokens + m.steps) / m.steps if m is not None and m.steps else None
                rows.append(
                    {
                        "mode": mode,
                        "method": method,
                        "batch": b,
                        "tokens_per_s": sum(len(r.token_ids) for r in results) / seconds,
                        "mean_accepted_length": accepted,
                        "captured": None if before is None else captures(gen) - before,
                    }
                )
    return rows


def captures(gen) -> int | None:
    """Graphs the generator's backend has captured so far (None: a backend that does not count)."""
    return getattr(gen.session.backend, "captures", None)


def decode_lines(rows: list[dict]) -> list[str]:
    lines = [f"{'mode':<8}{'method':<8}{'batch':>6}{'tokens/s':>11}{'accepted length':>17}"]
    for r in rows:
        acc = "" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        lines.append(f"{r['mode']:<8}{r['method']:<8}{r['batch']:>6}{r['tokens_per_s']:>11.1f}{acc:>17}")
    return lines
