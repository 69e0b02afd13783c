"""How fast the training answers come: the target answering the draft-training prompt set on the
continuous batching engine (training/data.py `generate_answers`, what `make drafts` runs), by
batch size.

    python bench/bench_answers.py --artifacts artifacts/qwen2.5-coder-1.5b --quantize gguf-k \
        [--prompts 32] [--batches 1,16,32] [--new-tokens 128] [--repeats 1]

The prompts are the training set's (training/prompts.py `build_prompt_set`, seed 3: text on
disk), greedy answers of up to --new-tokens; each batch size answers the same prompts into a
fresh folder (nothing reused), repeats alternating the order of the batch sizes. Reports answer
tokens per second of the whole run (prompts prefilled included: what a training run waits for),
its ratio to the first batch size, and the prompt tokens beside (at 128-token answers a prompt
set's prefill is a large share). Table on stdout, JSON in bench/results/answers-<date>.json.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from harness import bench_arguments, envelope


def answer_rate(gen, prompts, batch: int, new_tokens: int) -> dict:
    """One run of generate_answers at `batch` rows: answer tokens, seconds, tokens/s."""
    from specrt.training.data import generate_answers

    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        answers = generate_answers(gen, prompts, Path(d) / "answers.jsonl", new_tokens, batch=batch, progress=False)
        seconds = time.perf_counter() - t
    tokens = sum(len(a.answer_ids) for a in answers)
    return {"answer_tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2)}


def main():
    ap = bench_arguments(__doc__)
    ap.add_argument("--quantize", default="gguf-k", help="the engine's scheme")
    ap.add_argument("--prompts", type=int, default=32, help="prompts of the training set answered")
    ap.add_argument("--batches", default="1,16,32", help="batch sizes (rows answered at once)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()

    from specrt.benchmark import write_result_json
    from specrt.layout import ArtifactLayout
    from specrt.runtime.generator import Generator
    from specrt.training.prompts import build_prompt_set

    engine = ArtifactLayout(args.artifacts).ort_engine(scheme=args.quantize)
    gen = Generator.from_engine(engine)
    prompts = build_prompt_set(args.prompts, seed=3)
    prompt_tokens = sum(len(gen.encode_prompt(p.prompt, chat=True)) for p in prompts)
    batches = [int(b) for b in args.batches.split(",")]
    runs: dict[int, list[dict]] = {b: [] for b in batches}
    for r in range(args.repeats):
        for b in batches[:: 1 if r % 2 == 0 else -1]:
            runs[b].append(answer_rate(gen, prompts, b, args.new_tokens))
            print(f"repeat {r + 1}/{args.repeats}: batch {b}: {runs[b][-1]}", flush=True)
    rows = {}
    first = statistics.median(x["tokens_per_s"] for x in runs[batches[0]])
    print(f"{len(prompts)} prompts ({prompt_tokens} prompt tokens), answers of up to {args.new_tokens} tokens")
    print(f"{'batch':>6}{'answer tokens':>15}{'seconds':>9}{'tokens/s':>10}{'x batch ' + str(batches[0]):>12}")
    for b in batches:
        rate = statistics.median(x["tokens_per_s"] for x in runs[b])
        sec = statistics.median(x["seconds"] for x in runs[b])
        rows[str(b)] = {"tokens_per_s": rate, "seconds": sec, "answer_tokens": runs[b][0]["answer_tokens"],
                        "ratio": round(rate / first, 3)}  # fmt: skip
        print(f"{b:>6}{runs[b][0]['answer_tokens']:>15}{sec:>9.1f}{rate:>10.1f}{rate / first:>12.2f}")
    result = {
        "benchmark": "answers",
        **envelope("onnxruntime", "numpy"),
        "engine": str(engine),
        "prompts": len(prompts),
        "prompt_tokens": prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "rows": rows,
        "runs": {str(b): v for b, v in runs.items()},
    }
    print(f"wrote {write_result_json(result, args.out, 'answers')}")


if __name__ == "__main__":
    main()
