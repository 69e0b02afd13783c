"""What a draft of N tokens costs each head: its proposal's time and head calls, N = 1..K.

    python bench/bench_head_calls.py --heads drafts/SmolLM2-135M-Instruct [--repeats 40]

For each head directory found (eagle3: a catch-up call and one call per further token;
peagle: one call for up to K tokens; medusa: one call), the same steps are replayed: the
target's features of a real prompt + answer, one committed position per step (as after a
rejected draft), the head proposing N tokens for one row. The median over the repeats, in
one process, interleaved by step, beside the target's own decode step on the same engine.
Writes bench/results/head-calls-DATE.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from specrt.artifacts import cpu_model, package_versions
from specrt.runtime.drafts import make_proposer
from specrt.runtime.drafts.base import DraftInput
from specrt.runtime.generator import Generator
from specrt.runtime.sampling import SamplingParams

HEADS = ("eagle3", "peagle", "medusa")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", type=Path, default=Path("artifacts/SmolLM2-135M-Instruct"))
    ap.add_argument("--heads", type=Path, required=True, help="a `make drafts` directory")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--max-n", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    a = ap.parse_args()

    gen = Generator.from_engine(a.artifacts / "engines" / "ort-cpu")
    tok = gen.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    tokens = prompt + gen.generate_ids([prompt], a.repeats + 8)[0].token_ids
    cache = gen.session.new_cache(1, len(tokens) + 8)
    feats = gen.session.prefill(cache, [tokens], hidden=True).hidden[0]
    decode = []
    for _ in range(a.repeats):  # the target's decode step, for scale
        c = gen.session.new_cache(1, len(prompt) + 2)
        gen.session.prefill(c, [prompt[:-1]])
        t0 = time.perf_counter()
        gen.session.forward(c, [[prompt[-1]]], last_only=True)
        decode.append(time.perf_counter() - t0)
        gen.session.release(c)

    heads = {}
    for name in HEADS:
        d = a.heads / name
        if not (d / "engines").is_dir():
            print(f"skipped {name}: no engine under {d}")
            continue
        heads[name] = make_proposer(name, draft_dir=d, target=gen.session.caps)
    rows = {name: {n: [] for n in range(1, a.max_n + 1)} for name in heads}
    calls = {name: {n: [] for n in range(1, a.max_n + 1)} for name in heads}
    for name, prop in heads.items():
        for n in range(1, a.max_n + 1):
            p0 = len(prompt)
            prop.begin([0], [tokens[:p0]], None)
            done = 0  # committed positions the head has seen
            for i in range(a.repeats + 1):
                committed = p0 - 1 + i  # one position more each step (a rejected draft's bonus)
                inp = DraftInput([0], [tokens[: committed + 1]], n, [999], SamplingParams(), [np.random.default_rng(0)])
                inp.features = [feats[done:committed]]
                before = getattr(prop, "calls", 0)
                t0 = time.perf_counter()
                prop.propose(inp)
                dt = time.perf_counter() - t0
                if i:  # the first proposal catches up on the whole prompt
                    rows[name][n].append(dt)
                    calls[name][n].append(prop.calls - before)
                done = committed
            prop.end([0], [[]])
    step_ms = 1e3 * statistics.median(decode)
    result = {
        "benchmark": "head-calls",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": cpu_model()},
        "versions": package_versions("onnxruntime", "numpy"),
        "decode_step_ms": round(step_ms, 3),
        "heads": {
            name: {
                str(n): {
                    "ms": round(1e3 * statistics.median(ts), 3),
                    "share_of_decode": round(1e3 * statistics.median(ts) / step_ms, 3),
                    "calls": statistics.median(calls[name][n]) if calls[name][n] else None,
                }
                for n, ts in per.items()
            }
            for name, per in rows.items()
        },
    }
    print(f"target decode step: {step_ms:.2f} ms")
    print(f"{'head':<8}" + "".join(f"{f'N={n}':>22}" for n in range(1, a.max_n + 1)))
    for name, per in result["heads"].items():
        cells = "".join(f"{_cell(c):>22}" for c in per.values())
        print(f"{name:<8}{cells}")
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"head-calls-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def _cell(c: dict) -> str:
    return f"{c['ms']:.2f} ms {c['share_of_decode']:.2f}x {c['calls']:g}c"


if __name__ == "__main__":
    main()
