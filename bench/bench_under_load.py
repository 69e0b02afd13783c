"""`--draft auto` against plain decoding on a loaded machine: other work beside the engine.

    python bench/bench_under_load.py [--artifacts artifacts/SmolLM2-135M-Instruct] [--quantize gguf] [--split]
                                     [--hogs 2] [--memory-hogs 1] [--rounds 3] [--max-new-tokens 128]

Users' machines run other things, so step times are noisy and spike; the cost model must not
turn a noisy timing into a losing bet. Here `--hogs` busy Python processes and `--memory-hogs`
processes that copy a 64 MiB array over and over (memory bandwidth, as a second model or a build
would take it) run beside the engine for the whole run. Every prompt of the file is generated
greedily by plain decoding and by `--draft auto` (a fresh draft each time: the suffix draft
learns from the answers it saw, and would copy the previous round's) on one loaded engine,
alternately (plain first
in even rounds, auto first in odd ones), `--rounds` times; the figure per prompt is the median
over the rounds of auto's decode tokens/s over plain's in the same round (prefill excluded: it
is the same for both). Both answers must be equal (greedy: exact by construction up to near
ties; a difference is reported, not hidden). Prints a table (prompt, class, ratio, auto's mean
accepted length and share of steps that drafted) and writes JSON (date, versions, machine, the
load average seen) to bench/results/.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

from harness import bench_arguments, envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _busy(stop) -> None:  # a CPU hog: pure Python arithmetic
    x = 1.0
    while not stop.is_set():
        for _ in range(100_000):
            x = x * 1.000001 + 1e-9


def _copy(stop) -> None:  # a memory-bandwidth hog
    import numpy as np

    a, b = np.ones(8 << 20), np.empty(8 << 20)
    while not stop.is_set():
        np.copyto(b, a)


def start_hogs(cpu: int, memory: int):
    stop = mp.Event()
    procs = [mp.Process(target=_busy, args=(stop,), daemon=True) for _ in range(cpu)]
    procs += [mp.Process(target=_copy, args=(stop,), daemon=True) for _ in range(memory)]
    for p in procs:
        p.start()
    return stop, procs


def main() -> None:
    ap = bench_arguments(__doc__, artifacts=True, prompts=True)
    ap.add_argument("--quantize", default="gguf", choices=("none", "gguf"))
    ap.add_argument("--split", action="store_true", help="gguf decoding, float32 verifying")
    ap.add_argument("--hogs", type=int, default=2, help="busy Python processes beside the engine")
    ap.add_argument("--memory-hogs", type=int, default=1, help="array-copying processes beside the engine")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--name", default="under-load")
    args = ap.parse_args()

    from specrt.benchmark import load_prompts, write_result_json
    from specrt.runtime.runner import RunnerSpec, open_runner

    spec = RunnerSpec(artifacts=args.artifacts, quantize=args.quantize, split=args.split, draft=args.draft)
    gen, runner = open_runner(spec)
    prompts = load_prompts(args.prompts)
    encoded = [gen.encode_prompt(p["prompt"]) for p in prompts]
    for ids in encoded[:2]:  # warm: sessions, caches, first calls
        gen.generate_ids([ids], 16)
        runner.generate_ids([ids], 16)
    stop, procs = start_hogs(args.hogs, args.memory_hogs)
    time.sleep(2.0)
    rows = [
        {"prompt": i, "class": p["class"], "ratios": [], "accepted": [], "drafted": []} for i, p in enumerate(prompts)
    ]
    loads, differ = [], []
    t0 = time.perf_counter()
    try:
        for r in range(args.rounds):
            for i, ids in enumerate(encoded):
                order = ("plain", "auto") if r % 2 == 0 else ("auto", "plain")
                got = {}
                for which in order:
                    # a fresh draft for every generation: the suffix draft learns from the answers it saw
                    run = gen if which == "plain" else open_runner(spec, generator=gen)[1]
                    got[which] = run.generate_ids([ids], args.max_new_tokens)[0]
                p, a = got["plain"], got["auto"]
                if p.token_ids != a.token_ids:
                    differ.append(i)
                tps = {k: len(v.token_ids) / max(v.decode_seconds, 1e-9) for k, v in got.items()}
                rows[i]["ratios"].append(tps["auto"] / tps["plain"])
                m = a.metrics
                if m is not None and m.steps:
                    rows[i]["accepted"].append((m.accepted_tokens + m.steps) / m.steps)
                    rows[i]["drafted"].append((m.drafted_at_depth or [0])[0] / m.steps)
                    rows[i].setdefault("fits", []).append(
                        {"alpha": m.alpha, "beta": m.beta, "decode_ms": 1e3 * (m.decode_step_seconds or 0)}
                    )
                loads.append(os.getloadavg()[0])
            print(f"round {r + 1}/{args.rounds} done ({time.perf_counter() - t0:.0f} s, load {loads[-1]:.1f})")
    finally:
        stop.set()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    print(f"\n{'#':>3} {'class':<13}{'auto / plain':>13}{'min':>7}{'accepted':>10}{'drafted':>9}")
    for row in rows:
        row["ratio"] = statistics.median(row["ratios"])
        row["accepted_length"] = statistics.median(row["accepted"]) if row["accepted"] else None
        acc = "" if row["accepted_length"] is None else f"{row['accepted_length']:.2f}"
        drafted = f"{statistics.median(row['drafted']):.0%}" if row["drafted"] else ""
        low = min(row["ratios"])
        print(f"{row['prompt']:>3} {row['class']:<13}{row['ratio']:>12.3f}x{low:>7.2f}{acc:>10}{drafted:>9}")
    worst = min(r["ratio"] for r in rows)
    gmean = statistics.geometric_mean(r["ratio"] for r in rows)
    print(f"worst prompt {worst:.3f}x, geometric mean {gmean:.3f}x; load average {statistics.median(loads):.1f}")
    if differ:
        print(f"answers differed from plain on prompts {sorted(set(differ))} (near ties)")
    engine = "gguf --split" if args.split else args.quantize
    result = {
        **envelope("onnxruntime", "numpy", load_average=statistics.median(loads)),
        "benchmark": "auto-under-load",
        "config": {
            "engine": engine,
            "draft": args.draft,
            "hogs": args.hogs,
            "memory_hogs": args.memory_hogs,
            "rounds": args.rounds,
            "max_new_tokens": args.max_new_tokens,
            "prompts": str(args.prompts),
        },
        "rows": rows,
        "worst": worst,
        "gmean": gmean,
        "answers_differed": sorted(set(differ)),
    }
    print(f"wrote {write_result_json(result, args.out, args.name)}")


if __name__ == "__main__":
    main()
