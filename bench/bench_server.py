"""The server end to end: what the HTTP layer costs and whether speculation's speedup survives it.

    python bench/bench_server.py [--artifacts artifacts/SmolLM2-135M-Instruct] [--repeats 2]

Starts `specrt serve` (plain, then `--draft suffix`; a fresh server for every repeat, since the
suffix draft remembers earlier answers across requests) on a free local port and sends it the
prompt set (bench/prompts.jsonl; greedy, 128 tokens), once not streamed and once streamed.
Reports per server: time to first token (streamed), end-to-end tokens/s per request (client wall
time), the share of that wall time spent outside the engine (HTTP, JSON, tokenizer; from the
engine's own prefill + decode time in the `specrt` field), and whether the plain and speculative
servers returned the same text. Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from harness import bench_arguments, envelope, running_server

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main():
    ap = bench_arguments(__doc__, prompts=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import httpx

    from specrt.benchmark import load_prompts, write_result_json

    prompts = load_prompts(args.prompts)
    rows, texts = {}, {}
    for draft in ("none", "suffix"):
        r = {"ttft_ms": [], "tok_s": [], "overhead": [], "by_class": {}}
        for _ in range(args.repeats):
            # a fresh server per repeat: the suffix draft remembers earlier answers across
            # requests, so asking the same prompt again would measure that memory instead
            with running_server(args.artifacts, ["--draft", draft]) as base:
                url = f"{base}/v1/chat/completions"
                for i, p in enumerate(prompts):
                    req = {
                        "messages": [{"role": "user", "content": p["prompt"]}],
                        "max_tokens": args.tokens,
                        "temperature": 0,
                    }
                    t0 = time.perf_counter()
                    body = httpx.post(url, json=req, timeout=600).json()
                    wall = time.perf_counter() - t0
                    n = body["usage"]["completion_tokens"]
                    engine_s = body["specrt"]["prefill_ms"] / 1e3 + (
                        (n - 1) / body["specrt"]["decode_tokens_per_second"] if n > 1 else 0.0
                    )
                    r["tok_s"].append(n / wall)
                    r["by_class"].setdefault(p["class"], []).append(n / wall)
                    r["overhead"].append(max(0.0, wall - engine_s) / wall)
                    texts.setdefault(draft, {})[i] = body["choices"][0]["message"]["content"]
                    t0 = time.perf_counter()
                    with httpx.stream("POST", url, json={**req, "stream": True}, timeout=600) as resp:
                        lines = resp.iter_lines()
                        for line in lines:
                            if line.startswith("data: ") and '"content"' in line:
                                r["ttft_ms"].append((time.perf_counter() - t0) * 1e3)
                                break
                        for _ in lines:  # read the stream to its end before the next request
                            pass
        rows[draft] = {
            "ttft_ms": round(statistics.median(r["ttft_ms"]), 1),
            "tokens_per_second": round(statistics.median(r["tok_s"]), 1),
            "outside_engine_share": round(statistics.median(r["overhead"]), 4),
            "tokens_per_second_by_class": {c: round(statistics.median(v), 1) for c, v in r["by_class"].items()},
        }
        print(f"{draft}: done", file=sys.stderr, flush=True)
    same = sum(texts["none"][i] == texts["suffix"][i] for i in texts["none"])
    classes = list(rows["none"]["tokens_per_second_by_class"])
    print(f"\n{'server':<16}{'TTFT ms':>9}{'tok/s':>8}{'outside engine':>16}" + "".join(f"{c:>15}" for c in classes))
    for draft, row in rows.items():
        print(
            f"{'plain' if draft == 'none' else 'suffix draft':<16}{row['ttft_ms']:>9}{row['tokens_per_second']:>8}{row['outside_engine_share']:>15.1%}"  # noqa: E501 (a table row)
            + "".join(f"{row['tokens_per_second_by_class'][c]:>15}" for c in classes)
        )
    print(f"speculative answers equal to plain: {same}/{len(texts['none'])}")
    result = {
        "benchmark": "server",
        **envelope("onnxruntime", "fastapi", "uvicorn", "httpx"),
        "max_tokens": args.tokens,
        "repeats": args.repeats,
        "servers": rows,
        "speculative_equals_plain": f"{same}/{len(texts['none'])}",
    }
    print(f"wrote {write_result_json(result, args.out, 'server')}")


if __name__ == "__main__":
    main()
