"""Continuous batching on this CPU: server throughput against concurrent clients, plain decoding
against speculation with a fixed N and with the cost model's N (the crossover).

    python bench/bench_batch.py [--artifacts artifacts/SmolLM2-135M-Instruct] [--draft suffix]
                                [--clients 1,2,4,8,16] [--fixed-n 3] [--repeats 2] [--quantize gguf [--split]]

C clients each send a request, wait for its answer and send the next (a closed loop) into a
BatchEngine with C slots. The requests are the prompts of the classes chat, code editing and
JSON, each the same number of times (as often as gives every client at least two requests), so
every C sees the same mix: the serving engine itself, without HTTP (bench_load.py measures the
whole server). For every C the three modes run side by side (plain, fixed N, auto), `--repeats`
times, fresh engines and drafts each time; the figure is the median throughput (generated tokens
per second of wall time, prefill included). Also reported: draft tokens per row and step (how
far speculation backs off as the batch grows), tokens per verification step, and the check
that every answer (greedy) equals its prompt's answer alone. Prints a table, writes JSON (date,
versions, machine) to bench/results/ and a plot of tokens/s against clients.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from pathlib import Path

from harness import bench_arguments, envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CLASSES = ("chat", "code_edit", "json")


def serve_clients(engine, prompts: list[list[int]], clients: int, max_tokens: int) -> list[tuple[list[int], object]]:
    """`clients` clients, each sending its next request when the previous is answered, every
    prompt as often and two requests per client at least: (prompt, GenerationResult) of each
    request, in the order they finished (bench_crossover.py runs the same loop on its clock)."""
    from specrt.runtime.batching import Request

    rounds = -(-2 * clients // len(prompts))
    queue = [p for _ in range(rounds) for p in prompts]
    owner, done = {}, []
    for _ in range(clients):
        prompt = queue.pop(0)
        owner[engine.submit(Request(prompt, max_tokens))] = prompt
    while not engine.idle:
        for e in engine.step():
            if e.result is not None:
                done.append((owner.pop(e.rid), e.result))
                if queue:
                    prompt = queue.pop(0)
                    owner[engine.submit(Request(prompt, max_tokens))] = prompt
    return done


def closed_loop(engine, prompts: list[list[int]], clients: int, max_tokens: int) -> dict:
    """The closed loop (`serve_clients`) on the wall clock."""
    t0 = time.perf_counter()
    done = serve_clients(engine, prompts, clients, max_tokens)
    wall = time.perf_counter() - t0
    outputs, results = [(p, r.token_ids) for p, r in done], [r for _, r in done]
    tokens = sum(len(r.token_ids) for r in results)
    spec = [r.metrics for r in results if r.metrics is not None]
    steps = sum(m.steps for m in spec)
    return {
        "tokens_per_s": tokens / wall,
        "seconds": wall,
        "tokens": tokens,
        "engine_steps": engine.steps,
        "draft_per_row_step": sum(m.drafted_tokens for m in spec) / steps if steps else 0.0,
        "tokens_per_row_step": (sum(m.accepted_tokens for m in spec) + steps) / steps if steps else 1.0,
        "outputs": outputs,
    }


def main():
    ap = bench_arguments(__doc__, prompts=True)
    ap.add_argument("--draft", default="suffix", help="the draft of the fixed-N and auto modes")
    ap.add_argument("--drafts", type=Path, default=None, help="trained drafts (for --draft medusa, eagle3, ...)")
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--fixed-n", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quantize", default="none", help="the engine's precision (gguf: the 4-bit engine)")
    ap.add_argument("--split", action="store_true", help="--quantize gguf: decode on it, verify on float32")
    args = ap.parse_args()

    from specrt.benchmark import load_prompts, write_result_json
    from specrt.runtime.batching import BatchEngine
    from specrt.runtime.runner import RunnerSpec, open_generator, open_runner

    engine = dict(artifacts=args.artifacts, quantize=args.quantize, split=args.split)
    gen = open_generator(RunnerSpec(**engine))
    prompts = [gen.encode_prompt(p["prompt"]) for p in load_prompts(args.prompts) if p["class"] in CLASSES]
    alone = {tuple(p): gen.generate_ids([p], args.max_tokens)[0].token_ids for p in prompts}
    clients = [int(c) for c in args.clients.split(",")]

    def runner(num_draft):  # a fresh draft each time, over the one generator loaded above
        draft_dir = None if args.drafts is None else args.drafts / args.draft
        spec = RunnerSpec(**engine, draft=args.draft, num_draft=num_draft, draft_dir=draft_dir)
        return open_runner(spec, generator=gen)[1]

    modes = {
        "plain": lambda: gen,
        f"{args.draft} N={args.fixed_n}": lambda: runner(args.fixed_n),
        f"{args.draft} auto": lambda: runner("auto"),
    }
    runs = {m: {c: [] for c in clients} for m in modes}
    same = {m: [0, 0] for m in modes}
    for rep in range(args.repeats):
        for c in clients:
            for mode, make in modes.items():  # side by side: the same moment of the machine
                r = closed_loop(BatchEngine(make(), max_batch=c), prompts, c, args.max_tokens)
                outputs = r.pop("outputs")
                same[mode][0] += sum(out == alone[tuple(p)] for p, out in outputs)
                same[mode][1] += len(outputs)
                runs[mode][c].append(r)
                print(
                    f"repeat {rep + 1} clients {c:>2} {mode:<14} {r['tokens_per_s']:7.1f} tok/s  "
                    f"draft/row-step {r['draft_per_row_step']:.2f}",
                    flush=True,
                )

    table = {
        mode: {
            c: {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "draft_per_row_step": statistics.median(r["draft_per_row_step"] for r in rs),
                "tokens_per_row_step": statistics.median(r["tokens_per_row_step"] for r in rs),
                "runs": rs,
            }
            for c, rs in by_c.items()
        }
        for mode, by_c in runs.items()
    }
    print(f"\ntokens/s (median of {args.repeats}), speedup over plain, draft tokens per row and step")
    print(f"{'clients':>8}" + "".join(f"{m:>26}" for m in modes))
    for c in clients:
        base = table["plain"][c]["tokens_per_s"]
        cells = []
        for m in modes:
            t = table[m][c]
            cells.append(f"{t['tokens_per_s']:7.1f} {t['tokens_per_s'] / base:5.2f}x d{t['draft_per_row_step']:4.2f}")
        print(f"{c:>8}" + "".join(f"{x:>26}" for x in cells))
    print("answers equal to alone: " + ", ".join(f"{m} {s[0]}/{s[1]}" for m, s in same.items()))

    result = {
        "benchmark": "batching",
        **envelope("onnxruntime"),
        "engine": gen.backend.description,
        "settings": {
            "draft": args.draft,
            "quantize": args.quantize,
            "split": args.split,
            "fixed_n": args.fixed_n,
            "clients": clients,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "classes": list(CLASSES),
            "prompts": len(prompts),
        },
        "same_as_alone": {m: f"{s[0]}/{s[1]}" for m, s in same.items()},
        "modes": {m: {str(c): v for c, v in by_c.items()} for m, by_c in table.items()},
    }
    path = write_result_json(result, args.out, "batching")
    print(f"wrote {path}")
    plot = plot_crossover(table, clients, args.out / f"batching-{datetime.date.today().isoformat()}.png")
    if plot:
        print(f"wrote {plot}")


def plot_crossover(table: dict, clients: list[int], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, by_c in table.items():
        ax.plot(clients, [by_c[c]["tokens_per_s"] for c in clients], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xticks(clients, [str(c) for c in clients])
    ax.set_xlabel("concurrent clients (= batch slots)")
    ax.set_ylabel("generated tokens / s (whole engine)")
    ax.set_title("Continuous batching on this CPU: plain vs speculation")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
