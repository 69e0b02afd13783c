"""Two versions of specrt side by side: is a refactoring slower? Alternating runs, medians.

    git worktree add /tmp/before <commit>
    python bench/bench_ab.py --before /tmp/before --after . [--artifacts artifacts/SmolLM2-135M-Instruct]
                             [--rounds 4] [--workloads default,serve,tiny] [--quantize gguf-k]
                             [--before-artifacts DIR]   (the before version's own engine: a graph change)

Each version runs in its own subprocess (PYTHONPATH points at its tree), in alternating order,
`--rounds` times, on two workloads:
    default   the default model's ORT engine, one prompt per class of bench/prompts.jsonl,
              128 greedy tokens: plain, ngram N=8, suffix N=auto (tokens/s, end to end); and
              what training-data generation runs, a static batch of 8 prompts, 64 tokens
              (tokens/s, and the batch's prefill in ms)
    serve     the serving engine: bench_batch.py's closed loop of 4 clients into a BatchEngine
              with 4 slots (chat, code editing and JSON prompts, 96 tokens): plain, suffix N=3,
              suffix N=auto (tokens/s of the whole engine, prefill included)
    tiny      a tiny random model (built here), a repetitive ragged batch of 2, 200 tokens: the
              target step takes ~0.3 ms, so the runtime's own per-step overhead dominates
              (ms per step); what it changes is the part a refactoring can change
    steps     the engine's step costs, 1..17 positions (ms; the build's measurement, each
              version's kernel library and graph session on the same graph): a kernel change
Prints a table (medians, after/before) and writes JSON to bench/results/.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import bench_arguments, envelope

ROOT = Path(__file__).resolve().parents[1]

WORKLOAD = r"""
import json, statistics, sys, time
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.speculative import SpeculativeDecoder, make_policy
engine, prompts_file, kind, bench_dir = sys.argv[1:5]
gen = None if kind == "steps" else Generator.from_engine(engine)  # steps: the graph alone
variants = [("plain", None), ("ngram 8", ("ngram", 8)), ("suffix auto", ("suffix", "auto"))]

def run(prompts, n, make):
    t = time.perf_counter()
    if make is None:
        r = gen.generate_ids(prompts, n)
    else:
        r = SpeculativeDecoder(gen, make_proposer(make[0]), make_policy(make[1])).generate_ids(prompts, n)
    return r, time.perf_counter() - t

out = {}
if kind == "default":
    seen = {}
    for line in open(prompts_file):
        p = json.loads(line)
        seen.setdefault(p["class"], p["prompt"])
    run([gen.encode_prompt("warm up")], 8, None)
    for cls, text in seen.items():
        ids = gen.encode_prompt(text)
        for name, make in variants:
            r, s = run([ids], 128, make)
            out[f"{cls} / {name} (tok/s)"] = len(r[0].token_ids) / s
    # what training-data generation runs: a static batch of 8 prompts, greedy
    batch = [gen.encode_prompt(json.loads(line)["prompt"]) for line in list(open(prompts_file))[:8]]
    r, s = run(batch, 64, None)
    out["batch of 8 / plain (tok/s)"] = sum(len(x.token_ids) for x in r) / s
    out["batch of 8 / prefill (ms)"] = r[0].prefill_seconds * 1e3
elif kind == "serve":  # bench_batch.py's closed loop, from the after tree
    sys.path.insert(0, bench_dir)
    from bench_batch import CLASSES, closed_loop
    from specrt.runtime.batching import BatchEngine
    lines = [json.loads(line) for line in open(prompts_file)]
    prompts = [gen.encode_prompt(p["prompt"]) for p in lines if p["class"] in CLASSES]
    for name, make in [("plain", None), ("suffix 3", ("suffix", 3)), ("suffix auto", ("suffix", "auto"))]:
        runner = gen if make is None else SpeculativeDecoder(gen, make_proposer(make[0]), make_policy(make[1]))
        r = closed_loop(BatchEngine(runner, max_batch=4), prompts, 4, 96)
        out[f"4 clients / {name} (tok/s)"] = r["tokens_per_s"]
elif kind == "steps":  # the engine's step graph under each version (its kernels, its ORT options)
    from pathlib import Path
    from specrt.engines.ort import OrtOptions, graph_session
    from specrt.engines.ort_measure import step_costs
    m = json.loads((Path(engine) / "manifest.json").read_text())  # as stored: no check of the build
    graph = (Path(engine) / m["graph_dir"] / "model.onnx").resolve()
    session, _ = graph_session(graph, OrtOptions(), "build the engine first")
    for q, ms in step_costs(session, m["config"], m["graph_flavour"]).items():
        out[f"step of {q} positions (ms)"] = ms
