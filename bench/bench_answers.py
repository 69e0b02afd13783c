"""How fast the target's answers for draft training are made: static batches (each waits for
its longest answer) against the continuous batching engine that `generate_answers` runs.

    python bench/bench_answers.py [--artifacts artifacts/SmolLM2-135M-Instruct] [--prompts 64]
                                  [--rows 16,32] [--max-new-tokens 256] [--quantize gguf [--split]]

The first `--prompts` prompts of the offline prompt set (specrt/training/prompts.py, what
`make drafts` answers), greedy, as `train-draft` makes them: once as static batches of 16 (the
way before), then on the continuous batch with each `--rows`, side by side. Reports answers/s,
generated tokens/s, the extrapolated time for 4,000 answers, and how many answers equal the
static batches' (greedy; batching may move near ties within the engine's batch-invariance
bound). Prints a table and writes JSON (date, versions, machine) to bench/results/.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from harness import bench_arguments, envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main():
    ap = bench_arguments(__doc__)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--rows", default="16,32")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--quantize", default="none", help="the engine's precision (gguf: the 4-bit engine)")
    ap.add_argument("--split", action="store_true", help="--quantize gguf: decode on it, verify on float32")
    args = ap.parse_args()

    from specrt.benchmark import write_result_json
    from specrt.runtime.runner import RunnerSpec, open_generator
    from specrt.training.data import generate_answers
    from specrt.training.prompts import build_prompt_set

    gen = open_generator(RunnerSpec(artifacts=args.artifacts, quantize=args.quantize, split=args.split))
    prompts = build_prompt_set(args.prompts, seed=0)
    ids = [gen.encode_prompt(p.prompt, chat=True) for p in prompts]

    t0 = time.perf_counter()
    static = []
    for start in range(0, len(ids), 16):  # the way before: a static batch waits for its longest answer
        static += [r.token_ids for r in gen.generate_ids(ids[start : start + 16], args.max_new_tokens)]
    runs = {"static 16": {"seconds": time.perf_counter() - t0, "answers": static}}
    for rows in [int(r) for r in args.rows.split(",")]:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            got = generate_answers(gen, prompts, Path(d) / "a.jsonl", args.max_new_tokens, batch=rows, progress=False)
            runs[f"continuous {rows}"] = {"seconds": time.perf_counter() - t0, "answers": [a.answer_ids for a in got]}

    table = {}
    print(f"\n{len(prompts)} answers, at most {args.max_new_tokens} tokens, greedy")
    print(f"{'mode':<16}{'seconds':>9}{'answers/s':>11}{'tokens/s':>10}{'4,000 in':>10}{'= static':>10}")
    for mode, r in runs.items():
        tokens = sum(map(len, r["answers"]))
        same = sum(a == b for a, b in zip(r["answers"], static))
        row = {
            "seconds": r["seconds"],
            "answers_per_s": len(prompts) / r["seconds"],
            "tokens_per_s": tokens / r["seconds"],
            "minutes_for_4000": 4000 / (len(prompts) / r["seconds"]) / 60,
            "tokens": tokens,
            "equal_to_static": f"{same}/{len(prompts)}",
        }
        table[mode] = row
        print(
            f"{mode:<16}{row['seconds']:>9.1f}{row['answers_per_s']:>11.2f}{row['tokens_per_s']:>10.1f}"
            f"{row['minutes_for_4000']:>8.1f} m{row['equal_to_static']:>10}"
        )
    result = {
        "benchmark": "answers",
        **envelope("onnxruntime"),
        "engine": gen.backend.description,
        "settings": {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "quantize": args.quantize},
        "modes": table,
    }
    name = "answers" + ("" if args.quantize == "none" else f"-{args.quantize}") + ("-split" if args.split else "")
    print(f"wrote {write_result_json(result, args.out, name)}")


if __name__ == "__main__":
    main()
