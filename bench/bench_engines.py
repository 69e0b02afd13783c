"""Engines of one artifacts folder side by side: decode and prefill, plain and `--draft auto`,
interleaved (each prompt on each engine in turn, every round), medians.

    .venv/bin/python bench/bench_engines.py --artifacts artifacts/qwen2.5-coder-1.5b \
        --engines gguf-a8,gguf-k [--prompts bench/prompts_real.jsonl] [--tokens 128] [--rounds 2]

Greedy, chat template on, EOS ignored (every generation is --tokens long), one prompt per class.
Prints a table per class (decode tokens/s; end to end with --draft auto) and writes
bench/results/engines-<date>-<folder>.json (date, versions, CPU, commit, every run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

from specrt.runtime.runner import RunnerSpec, open_runner

from harness import envelope, write_results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--artifacts", type=Path, required=True)
    p.add_argument("--engines", default="gguf-a8,gguf-k")
    p.add_argument("--prompts", type=Path, default=Path(__file__).resolve().parent / "prompts_real.jsonl")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--classes", type=int, default=8, help="how many classes of the prompt file (in its order)")
    args = p.parse_args()
    schemes = args.engines.split(",")
    seen, prompts = set(), []
    for line in args.prompts.read_text().splitlines():
        row = json.loads(line)
        if row["class"] not in seen and len(seen) < args.classes:
            seen.add(row["class"])
            prompts.append(row)
    runners = {}
    for s in schemes:  # plain and auto share one engine
        gen, auto = open_runner(RunnerSpec(artifacts=args.artifacts, quantize=s, draft="auto"))
        gen.eos_ids = frozenset()
        runners[s] = (gen, auto)
    runs = []
    for r in range(args.rounds):
        for row in prompts:
            for s in schemes if r % 2 == 0 else reversed(schemes):
                gen, auto = runners[s]
                plain = gen.generate(row["prompt"], max_new_tokens=args.tokens)
                t0 = time.perf_counter()
                spec = auto.generate(row["prompt"], max_new_tokens=args.tokens)
                wall = time.perf_counter() - t0
                runs.append(
                    {
                        "round": r, "class": row["class"], "engine": s,
                        "prompt_tokens": len(gen.tokenizer.encode(row["prompt"])),
                        "prefill_ms": round(plain.prefill_seconds * 1e3, 1),
                        "decode_tps": round(plain.decode_tokens_per_second, 2),
                        "auto_end_to_end_tps": round(len(spec.token_ids) / wall, 2),
                        "auto_equals_plain": spec.token_ids == plain.token_ids,
                    }
                )  # fmt: skip
                print(json.dumps(runs[-1]), flush=True)

    def med(cls, s, key):
        return statistics.median(x[key] for x in runs if x["class"] == cls and x["engine"] == s)

    print(f"\n{'class':14}" + "".join(f"{s + ' decode':>16}{s + ' auto':>14}" for s in schemes))
    for row in prompts:
        c = row["class"]
        cells = [f"{med(c, s, 'decode_tps'):>16.1f}{med(c, s, 'auto_end_to_end_tps'):>14.1f}" for s in schemes]
        print(f"{c:14}" + "".join(cells))
    out = {
        **envelope("onnxruntime"),
        "artifacts": str(args.artifacts),
        "engines": schemes,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "runs": runs,
    }
    write_results(f"engines-{datetime.date.today()}-{args.artifacts.name}", out)


if __name__ == "__main__":
    main()
