"""The batch crossover on a virtual clock: continuous batching's throughput against concurrent
clients, plain decoding against speculation, free of machine noise.

    python bench/bench_crossover.py [--artifacts artifacts/SmolLM2-135M-Instruct] [--draft auto]
                                    [--clients 1,2,4,8,16] [--quantize gguf [--split]]

bench_batch.py runs the closed loop for real, and one run of it moves by ±10 % here. This script
runs the same loop (C clients, each sending its next request when the previous is answered, into
an engine of C slots; chat, code editing and JSON prompts) on a target that replays each prompt's
greedy answer (bench/replay.py), with a clock that charges every step what the real engine takes
for it: a grid of step times by rows and positions measured here before the runs (median of a
few steps each, the rows' caches at a realistic length), interpolated; a prompt chunk what one
row's step of its length takes; and each draft method's host work per step beyond plain
decoding, measured in the real loop (bench_policy.py's measurement), once per row of the step.
The cost model reads the clock, so each mode's choices are the ones it would make on the real
engine, and a run is a function of the policy alone. Modes: plain, the draft with a fixed N, the draft with N = auto.
Prints the table, writes JSON (date, versions, machine) to bench/results/.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench_batch import serve_clients
from bench_policy import host_work
from harness import bench_arguments, envelope
from replay import ReplayBackend

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CLASSES = ("chat", "code_edit", "json")
GRID_ROWS = (1, 2, 4, 8, 16)
GRID_POSITIONS = (1, 2, 3, 5, 9, 17, 64)


def measure_grid(gen, rows=GRID_ROWS, positions=GRID_POSITIONS, past: int = 200, repeats: int = 3) -> dict:
    """Seconds per step of the real engine by (rows, positions per row), each the median of
    `repeats` steps after one untimed, every row's cache `past` positions long."""
    rng = np.random.default_rng(0)
    session = gen.session
    out = {}
    for b in rows:
        cache = session.new_cache(b, past + 2 * max(positions))
        session.forward(cache, [rng.integers(0, 1000, past).tolist() for _ in range(b)], last_only=True)
        for q in positions:
            if b > 1 and q > 17:
                continue  # prompt chunks run on one row
            times = []
            for r in range(repeats + 1):
                t = time.perf_counter()
                session.forward(cache, [rng.integers(0, 1000, q).tolist() for _ in range(b)])
                if r:
                    times.append(time.perf_counter() - t)
                cache.lengths[:] = past
            out[(b, q)] = statistics.median(times)
        session.release(cache)
    return out


class GridClock:
    """Step times from the measured grid: interpolated over positions within a row count, then
    between row counts."""

    def __init__(self, grid: dict, work_share: float):
        self.grid = grid
        self.rows = sorted({b for b, _ in grid})
        self.work_s = work_share * grid[(1, 1)]
        self.total = 0.0

    def _at(self, b: int, q: float) -> float:
        qs = sorted(p for r, p in self.grid if r == b)
        ts = [self.grid[(b, p)] for p in qs]
        if q <= qs[-1]:
            return float(np.interp(q, qs, ts))
        slope = (ts[-1] - ts[-2]) / (qs[-1] - qs[-2])  # beyond the grid: its last slope
        return ts[-1] + slope * (q - qs[-1])

    def step(self, rows: int, q: float) -> float:
        lo = max(r for r in self.rows if r <= rows) if rows >= self.rows[0] else self.rows[0]
        hi = min((r for r in self.rows if r >= rows), default=self.rows[-1])
        if lo == hi:
            return self._at(lo, q)
        w = (rows - lo) / (hi - lo)
        return (1 - w) * self._at(lo, q) + w * self._at(hi, q)


