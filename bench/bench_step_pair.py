"""Two engines' step graphs in one process, step by step in turn: a graph change's cost without
the machine's state between processes.

    python bench/bench_step_pair.py --before /tmp/before-art --artifacts artifacts/qwen2.5-coder-1.5b \
        --quantize gguf-k [--positions 1,3,5,9,17] [--repeats 60]

This machine switches between states from one process to the next (the 1.5B's one-position step
~25 or ~33 ms), so bench_ab.py's alternating processes need many rounds to see a 3 % change.
Here both graphs run on this tree's kernel library in one process (a weight both name is packed
once and shared), after the same 128-position past: each repeat times every step size on both
engines, in alternating order, then rolls the cache back. Reports the median step of each, their
ratio, and the median of the per-repeat ratios (each pair ran moments apart). Only a change of
the graph (or of what both graphs call) is measured: the kernel library is the same for both.
Table on stdout, JSON in bench/results/step-pair-<date>.json.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from harness import bench_arguments, envelope

PAST = 128


def engine_step(engine: Path, room: int):
    """(run, cache, ids) for an engine's graph: its session, a cache holding a PAST-position past."""
    from specrt.engines.ort import OrtOptions, graph_session
    from specrt.engines.ort_measure import _runner
    from specrt.schema.config import ModelConfig

    m = json.loads((engine / "manifest.json").read_text())
    session, _ = graph_session((engine / m["graph_dir"] / "model.onnx").resolve(), OrtOptions(), "build it first")
    cfg = ModelConfig.from_dict(m["config"])
    fresh, run = _runner(session, cfg, m["graph_flavour"], PAST + room)
    cache = fresh()
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, PAST + room).tolist()
    run([ids[:PAST]], cache)
    return run, cache, ids


def main():
    ap = bench_arguments(__doc__)
    ap.add_argument("--before", type=Path, required=True, help="the other artifacts folder (the before graph)")
    ap.add_argument("--quantize", default="gguf-k", help="the engines' scheme")
    ap.add_argument("--positions", default="1,3,5,9,17")
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()

    from specrt.benchmark import write_result_json
    from specrt.layout import ArtifactLayout

    qs = [int(q) for q in args.positions.split(",")]
    engines = {v: ArtifactLayout(a).ort_engine(scheme=args.quantize).resolve()
               for v, a in (("before", args.before), ("after", args.artifacts))}  # fmt: skip
    steps = {v: engine_step(e, 2 * max(qs)) for v, e in engines.items()}
    times = {(v, q): [] for v in engines for q in qs}
    for r in range(args.repeats + 1):
        for q in qs:
            for v in list(engines)[:: 1 if r % 2 == 0 else -1]:
                run, cache, ids = steps[v]
                t = time.perf_counter()
                run([ids[PAST : PAST + q]], cache)
                if r:  # the first repeat warms each shape up
                    times[(v, q)].append(time.perf_counter() - t)
                cache[-1][:] = PAST  # roll back: every step sees the same past
    rows = {}
    print(f"{'positions':>10}{'before ms':>11}{'after ms':>10}{'after/before':>14}{'paired':>9}")
    for q in qs:
        b, a = (statistics.median(times[(v, q)]) * 1e3 for v in ("before", "after"))
        paired = statistics.median(y / x for x, y in zip(times[("before", q)], times[("after", q)]))
        rows[str(q)] = {"before_ms": round(b, 3), "after_ms": round(a, 3), "ratio": round(a / b, 3),
                        "paired_ratio": round(paired, 3)}  # fmt: skip
        print(f"{q:>10}{b:>11.2f}{a:>10.2f}{a / b:>14.3f}{paired:>9.3f}")
    result = {
        "benchmark": "step-pair",
        **envelope("onnxruntime", "numpy"),
        "engines": {v: str(e) for v, e in engines.items()},
        "past": PAST,
        "repeats": args.repeats,
        "rows": rows,
    }
    print(f"wrote {write_result_json(result, args.out, 'step-pair')}")


if __name__ == "__main__":
    main()
