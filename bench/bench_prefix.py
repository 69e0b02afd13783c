"""Prefix caching: time to first token with and without the pool, on RAG prompts that share a
document and on the turns of multi-turn chats.

    python bench/bench_prefix.py [--artifacts artifacts/SmolLM2-135M-Instruct] [--repeats 3]
                                 [--quantize gguf [--split]] [--doc-chars 2400]

RAG: a document of ~500 tokens (the start of docs/architecture.md) in the system message and
four questions about it, asked one after another. Chats: three conversations of three turns,
each turn's prompt the conversation so far (the earlier answers included, as a chat client
sends it). Each scenario runs on the batching engine (runtime/batching.py, as the server does,
without HTTP) with the prefix cache off and on, side by side, `--repeats` times with a fresh
pool each time. Time to first token is the request's prefill time (the lookup and the copy of
cached blocks included); the figure is the median over the requests that could hit (the second
question on, the second turn on) and the repeats. Every answer must equal the one without the
cache. Prints a table and writes JSON (date, versions, machine) to bench/results/.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from harness import bench_arguments, envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QUESTIONS = [
    "What does the step graph serve? Answer in one sentence.",
    "Which engines can the step graph be built into?",
    "How is the KV cache kept between steps?",
    "Summarise the document in two sentences.",
]
CHATS = [
    ["Give me three ideas for a weekend trip.", "Which of them is best in winter?", "What should I pack for it?"],
    ["Explain what a hash table is.", "How does it handle collisions?", "Show a tiny Python example."],
    ["Write a haiku about rain.", "Now one about snow.", "Which of the two is sadder, and why?"],
]


def ask(engine, prompt: list[int], max_tokens: int):
    from specrt.runtime.batching import Request

    return engine.run([Request(prompt, max_tokens)])[0]


def rag(gen, engine, doc: str, max_tokens: int) -> list[tuple[int, float, list[int]]]:
    """(prompt tokens, TTFT, answer) per question."""
    out = []
    for q in QUESTIONS:
        prompt = gen.encode_prompt(q, system="Answer from this document.\n\n" + doc)
        r = ask(engine, prompt, max_tokens)
        out.append((len(prompt), r.prefill_seconds, r.token_ids))
    return out


def chats(gen, engine, max_tokens: int) -> list[tuple[int, float, list[int]]]:
    """(prompt tokens, TTFT, answer) per turn, turns of each chat in order."""
    tok, out = gen.tokenizer, []
    for turns in CHATS:
        history = []
        for user in turns:
            history.append({"role": "user", "content": user})
            prompt = tok.encode(tok.apply_chat_template(history, add_generation_prompt=True))
            r = ask(engine, prompt, max_tokens)
            history.append({"role": "assistant", "content": gen.decode(r.token_ids)})
            out.append((len(prompt), r.prefill_seconds, r.token_ids))
    return out


def main():
    ap = bench_arguments(__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--doc-chars", type=int, default=2400, help="characters of the shared document")
    ap.add_argument("--cache-mb", type=int, default=256)
    ap.add_argument("--quantize", default="none", help="the engine's precision (gguf: the 4-bit engine)")
    ap.add_argument("--split", action="store_true", help="--quantize gguf: decode on it, verify on float32")
    args = ap.parse_args()

    from specrt.benchmark import write_result_json
    from specrt.runtime.batching import BatchEngine
    from specrt.runtime.prefix_cache import PrefixCache
    from specrt.runtime.runner import RunnerSpec, open_generator

    gen = open_generator(RunnerSpec(artifacts=args.artifacts, quantize=args.quantize, split=args.split))
    doc = (ROOT / "docs" / "architecture.md").read_text()[: args.doc_chars]
    scenarios = {"rag": lambda e: rag(gen, e, doc, args.max_tokens), "chat": lambda e: chats(gen, e, args.max_tokens)}
    runs = {s: {"off": [], "on": []} for s in scenarios}
    same = {s: True for s in scenarios}
    for rep in range(args.repeats):
        for name, scenario in scenarios.items():
            for mode in ("off", "on"):  # side by side
                pool = PrefixCache(args.cache_mb << 20) if mode == "on" else None
                got = scenario(BatchEngine(gen, max_batch=1, prefix_cache=pool))
                runs[name][mode].append({"requests": got, "hit_rate": pool.hit_rate if pool else 0.0})
                print(
                    f"repeat {rep + 1} {name:<5} cache {mode:<3} TTFT " + " ".join(f"{t * 1e3:.0f}" for _, t, _ in got)
                )
            off, on = runs[name]["off"][-1]["requests"], runs[name]["on"][-1]["requests"]
            same[name] &= [a for _, _, a in off] == [a for _, _, a in on]

    table = {}
    for name, modes in runs.items():
        # the requests that can hit: every question after the first, every turn after a chat's first
        can = [i for i in range(len(modes["off"][0]["requests"])) if (i % len(QUESTIONS) if name == "rag" else i % 3)]
        row = {}
        for mode, reps in modes.items():
            ttft = [r["requests"][i][1] for r in reps for i in can]
            row[mode] = {
                "ttft_ms": 1e3 * statistics.median(ttft),
                "hit_rate": statistics.median(r["hit_rate"] for r in reps),
            }
        row["prompt_tokens"] = statistics.median(modes["off"][0]["requests"][i][0] for i in can)
        row["ratio"] = row["on"]["ttft_ms"] / row["off"]["ttft_ms"]
        row["same_answers"] = same[name]
        table[name] = row
    print(f"\ntime to first token (median of the requests that can hit x {args.repeats} repeats)")
    print(f"{'scenario':<10}{'prompt':>8}{'off':>10}{'on':>10}{'on/off':>8}{'hit rate':>10}{'same':>6}")
    for name, r in table.items():
        print(
            f"{name:<10}{r['prompt_tokens']:>8.0f}{r['off']['ttft_ms']:>8.0f}ms{r['on']['ttft_ms']:>8.0f}ms"
            f"{r['ratio']:>8.2f}{r['on']['hit_rate']:>10.2f}{str(r['same_answers']):>6}"
        )
    result = {
        "benchmark": "prefix-cache",
        **envelope("onnxruntime"),
        "engine": gen.backend.description,
        "settings": vars(args) | {"artifacts": str(args.artifacts), "out": str(args.out)},
        "table": table,
        "runs": {
            n: {m: [[(p, t) for p, t, _ in r["requests"]] for r in reps] for m, reps in ms.items()}
            for n, ms in runs.items()
        },
    }
    name = "prefix-cache" + ("" if args.quantize == "none" else f"-{args.quantize}") + ("-split" if args.split else "")
    print(f"wrote {write_result_json(result, args.out, name)}")


if __name__ == "__main__":
    main()