def closed_loop(runner, prompts, answers, clients: int, max_tokens: int, clock: GridClock) -> dict:
    """`clients` clients in a closed loop on the clock; every answer checked against alone."""
    from specrt.runtime.batching import BatchEngine

    engine = BatchEngine(runner, max_batch=clients)
    session, decoder = engine.session, engine.decoder
    forward, observe = session.forward, decoder.observe
    clock.total, last = 0.0, [0.0]

    def timed_forward(cache, tokens, trees=None, last_only=False, **kw):
        q = max(len(t) for t in tokens)
        last[0] = clock.step(1, q) if last_only else clock.step(cache.batch, q)
        clock.total += last[0]
        return forward(cache, tokens, trees, last_only, **kw)

    def timed_observe(state, r):  # the draft's host work grows with the rows that draft
        r.verify_seconds, r.draft_seconds = last[0], clock.work_s * len(r.rows)
        clock.total += r.draft_seconds
        observe(state, r)

    session.forward = timed_forward
    decoder.observe = timed_observe
    try:
        done = serve_clients(engine, prompts, clients, max_tokens)
    finally:
        session.forward = forward
        decoder.observe = observe
        engine.close()
    tokens = sum(len(r.token_ids) for _, r in done)
    same = sum(r.token_ids == answers[tuple(p)] for p, r in done)
    return {"tokens_per_s": tokens / clock.total, "seconds": clock.total, "tokens": tokens, "same": [same, len(done)]}


def main() -> None:
    ap = bench_arguments(__doc__, prompts=True)
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--fixed-n", type=int, default=3)
    ap.add_argument("--quantize", default="none")
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--host-work", type=float, default=None, help="the draft's host work share (skips measuring)")
    args = ap.parse_args()

    from specrt.benchmark import load_prompts, write_result_json
    from specrt.runtime.drafts import make_proposer
    from specrt.runtime.runner import RunnerSpec, open_generator
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy
    from specrt.runtime.target import Target

    real = open_generator(RunnerSpec(artifacts=args.artifacts, quantize=args.quantize, split=args.split))
    prompts = [real.encode_prompt(p["prompt"]) for p in load_prompts(args.prompts) if p["class"] in CLASSES]
    answers = {tuple(p): real.generate_ids([p], args.max_tokens)[0].token_ids for p in prompts}
    work = args.host_work
    if work is None:
        work = host_work(real, [args.draft], prompts, 64, rounds=2)[args.draft]
    t = time.perf_counter()
    grid = measure_grid(real)
    print(f"step grid measured in {time.perf_counter() - t:.0f} s; host work {work:.2%} of a decode step", flush=True)
    caps = real.session.caps
    target = Target(
        ReplayBackend(answers, real.config.vocab_size, tuple(sorted(real.eos_ids)), step_ms=caps.step_ms),
        max_context=real.max_context,
    )
    clients = [int(c) for c in args.clients.split(",")]
    modes = {
        "plain": (0, 0.0),
        f"{args.draft} N={args.fixed_n}": (args.fixed_n, work),
        f"{args.draft} auto": ("auto", work),
    }
    table = {m: {} for m in modes}
    for c in clients:
        for mode, (n, share) in modes.items():
            runner = (
                SpeculativeDecoder(target, make_proposer(args.draft), make_policy(n)) if n else target_plain(target)
            )
            table[mode][c] = closed_loop(runner, prompts, answers, c, args.max_tokens, GridClock(grid, share))
        base = table["plain"][c]["tokens_per_s"]
        cells = "".join(
            f"  {m} {table[m][c]['tokens_per_s']:7.1f} ({table[m][c]['tokens_per_s'] / base:.2f}x)" for m in modes
        )
        print(f"clients {c:>2}{cells}", flush=True)
    for m in modes:
        same = [sum(r["same"][i] for r in table[m].values()) for i in (0, 1)]
        print(f"{m}: answers equal to alone {same[0]}/{same[1]}")
    result = {
        "benchmark": "crossover-virtual-clock",
        **envelope("onnxruntime", "numpy"),
        "engine": real.backend.description,
        "settings": {**vars(args), "artifacts": str(args.artifacts), "prompts": str(args.prompts), "out": None},
        "host_work_share": work,
        "grid_s": {f"{b}x{q}": s for (b, q), s in grid.items()},
        "modes": {m: {str(c): v for c, v in by.items()} for m, by in table.items()},
    }
    print(f"wrote {write_result_json(result, args.out, 'crossover')}")


def target_plain(target):
    """Plain decoding over the replay target (the Generator's decoder: no draft, N = 0)."""
    from specrt.runtime.drafts.base import NoDraft
    from specrt.runtime.policy import FixedPolicy
    from specrt.runtime.speculative import SpeculativeDecoder

    return SpeculativeDecoder(target, NoDraft(), FixedPolicy(0))


if __name__ == "__main__":
    main()
