"""How long the draft-training data takes: answers, then a features pass over them (one prefill
per sequence, the way before), against answers that record their features as they are made.

    python bench/bench_data.py [--artifacts artifacts/SmolLM2-135M-Instruct] [--prompts 96]
                               [--rows 16] [--max-new-tokens 192] [--repeats 2]

The first `--prompts` prompts of the offline prompt set, greedy, on the continuous batch of
`--rows` (what `make drafts` runs), each mode `--repeats` times, interleaved (the order flips
every repeat); the median time of each. Checks that both modes give the same answers and that
the recorded features equal the features pass's (largest difference, relative to the largest
feature). Prints a table and writes JSON (date, versions, machine) to bench/results/.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from harness import bench_arguments, envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make(gen, prompts, args, record: bool):
    from specrt.training.data import generate_answers
    from specrt.training.features import cache_features

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        f = Path(d) / "f"
        answers = generate_answers(
            gen, prompts, Path(d) / "a.jsonl", args.max_new_tokens, batch=args.rows, progress=False,
            features=f if record else None,
        )  # fmt: skip
        t1 = time.perf_counter()
        cache = cache_features(gen.session, answers, f, progress=False)  # nothing left to do when recorded
        t2 = time.perf_counter()
        feats = [np.array(cache.sequence(i), np.float32) for i in range(len(answers))]
    return {"answers": t1 - t0, "features": t2 - t1, "total": t2 - t0}, answers, feats


def main():
    ap = bench_arguments(__doc__)
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from specrt.benchmark import write_result_json
    from specrt.runtime.runner import RunnerSpec, open_generator
    from specrt.training.prompts import build_prompt_set

    gen = open_generator(RunnerSpec(artifacts=args.artifacts))
    prompts = build_prompt_set(args.prompts, seed=0)
    modes = {"answers, then features pass": False, "answers recording features": True}
    times = {m: [] for m in modes}
    made = {}
    for r in range(args.repeats):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for mode in order:
            t, answers, feats = make(gen, prompts, args, modes[mode])
            times[mode].append(t)
            made[mode] = answers, feats
            print(f"repeat {r + 1} {mode}: {t['total']:.1f} s", flush=True)

    (a0, f0), (a1, f1) = made.values()
    scale = max(float(np.abs(f).max()) for f in f0)
    diff = max(float(np.abs(x - y).max()) for x, y in zip(f0, f1)) / scale
    tokens = sum(len(a.answer_ids) for a in a0)
    rows = sum(len(f) for f in f0)
    table = {}
    print(
        f"\n{len(prompts)} answers ({tokens} tokens; {rows} feature rows), rows {args.rows}, median of {args.repeats}"
    )
    print(f"{'mode':<30}{'answers s':>10}{'features s':>11}{'total s':>9}{'1,000 in':>10}")
    for mode, ts in times.items():
        med = {k: statistics.median(t[k] for t in ts) for k in ("answers", "features", "total")}
        table[mode] = {**med, "runs": ts, "minutes_for_1000": med["total"] * 1000 / len(prompts) / 60}
        print(
            f"{mode:<30}{med['answers']:>10.1f}{med['features']:>11.1f}{med['total']:>9.1f}"
            f"{table[mode]['minutes_for_1000']:>8.1f} m"
        )
    base, rec = (table[m]["total"] for m in modes)
    print(
        f"recording: {base / rec:.2f}x the data rate; answers equal: {a0 == a1}; features differ by {diff:.1e} (rel.)"
    )
    result = {
        "benchmark": "training-data",
        **envelope("onnxruntime"),
        "engine": gen.backend.description,
        "settings": {"prompts": args.prompts, "rows": args.rows, "max_new_tokens": args.max_new_tokens},
        "answer_tokens": tokens,
        "modes": table,
        "speedup": base / rec,
        "answers_equal": a0 == a1,
        "features_max_relative_difference": diff,
    }
    print(f"wrote {write_result_json(result, args.out, 'training-data')}")


if __name__ == "__main__":
    main()