else:
    ids = [5, 9, 13, 5, 9, 13, 5, 9, 40, 41, 42] * 3
    for name, make in variants:
        per_step = []
        for _ in range(5):
            r, s = run([ids, ids[:20]], 200, make)
            per_step.append(s / (r[0].metrics.steps if r[0].metrics else len(r[0].token_ids)) * 1e3)
        out[f"tiny / {name} (ms/step)"] = statistics.median(per_step)
print(json.dumps(out))
"""


def tiny_engine(tmp: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from specrt.engines.build import BuildSpec, build_all
    from specrt.layout import ArtifactLayout

    from conftest import TINY_HF, random_model, save_checkpoint

    ckpt = save_checkpoint(random_model(TINY_HF), TINY_HF, tmp / "ckpt")
    list(build_all(BuildSpec(checkpoint=ckpt, out=tmp / "art", tensorrt="off")))
    return ArtifactLayout(tmp / "art").ort_engine()


def main():
    ap = bench_arguments(__doc__)
    ap.add_argument("--before", type=Path, required=True, help="source tree of the old version (a git worktree)")
    ap.add_argument("--after", type=Path, default=ROOT)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--workloads", default="default,serve,tiny", help="which of the workloads to run")
    ap.add_argument("--quantize", default="none", help="the engine's scheme (gguf-k: the kernel library's)")
    ap.add_argument("--before-artifacts", type=Path, help="the before version's artifacts (default: --artifacts)")
    args = ap.parse_args()

    from specrt.benchmark import write_result_json
    from specrt.layout import ArtifactLayout

    tmp = Path(tempfile.mkdtemp())
    script = tmp / "workload.py"
    script.write_text(WORKLOAD)
    # resolved: the workloads run in a temporary folder
    engines = {
        v: ArtifactLayout(a).ort_engine(scheme=args.quantize).resolve()
        for v, a in (("before", args.before_artifacts or args.artifacts), ("after", args.artifacts))
    }
    chosen = args.workloads.split(",")
    if unknown := set(chosen) - {"default", "serve", "tiny", "steps"}:
        raise SystemExit(f"unknown workload(s) {sorted(unknown)}: choose among default, serve, tiny, steps")
    tiny = tiny_engine(tmp) if "tiny" in chosen else None
    versions = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs = {v: [] for v in versions}
    for i in range(args.rounds):
        for v in list(versions)[:: 1 if i % 2 == 0 else -1]:  # alternate who goes first
            merged = {}
            for kind in chosen:
                engine = tiny if kind == "tiny" else engines[v]
                r = subprocess.run(
                    [
                        sys.executable,
                        str(script),
                        str(engine),
                        str(ROOT / "bench" / "prompts.jsonl"),
                        kind,
                        str(ROOT / "bench"),
                    ],
                    env=dict(os.environ, PYTHONPATH=str(versions[v])),
                    capture_output=True,
                    text=True,
                    cwd=tmp,
                )
                if r.returncode:
                    raise SystemExit(f"{v} failed:\n{r.stderr[-3000:]}")
                merged.update(json.loads(r.stdout.strip().splitlines()[-1]))
            runs[v].append(merged)
            print(f"round {i + 1}/{args.rounds}: {v} done", file=sys.stderr, flush=True)
    rows = {}
    print(f"{'workload / variant':<40}{'before':>9}{'after':>9}{'after/before':>14}")
    for key in runs["before"][0]:
        b, a = (statistics.median(r[key] for r in runs[v]) for v in ("before", "after"))
        rows[key] = {"before": round(b, 3), "after": round(a, 3), "ratio": round(a / b, 3)}
        print(f"{key:<40}{b:>9.2f}{a:>9.2f}{a / b:>14.3f}")
    result = {
        "benchmark": "ab",
        **envelope("onnxruntime", "numpy"),
        "before": str(versions["before"]),
        "after": str(versions["after"]),
        "engines": {v: str(e) for v, e in engines.items()},
        "rounds": args.rounds,
        "workloads": chosen,
        "rows": rows,
        "runs": runs,
    }
    print(f"wrote {write_result_json(result, args.out, 'ab')}")


if __name__ == "__main__":
    main()
