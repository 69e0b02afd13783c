"""A load test of `specrt serve` with the official `openai` client driven concurrently.

    python bench/bench_load.py [--artifacts artifacts/SmolLM2-135M-Instruct] [--draft suffix]
                               [--rates 0.25,0.5,1] [--minutes 5] [--disconnect 0.1]
                               [--max-batch 8] [--serve-args '--ray --replicas 2'] [--name load]

Starts a server (a subprocess on a free port), answers every request of the mix once alone
(greedy: the reference answers), then offers load for
`--minutes` in total, split over the arrival rates (Poisson arrivals, requests per second). The
mix (`--mix`): `plain`, the benchmark prompts of the classes chat, code editing and JSON;
`structured`, the extraction tasks of bench/structured_tasks.jsonl under their JSON schema
(`response_format`); `rag`, questions about one shared ~500-token document in the system
message (what the prefix cache serves). Each request picks one of them at random, streams or
not (half each), and with probability
`--disconnect` is a client that leaves: a streamed one closes its stream after its first chunks,
a plain one gives up after a short timeout. Per rate it reports throughput (completion tokens/s
of the finished requests), time to first token p50/p99 (streamed requests: the first content
chunk), inter-token latency p50/p99 (gaps between streamed chunks: a chunk is one engine step's
text, so with speculation a gap may carry several tokens), the outcomes (ok,
503 busy, disconnected, errors) and the correctness check: every finished greedy answer must be
its prompt's answer alone (no lost, duplicated or mixed tokens between requests). Prints a table
and writes JSON (date, versions, machine) to bench/results/.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from harness import bench_arguments, envelope, running_server

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CLASSES = ("chat", "code_edit", "json")
TASKS = ROOT / "bench" / "structured_tasks.jsonl"
QUESTIONS = ["What does the step graph serve?", "Which engines are built?", "How is the KV cache kept?"]


def make_jobs(mix: list[str], prompts_file: Path) -> list[dict]:
    """The requests of the mix, each {key, messages[, response_format]}."""
    from specrt.benchmark import load_prompts

    jobs = []
    if "plain" in mix:
        for p in load_prompts(prompts_file):
            if p["class"] in CLASSES:
                jobs.append({"messages": [{"role": "user", "content": p["prompt"]}]})
    if "structured" in mix:
        for line in TASKS.read_text().splitlines():
            t = json.loads(line)
            fmt = {"type": "json_schema", "json_schema": {"name": t["name"], "schema": t["schema"]}}
            jobs.append({"messages": [{"role": "user", "content": t["prompt"]}], "response_format": fmt})
    if "rag" in mix:
        doc = "Answer from this document.\n\n" + (ROOT / "docs" / "architecture.md").read_text()[:2400]
        for q in QUESTIONS:
            jobs.append({"messages": [{"role": "system", "content": doc}, {"role": "user", "content": q}]})
    for i, j in enumerate(jobs):
        j["key"] = i
    return jobs


def pct(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def one_request(client, job: dict, max_tokens: int, stream: bool, leave: bool) -> dict:
    """One client: its outcome, text, time to first token and inter-token gaps."""
    import openai

    t0 = time.perf_counter()
    messages = job["messages"]
    extra = {"response_format": job["response_format"]} if "response_format" in job else {}
    rec = {"stream": stream, "leave": leave, "key": job["key"], "kind": _kind(job)}
    try:
        if stream:
            resp = await client.chat.completions.create(
                model="specrt",
                messages=messages,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                **extra,
            )
            text, last, chunks = "", None, 0
            gaps = []
            async for chunk in resp:
                if chunk.usage is not None:
                    rec["tokens"] = chunk.usage.completion_tokens
                if not chunk.choices or not chunk.choices[0].delta.content:
                    continue
                now = time.perf_counter()
                if last is None:
                    rec["ttft"] = now - t0
                else:
                    gaps.append(now - last)
                last = now
                text += chunk.choices[0].delta.content
                chunks += 1
                if leave and chunks >= 3:
                    await resp.close()
                    rec["outcome"] = "disconnected"
                    return rec
            rec.update(outcome="ok", text=text, gaps=gaps)
        else:
            timeout = 0.5 if leave else None
            resp = await client.chat.completions.create(
                model="specrt", messages=messages, max_tokens=max_tokens, temperature=0, timeout=timeout, **extra
            )
            rec.update(outcome="ok", text=resp.choices[0].message.content, tokens=resp.usage.completion_tokens)
    except openai.APITimeoutError:
        rec["outcome"] = "disconnected"
    except openai.APIStatusError as e:
        rec["outcome"] = "busy" if e.status_code == 503 else f"http {e.status_code}"
    except openai.APIConnectionError as e:
        rec["outcome"] = f"connection error: {e}"
    rec["seconds"] = time.perf_counter() - t0
    return rec


def _kind(job: dict) -> str:
    return "structured" if "response_format" in job else "rag" if job["messages"][0]["role"] == "system" else "plain"


async def offer_load(base_url: str, prompts: list[dict], rate: float, seconds: float, args, rng) -> list[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    tasks, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        prompt = rng.choice(prompts)
        stream = rng.random() < 0.5
        leave = rng.random() < args.disconnect
        tasks.append(asyncio.create_task(one_request(client, prompt, args.max_tokens, stream, leave)))
        await asyncio.sleep(rng.expovariate(rate))
    out = await asyncio.gather(*tasks)
    await client.close()
    return out


def main():
    ap = bench_arguments(__doc__, prompts=True)
    ap.add_argument("--draft", default="none")
    ap.add_argument("--rates", default="0.25,0.5,1")
    ap.add_argument("--minutes", type=float, default=5.0, help="total load time, split over the rates")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-queue", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=8, help="the server's continuous batch (1: one at a time)")
    ap.add_argument("--serve-args", default="", help="more `specrt serve` options, e.g. '--ray --replicas 2'")
    ap.add_argument("--disconnect", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="load", help="the result file's name: NAME-DATE.json")
    ap.add_argument("--mix", default="plain,structured,rag", help="request kinds: plain, structured, rag")
    args = ap.parse_args()

    from specrt.benchmark import write_result_json

    prompts = make_jobs(args.mix.split(","), args.prompts)
    rates = [float(r) for r in args.rates.split(",")]
    import tempfile

    log = Path(tempfile.mkdtemp(prefix="specrt-load-")) / "server.log"
    options = ["--served-model-name", "specrt", "--max-queue", str(args.max_queue), "--max-batch", str(args.max_batch)]
    options += (["--draft", args.draft] if args.draft != "none" else []) + args.serve_args.split()
    with running_server(args.artifacts, options, log, wait_s=300) as root:
        base = f"{root}/v1"
        # the reference: every prompt alone (greedy), non-streamed
        alone = {}
        for p in prompts:
            rec = asyncio.run(offer_alone(base, p, args.max_tokens))
            alone[p["key"]] = rec["text"]
        rng = random.Random(args.seed)
        results = {}
        for rate in rates:
            t0 = time.perf_counter()
            recs = asyncio.run(offer_load(base, prompts, rate, 60 * args.minutes / len(rates), args, rng))
            wall = time.perf_counter() - t0
            results[rate] = summarise(recs, alone, wall)
            print(f"rate {rate}/s: {json.dumps(results[rate])}", flush=True)
    print(f"\n{'rate/s':>7}{'reqs':>6}{'ok':>5}{'busy':>6}{'left':>6}{'err':>5}{'tok/s':>8}"
          f"{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}{'= alone':>9}")  # fmt: skip
    for rate, r in results.items():
        ms = lambda v: f"{v * 1e3:.0f}ms" if v is not None else "-"  # noqa: E731
        print(
            f"{rate:>7}{r['requests']:>6}{r['ok']:>5}{r['busy']:>6}{r['disconnected']:>6}{r['errors']:>5}"
            f"{r['tokens_per_s']:>8.1f}{ms(r['ttft_p50']):>10}{ms(r['ttft_p99']):>8}{ms(r['itl_p50']):>9}"
            f"{ms(r['itl_p99']):>8}{r['same_as_alone']:>9}"
        )
    result = {
        "benchmark": "load",
        **envelope("onnxruntime", "openai", "fastapi", "uvicorn"),
        "server": {
            "artifacts": str(args.artifacts),
            "draft": args.draft,
            "max_queue": args.max_queue,
            "max_batch": args.max_batch,
            "serve_args": args.serve_args,
        },
        "load": {
            "minutes": args.minutes,
            "max_tokens": args.max_tokens,
            "disconnect": args.disconnect,
            "classes": list(CLASSES),
            "mix": args.mix,
            "prompts": len(prompts),
            "seed": args.seed,
        },  # fmt: skip
        "rates": {str(k): v for k, v in results.items()},
    }
    print(f"wrote {write_result_json(result, args.out, args.name)}")


async def offer_alone(base: str, prompt: dict, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    try:
        return await one_request(client, prompt, max_tokens, stream=False, leave=False)
    finally:
        await client.close()


def summarise(recs: list[dict], alone: dict, wall: float) -> dict:
    ok = [r for r in recs if r["outcome"] == "ok"]
    ttft = [r["ttft"] for r in ok if "ttft" in r]
    itl = [g for r in ok for g in r.get("gaps", [])]
    same = sum(r["text"] == alone[r["key"]] for r in ok)
    tokens = sum(r.get("tokens") or 0 for r in ok)  # usage: in the answer, or the stream's last chunk
    errors = [r["outcome"] for r in recs if r["outcome"] not in ("ok", "busy", "disconnected")]
    return {
        "requests": len(recs),
        "ok": len(ok),
        "busy": sum(r["outcome"] == "busy" for r in recs),
        "disconnected": sum(r["outcome"] == "disconnected" for r in recs),
        "errors": len(errors),
        "error_kinds": sorted(set(errors)),
        "tokens_per_s": tokens / wall,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(itl, 50),
        "itl_p99": pct(itl, 99),
        "itl_mean": statistics.mean(itl) if itl else None,
        "same_as_alone": f"{same}/{len(ok)}",
        "ok_by_kind": {k: sum(r["kind"] == k for r in ok) for k in ("plain", "structured", "rag")},
        "ttft_p50_by_kind": {
            k: pct([r["ttft"] for r in ok if r["kind"] == k and "ttft" in r], 50)
            for k in ("plain", "structured", "rag")
        },
        "valid_json": f"{sum(_parses(r['text']) for r in ok if r['kind'] == 'structured')}/"
        f"{sum(r['kind'] == 'structured' for r in ok)}",
        "seconds": wall,
    }


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except (json.JSONDecodeError, TypeError):
        return False


if __name__ == "__main__":
    main()
