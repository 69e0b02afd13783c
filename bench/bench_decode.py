"""Batch-1 greedy decode: specrt's ORT engine vs transformers eager, side by side in one run.

For each repeat and prompt, both generate the same number of tokens (EOS ignored) from the same
chat-formatted prompt; per-step latency and decode tokens/s are the medians over repeats. Beside
them: the memory-bandwidth bound (weight bytes read per decode step / measured read bandwidth).
Writes a table to stdout and JSON to bench/results/.

    .venv/bin/python bench/bench_decode.py --model models/SmolLM2-135M-Instruct \
        --artifacts artifacts/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import time

import torch

from specrt.artifacts import package_versions
from specrt.benchmark import write_result_json
from specrt.engines.ort import OrtOptions
from specrt.layout import ArtifactLayout
from specrt.runtime.generator import Generator

PROMPTS = [
    "What is speculative decoding? Explain it in a few sentences.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for writing clear technical documentation.",
    "Summarize the plot of Romeo and Juliet.",
]


def cpu_description() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return platform.processor() or "unknown"


def read_bandwidth_gbs(threads: int, size_mb: int = 1024, repeats: int = 7) -> float:
    """Memory read bandwidth: sum over a buffer far larger than the caches, median of repeats."""
    torch.set_num_threads(threads)
    x = torch.ones(size_mb * (1 << 20) // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


def decode_weight_bytes(cfg) -> int:
    """Bytes of weights a decode step reads: every matrix and norm, the lm_head (the embedding when
    tied) in full; the embedding lookup reads one row, counted as nothing."""
    C, I, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size  # noqa: E741 (the paper's names)
    attn = C * cfg.num_attention_heads * cfg.head_dim * 2 + C * cfg.num_key_value_heads * cfg.head_dim * 2
    per_layer = attn + 3 * C * I + 2 * C
    return 4 * (L * per_layer + C + V * C)


def hf_greedy(model, ids: list[int], n: int):
    """transformers eager: prefill, then one forward per token with its KV cache; (tokens, step s)."""
    steps = []
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
        tokens = [tok]
        for _ in range(n - 1):
            t = time.perf_counter()
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
            steps.append(time.perf_counter() - t)
            tokens.append(tok)
    return tokens, steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--artifacts", default="artifacts/SmolLM2-135M-Instruct")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    gen = Generator.from_engine(
        ArtifactLayout(args.artifacts).ort_engine(), args.model, options=OrtOptions(intra_op_threads=args.threads)
    )
    gen.eos_ids = frozenset()  # same token count on both sides
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager").eval()

    rows = {name: {"step_ms": [], "tok_s": [], "cpu_per_wall": []} for name in ("specrt-ort", "transformers-eager")}
    match = []
    for r in range(args.repeats):
        for p in PROMPTS:
            ids = gen.encode_prompt(p)
            c0, w0 = time.process_time(), time.perf_counter()
            res = gen.generate_ids([ids], args.new_tokens)[0]
            c1, w1 = time.process_time(), time.perf_counter()
            hf_tokens, hf_steps = hf_greedy(hf, ids, args.new_tokens)
            c2, w2 = time.process_time(), time.perf_counter()
            match.append(hf_tokens == res.token_ids)
            for name, steps, cpu, wall in (
                ("specrt-ort", res.step_seconds, c1 - c0, w1 - w0),
                ("transformers-eager", hf_steps, c2 - c1, w2 - w1),
            ):
                rows[name]["step_ms"].append(statistics.median(steps) * 1e3)
                rows[name]["tok_s"].append(len(steps) / sum(steps))
                rows[name]["cpu_per_wall"].append(cpu / wall)
            print(
                f"repeat {r + 1}/{args.repeats} prompt {PROMPTS.index(p) + 1}: specrt "
                f"{rows['specrt-ort']['tok_s'][-1]:.1f} tok/s, "
                f"transformers {rows['transformers-eager']['tok_s'][-1]:.1f} tok/s, same tokens: {match[-1]}",
                flush=True,
            )

    bw = read_bandwidth_gbs(args.threads)
    wbytes = decode_weight_bytes(gen.config)
    bound = bw * 1e9 / wbytes
    summary = {name: {k: statistics.median(v) for k, v in d.items()} for name, d in rows.items()}
    speedup = summary["specrt-ort"]["tok_s"] / summary["transformers-eager"]["tok_s"]

    print()
    print(f"{'backend':<22}{'step ms (median)':>18}{'decode tok/s':>15}{'of bound':>10}{'cpu/wall':>10}")
    for name, s in summary.items():
        print(
            f"{name:<22}{s['step_ms']:>18.1f}{s['tok_s']:>15.1f}{s['tok_s'] / bound:>10.0%}{s['cpu_per_wall']:>10.2f}"
        )
    print(f"{'bandwidth bound':<22}{1e3 / bound:>18.1f}{bound:>15.1f}{'':>10}")
    print(f"\nspecrt / transformers eager: {speedup:.2f}x; greedy tokens identical in {sum(match)}/{len(match)} runs")
    print(f"weights read per step {wbytes / 2**20:.0f} MiB, read bandwidth {bw:.1f} GB/s ({args.threads} threads)")

    result = {
        "benchmark": "decode-batch1-greedy",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_description(),
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "platform": platform.platform(),
        },
        "versions": package_versions("torch", "onnxruntime", "transformers", "numpy"),
        "model": args.model,
        "backend": gen.backend.description,
        "settings": {"new_tokens": args.new_tokens, "repeats": args.repeats, "prompts": PROMPTS, "ort_spinning": False},
        "results": summary,
        "speedup_vs_transformers_eager": speedup,
        "greedy_tokens_identical": f"{sum(match)}/{len(match)}",
        "bandwidth_gbs": bw,
        "weight_bytes_per_step": wbytes,
        "bandwidth_bound_tok_s": bound,
        "raw": rows,
    }
    print(f"wrote {write_result_json(result, args.out, 'decode')}")


if __name__ == "__main__":
    main()
