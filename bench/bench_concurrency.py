"""Serving N clients at once beside llama.cpp's `llama-server` with N parallel slots.

    python bench/bench_concurrency.py --artifacts artifacts/qwen2.5-coder-1.5b --model models/qwen2.5-coder-1.5b \\
        --quantize gguf-a8 --llama-server PATH/llama-server --prompts bench/prompts_real.jsonl [--clients 4,8]

For each client count N, each server in turn (specrt serve with `--max-batch N`, plain and
`--draft auto`; llama-server with `-np N` and N times the context) gets N closed-loop clients:
each sends its prompts (the prompt file's chat messages, dealt round robin, `--rounds` each)
one after another over the OpenAI chat API, streamed, greedy, `--max-tokens` new tokens. A
fresh server per N and per system (llama-server's n-gram cache and specrt's suffix draft would
otherwise remember earlier answers). Reported: aggregate output tokens/s (all clients' tokens
over the wall time of the whole load), time per output token of each request (after its first
token: (last - first) / (tokens - 1)) at p50 and p99, time to first token p50 and p99, and each
server's peak resident memory (VmHWM). Prints a table, writes JSON to bench/results/.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from bench_load import one_request, pct

from harness import ROOT, bench_arguments, envelope, running_server

sys.path.insert(0, str(ROOT))


def jobs_from(prompts: Path) -> list[dict]:
    """The prompt file's rows as chat requests: their `messages`, or their prompt as one user turn."""
    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    out = []
    for i, r in enumerate(rows):
        messages = r.get("messages") or [{"role": "user", "content": r["prompt"]}]
        out.append({"messages": messages, "key": i, "class": r.get("class", "")})
    return out


async def closed_loop(base_url: str, jobs: list[dict], clients: int, rounds: int, max_tokens: int) -> tuple:
    """`clients` clients, each sending its share of the jobs one after another; (records, wall s)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=900)

    async def one_client(c: int) -> list[dict]:
        mine = [jobs[(c + clients * k) % len(jobs)] for k in range(rounds)]
        return [await one_request(client, job, max_tokens, stream=True, leave=False) for job in mine]

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one_client(c) for c in range(clients)))
    wall = time.perf_counter() - t0
    await client.close()
    return [r for g in got for r in g], wall


def summary(records: list[dict], wall: float) -> dict:
    ok = [r for r in records if r.get("outcome") == "ok"]
    tokens = sum(r.get("tokens", 0) for r in ok)
    tpot = [sum(r["gaps"]) / (r["tokens"] - 1) for r in ok if r.get("gaps") and r.get("tokens", 0) > 1]
    ttft = [r["ttft"] for r in ok if "ttft" in r]
    ms = lambda v: None if v is None else round(v * 1e3, 1)  # noqa: E731 (a one-line unit)
    return {
        "requests": len(records),
        "ok": len(ok),
        "output_tokens": tokens,
        "failed": sorted({r.get("outcome", "?") for r in records} - {"ok"}),
        "wall_s": round(wall, 1),
        "tokens_per_s": round(tokens / wall, 2),
        "tpot_ms_p50": ms(pct(tpot, 50)),
        "tpot_ms_p99": ms(pct(tpot, 99)),
        "ttft_ms_p50": ms(pct(ttft, 50)),
        "ttft_ms_p99": ms(pct(ttft, 99)),
    }


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def server_pid(port_url: str) -> int:
    """The `specrt serve` process on the URL's port (running_server yields only its URL)."""
    port = port_url.rsplit(":", 1)[1]
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")  # ends with b"": --port has a successor
        except OSError:  # gone, or not a process
            continue
        if proc.name.isdigit() and b"serve" in args and b"--port" in args:
            if args[args.index(b"--port") + 1] == port.encode():
                return int(proc.name)
    raise SystemExit(f"no specrt serve process on port {port}")


def main():
    ap = bench_arguments(__doc__, model=True, prompts=True)
    ap.add_argument("--quantize", default="gguf-a8")
    ap.add_argument("--llama-server", type=Path, default=None, help="llama-server binary (the peer; optional)")
    ap.add_argument("--clients", default="4,8")
    ap.add_argument("--rounds", type=int, default=2, help="requests each client sends, one after another")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--drafts", default="none,auto", help="specrt servers to run: their --draft")
    ap.add_argument("--name", default="concurrency", help="the result file's name: NAME-DATE.json")
    args = ap.parse_args()

    from specrt.benchmark import write_result_json
    from specrt.export.gguf import gguf_origin

    jobs = jobs_from(args.prompts)
    counts = [int(x) for x in args.clients.split(",")]
    results: dict[str, dict] = {}
    log_dir = Path(tempfile.mkdtemp(prefix="specrt-concurrency-"))
    for n in counts:
        for draft in args.drafts.split(","):
            name = f"specrt {args.quantize} " + ("plain" if draft == "none" else f"--draft {draft}")
            options = ["--quantize", args.quantize, "--max-batch", str(n), "--max-queue", str(2 * n), "--draft", draft]
            options += ["--max-tokens", str(args.max_tokens), "--served-model-name", "specrt"]
            print(f"{n} clients: {name}", file=sys.stderr)
            with running_server(args.artifacts, options, log_dir / f"specrt-{draft}-{n}.log", wait_s=600) as base:
                pid = server_pid(base)
                records, wall = asyncio.run(closed_loop(f"{base}/v1", jobs, n, args.rounds, args.max_tokens))
                results.setdefault(name, {})[n] = {**summary(records, wall), "peak_rss_mib": peak_rss_mib(pid)}
        if args.llama_server:
            from llamacpp_peer import LlamaServer

            gguf = gguf_origin(args.model)
            if gguf is None:
                ap.error(f"--llama-server: {args.model} was not converted from a GGUF; the peer needs the same file")
            print(f"{n} clients: llama-server", file=sys.stderr)
            with LlamaServer(args.llama_server, gguf, ctx=n * 4096, parallel=n) as peer:
                base = f"http://127.0.0.1:{peer.port}/v1"
                records, wall = asyncio.run(closed_loop(base, jobs, n, args.rounds, args.max_tokens))
                results.setdefault("llama-server plain", {})[n] = {
                    **summary(records, wall),
                    "peak_rss_mib": peak_rss_mib(peer.proc.pid),
                }

    print(
        f"\n{'system':34}{'clients':>8}{'tok/s':>8}{'TPOT p50':>10}{'p99':>8}{'TTFT p50':>10}{'p99':>8}{'RSS MiB':>9}"
    )
    for name, by_n in results.items():
        for n, r in by_n.items():
            print(
                f"{name:34}{n:>8}{r['tokens_per_s']:>8.1f}{r['tpot_ms_p50']!s:>10}{r['tpot_ms_p99']!s:>8}"
                f"{r['ttft_ms_p50']!s:>10}{r['ttft_ms_p99']!s:>8}{r['peak_rss_mib']:>9}"
                + ("" if r["ok"] == r["requests"] else f"  ({r['requests'] - r['ok']} failed)")
            )
    result = {
        **envelope("onnxruntime", "numpy", threads="ORT default (one per physical core); llama-server -t 2"),
        "settings": {
            "artifacts": str(args.artifacts),
            "engine": args.quantize,
            "prompts": str(args.prompts),
            "clients": counts,
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
            "greedy": True,
            "streamed": True,
        },
        "results": {name: {str(n): r for n, r in by_n.items()} for name, by_n in results.items()},
    }
    print(f"wrote {write_result_json(result, args.out, args.name)}")


if __name__ == "__main__":
    main()
