"""Structured output with speculation: JSON-schema extraction (records, API-call arguments),
constrained plain decoding against constrained speculation.

    python bench/bench_structured.py [--artifacts artifacts/SmolLM2-135M-Instruct] [--repeats 3]
                                     [--quantize gguf [--split]] [--max-tokens 160]

Every task of bench/structured_tasks.jsonl (a prompt holding the facts, and the schema of the
answer: four records, four API calls) runs greedy under its schema in each mode, side by side
and interleaved, `--repeats` times with fresh drafts:

    plain            constrained plain decoding (no draft)
    grammar          the tokens the grammar forces, drafted (--draft grammar: jump-forward)
    grammar+suffix   those in front of the suffix draft (--draft suffix)
    grammar+auto     those in front of the auto draft (--draft auto, the server's default)

every speculative mode with the cost model's N. The figure per task and mode is the median of
end-to-end tokens/s (prefill included); the summary is the geometric mean over the tasks of the
speedup over plain. Also: mean accepted length, forced tokens drafted and accepted, whether
every answer equals plain's token for token and parses under its schema. Prints a table and
writes JSON (date, versions, machine) to bench/results/.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

from harness import bench_arguments, envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TASKS = ROOT / "bench" / "structured_tasks.jsonl"
MODES = {"plain": "none", "grammar": "grammar", "grammar+suffix": "suffix", "grammar+auto": "auto"}


def run_once(runner, prompt: list[int], grammar, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    r = runner.generate_ids([prompt], max_tokens, grammar=grammar)[0]
    seconds = time.perf_counter() - t0
    m = r.metrics
    return {
        "tokens": r.token_ids,
        "finish": r.finish_reason,
        "tokens_per_s": len(r.token_ids) / seconds,
        "mean_accepted_length": m.mean_accepted_length if m else 1.0,
        "forced": m.forced_tokens if m else 0,
        "forced_accepted": m.forced_accepted if m else 0,
        "steps": m.steps if m else len(r.token_ids) - 1,
    }


def main():
    ap = bench_arguments(__doc__)
    ap.add_argument("--tasks", type=Path, default=TASKS)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantize", default="none", help="the engine's precision (gguf: the 4-bit engine)")
    ap.add_argument("--split", action="store_true", help="--quantize gguf: decode on it, verify on float32")
    args = ap.parse_args()

    from specrt.benchmark import write_result_json
    from specrt.runtime.grammar import Grammar
    from specrt.runtime.runner import RunnerSpec, open_generator, open_runner

    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    engine = dict(artifacts=args.artifacts, quantize=args.quantize, split=args.split)
    gen = open_generator(RunnerSpec(**engine))
    prompts = [gen.encode_prompt(t["prompt"]) for t in tasks]
    grammars = [Grammar.json_schema(t["schema"]) for t in tasks]
    gen.generate_ids([prompts[0]], 8, grammar=grammars[0])  # warm: the engine and the grammar engine's tokenizer

    def runner(mode):  # a fresh draft each time, over the one generator loaded above
        return open_runner(RunnerSpec(**engine, draft=MODES[mode], num_draft="auto"), generator=gen)[1]

    runs = {t["name"]: {m: [] for m in MODES} for t in tasks}
    for rep in range(args.repeats):
        for t, prompt, grammar in zip(tasks, prompts, grammars):
            for mode in MODES:  # side by side: the same moment of the machine
                r = run_once(runner(mode), prompt, grammar, args.max_tokens)
                runs[t["name"]][mode].append(r)
                print(
                    f"repeat {rep + 1} {t['name']:<14} {mode:<15} {r['tokens_per_s']:6.1f} tok/s  "
                    f"accepted length {r['mean_accepted_length']:.2f}  forced {r['forced_accepted']}/{r['forced']}",
                    flush=True,
                )

    table, same, valid = {}, {m: 0 for m in MODES}, 0
    for t in tasks:
        by_mode = runs[t["name"]]
        ref = by_mode["plain"][0]
        text = gen.decode(ref["tokens"])
        ok = ref["finish"] == "stop" and _valid(text, t["schema"])
        valid += ok
        row = {"tokens": len(ref["tokens"]), "finish": ref["finish"], "valid": ok, "answer": text}
        for mode, rs in by_mode.items():
            same[mode] += all(r["tokens"] == ref["tokens"] for r in rs)
            row[mode] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "mean_accepted_length": statistics.median(r["mean_accepted_length"] for r in rs),
                "forced": rs[0]["forced"],
                "forced_accepted": rs[0]["forced_accepted"],
                "steps": rs[0]["steps"],
            }
        for mode in MODES:
            row[mode]["speedup"] = row[mode]["tokens_per_s"] / row["plain"]["tokens_per_s"]
        table[t["name"]] = row

    print(f"\nend-to-end tokens/s (median of {args.repeats}), speedup over constrained plain, accepted length")
    print(f"{'task':<14}{'tokens':>7}" + "".join(f"{m:>24}" for m in MODES))
    for name, row in table.items():
        cells = [
            f"{row[m]['tokens_per_s']:6.1f} {row[m]['speedup']:5.2f}x {row[m]['mean_accepted_length']:4.2f}"
            for m in MODES
        ]
        print(f"{name:<14}{row['tokens']:>7}" + "".join(f"{c:>24}" for c in cells))
    summary = {m: geometric_mean([row[m]["speedup"] for row in table.values()]) for m in MODES}
    forced = {m: sum(row[m]["forced"] for row in table.values()) for m in MODES}
    tokens = sum(row["tokens"] for row in table.values())
    print("geometric mean speedup: " + ", ".join(f"{m} {s:.2f}x" for m, s in summary.items()))
    print(f"forced tokens drafted (of {tokens} generated): " + ", ".join(f"{m} {f}" for m, f in forced.items()))
    print("answers equal to plain: " + ", ".join(f"{m} {s}/{len(tasks)}" for m, s in same.items()))
    print(f"plain answers complete and valid under their schema: {valid}/{len(tasks)}")

    result = {
        "benchmark": "structured",
        **envelope("onnxruntime", "llguidance"),
        "engine": gen.backend.description,
        "settings": {
            "quantize": args.quantize,
            "split": args.split,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "modes": MODES,
            "num_draft": "auto",
        },
        "geometric_mean_speedup": summary,
        "equal_to_plain": {m: f"{s}/{len(tasks)}" for m, s in same.items()},
        "valid": f"{valid}/{len(tasks)}",
        "tasks": table,
        "runs": {
            name: {m: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for m, rs in by.items()}
            for name, by in runs.items()
        },
    }
    name = "structured" + ("" if args.quantize == "none" else f"-{args.quantize}") + ("-split" if args.split else "")
    print(f"wrote {write_result_json(result, args.out, name)}")


def geometric_mean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _valid(text: str, schema: dict) -> bool:
    """The answer parses and has the schema's keys with values of the schema's types (the
    grammar guarantees it; this checks the grammar did)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return _fits(value, schema)


def _fits(value, schema: dict) -> bool:
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "object":
        props = schema.get("properties", {})
        return (
            isinstance(value, dict)
            and set(schema.get("required", [])) <= set(value)
            and all(_fits(value[k], props[k]) for k in value if k in props)
        )
    if kind == "array":
        return isinstance(value, list) and all(_fits(v, schema.get("items", {})) for v in value)
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
    }
    return checks.get(kind, lambda v: True)(value)


if __name__ == "__main__":
    main()
