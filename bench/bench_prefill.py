"""Prefill beside llama.cpp's `llama-server`: how fast each reads a prompt of the same token ids.

    python bench/bench_prefill.py --model models/qwen2.5-coder-1.5b \\
        --artifacts artifacts/qwen2.5-coder-1.5b --quantize gguf-a8 \\
        --llama-server PATH/llama-server [--lengths 128,512,1024] [--repeats 3]

The prompt is real text: the package's own Python source, tokenized by the model's tokenizer and
cut to each length (the same ids for both). specrt prefills through its step session, in chunks
of its `prefill_chunk` (the engine's largest profile, 512 at most), as a generation does;
llama-server gets the ids with prompt caching off and one token to predict, and its own
`timings.prompt_ms` is the figure (HTTP costs it nothing). The two are measured alternately,
`--repeats` times per length; the table gives the median prompt tokens/s of each and their
ratio. Writes JSON (date, versions, machine) to bench/results/.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from harness import bench_arguments, envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def source_text() -> str:
    """Text on disk that every clone has: specrt's own modules, in a fixed order."""
    return "\n\n".join(p.read_text() for p in sorted((ROOT / "specrt").rglob("*.py")))


def specrt_prefill(gen, ids: list[int]) -> float:
    """Prompt tokens/s of one prefill on a fresh cache."""
    cache = gen.session.new_cache(1, len(ids) + 1)
    t0 = time.perf_counter()
    gen.session.prefill(cache, [ids])
    return len(ids) / (time.perf_counter() - t0)


def main():
    ap = bench_arguments(__doc__, artifacts=True, model=True)
    ap.add_argument("--quantize", default="gguf-a8", help="which ORT engine of the artifacts")
    ap.add_argument("--llama-server", type=Path, default=None, help="llama-server binary (the peer; optional)")
    ap.add_argument("--lengths", default="128,512,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="prefill", help="the result file's name: NAME-DATE.json")
    args = ap.parse_args()

    from specrt.benchmark import write_result_json
    from specrt.layout import ArtifactLayout
    from specrt.runtime.generator import Generator

    lengths = [int(x) for x in args.lengths.split(",")]
    gen = Generator.from_engine(ArtifactLayout(args.artifacts).ort_engine("cpu", args.quantize), args.model)
    ids = gen.tokenizer.encode(source_text())
    if len(ids) < max(lengths):
        ap.error(f"--lengths: the source text gives {len(ids)} tokens, fewer than {max(lengths)}")
    systems = {f"specrt {args.quantize}": lambda p: specrt_prefill(gen, p)}
    peer = None
    if args.llama_server:
        from llamacpp_peer import LlamaServer

        from specrt.export.gguf import gguf_origin

        gguf = gguf_origin(args.model)
        if gguf is None:
            ap.error(f"--llama-server: {args.model} was not converted from a GGUF; the peer needs the same file")
        peer = LlamaServer(args.llama_server, gguf, ctx=max(lengths) + 64).__enter__()
        systems["llama-server"] = lambda p: len(p) / (peer.complete(p, 1)["prompt_ms"] / 1e3)
    try:
        specrt_prefill(gen, ids[:64])  # first-call costs (thread pools, allocations) out of the figures
        if peer:
            peer.complete(ids[:64], 1)
        got = {name: {n: [] for n in lengths} for name in systems}
        for rep in range(args.repeats):
            print(f"repeat {rep + 1}/{args.repeats}", file=sys.stderr)
            for n in lengths:
                order = list(systems) if rep % 2 == 0 else list(reversed(systems))
                for name in order:
                    got[name][n].append(systems[name](ids[:n]))
    finally:
        if peer:
            peer.__exit__(None, None, None)

    med = {name: {n: round(statistics.median(v), 1) for n, v in by.items()} for name, by in got.items()}
    names = list(systems)
    print(f"\n{'prompt tokens':>14}" + "".join(f"{n:>22}" for n in names) + ("  ratio" if len(names) > 1 else ""))
    for n in lengths:
        row = f"{n:>14}" + "".join(f"{med[name][n]:>18.1f} t/s" for name in names)
        if len(names) > 1:
            row += f"  {med[names[0]][n] / med[names[1]][n]:5.2f}x"
        print(row)
    result = {
        **envelope("onnxruntime", "numpy", threads="ORT default (one per physical core); llama-server -t 2"),
        "settings": {
            "model": str(args.model),
            "engine": args.quantize,
            "lengths": lengths,
            "repeats": args.repeats,
            "prefill_chunk": gen.session.prefill_chunk,
            "text": "specrt/**/*.py, tokenized",
        },
        "prompt_tok_s": med,
        "runs": got,
    }
    if peer:
        result["anchor_llama_server"] = {"binary": str(args.llama_server), "cmd": peer.cmd}
    print(f"wrote {write_result_json(result, args.out, args.name)}")


if __name__ == "__main__":
    main()
