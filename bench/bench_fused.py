"""The fused step graph against the portable one, float32 and gguf, side by side in one run.

    .venv/bin/python bench/bench_fused.py --artifacts artifacts/SmolLM2-135M-Instruct \
        --model models/SmolLM2-135M-Instruct [--genai-python /path/to/venv/bin/python]

Engines: float32 and gguf (the GGUF's own 4-bit blocks) of each graph flavour; the fused ones
are `--artifacts`' (what build-engines builds), the portable ones are built into
`<artifacts>-portable` (build-engines --graph portable) when missing. Every measurement runs the
engines in turn, repeat after repeat, so machine noise hits them alike; medians are reported.

  nodes       nodes of each engine's graph after ONNX Runtime's optimizations (its saved graph)
  decode      plain greedy decoding, tokens/s, per prompt class of bench/prompts.jsonl (EOS ignored)
  steps       one step over Q = 1, 2, 4, 8, 16 positions after a past of 64, 512 and 1024 (ms)
  prefill     a 512-token prompt, tokens/s
  memory      resident memory the engine's load added, MiB
  drafts      suffix and n-gram, N = auto, tokens/s end to end, and whether the output equalled plain
  anchor      onnxruntime-genai's int4 graph of the same checkpoint (lossy: round-to-nearest int4,
              int8 activations), with --genai-python: a Python with onnxruntime-genai (its own
              virtualenv); its decode tokens/s beside the others, and where its greedy text departs

Table on stdout, JSON in bench/results/fused-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from specrt.benchmark import write_result_json
from specrt.engines.build import BuildSpec, build_all
from specrt.layout import ArtifactLayout
from specrt.runtime.generator import Generator

from harness import envelope

PASTS, POSITIONS = (64, 512, 1024), (1, 2, 4, 8, 16)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def opt_nodes(engine: Path) -> int:
    """The nodes of the graph the engine runs, as ORT optimizes it (written to a scratch file)."""
    import tempfile

    import onnx
    import onnxruntime as ort

    from specrt.engines.ort import engine_graph, read_engine_manifest

    graph_dir, name, optimized = engine_graph(engine, read_engine_manifest(engine, verify="none"))
    if optimized:
        return len(onnx.load(str(graph_dir / name), load_external_data=False).graph.node)
    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "opt.onnx.data")
        ort.InferenceSession(str(graph_dir / name), so, providers=["CPUExecutionProvider"])
        return len(onnx.load(str(Path(tmp) / "opt.onnx"), load_external_data=False).graph.node)


def step_ms(gen: Generator, past: int, q: int, repeats: int = 7) -> float:
    """Median time of one step over q new positions after `past` committed ones."""
    rng = np.random.default_rng(past)
    ids = rng.integers(100, gen.config.vocab_size - 1, past + q).tolist()
    cache = gen.session.new_cache(1, past + q + 1)
    gen.session.prefill(cache, [ids[:past]])
    base = cache.lengths.copy()
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        gen.session.forward(cache, [ids[past:]], last_only=q == 1)
        times.append(time.perf_counter() - t0)
        cache.rollback(base)
    gen.session.release(cache)
    return 1000 * statistics.median(times[1:])


def genai_runs(python: str, model_dir: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    job = json.dumps({"model": str(model_dir), "prompts": prompts, "new_tokens": new_tokens})
    worker = Path(__file__).with_name("genai_worker.py")
    r = subprocess.run([python, str(worker)], input=job, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"onnxruntime-genai worker failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def build_genai_model(python: str, checkpoint: Path, out: Path) -> Path:
    if not (out / "genai_config.json").is_file():
        cmd = [python, "-m", "onnxruntime_genai.models.builder", "-m", str(checkpoint), "-o", str(out)]
        subprocess.run([*cmd, "-p", "int4", "-e", "cpu"], check=True, capture_output=True, timeout=1800)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True, help="The checkpoint (its GGUF origin gives gguf).")
    ap.add_argument("--portable-artifacts", type=Path, default=None, help="Default: <artifacts>-portable.")
    ap.add_argument("--prompts", type=Path, default=Path(__file__).with_name("prompts.jsonl"))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--draft-prompts", type=int, default=1, help="Prompts per class for the drafts.")
    ap.add_argument("--genai-python", default=None, help="A Python with onnxruntime-genai: the anchor.")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    args = ap.parse_args()

    from specrt.runtime.drafts import make_proposer
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy

    portable_dir = args.portable_artifacts or args.artifacts.with_name(args.artifacts.name + "-portable")
    for out, graph in ((args.artifacts, "fused"), (portable_dir, "portable")):
        for line in build_all(BuildSpec(checkpoint=args.model, out=out, quantize="gguf", graph=graph, tensorrt="off")):
            print(line, file=sys.stderr)
    engines = {
        "fp32 portable": ArtifactLayout(portable_dir).ort_engine("cpu"),
        "fp32 fused": ArtifactLayout(args.artifacts).ort_engine("cpu"),
        "gguf portable": ArtifactLayout(portable_dir).ort_engine("cpu", "gguf"),
        "gguf fused": ArtifactLayout(args.artifacts).ort_engine("cpu", "gguf"),
    }
    gens, memory = {}, {}
    for name, engine in engines.items():
        before = rss_mib()
        gens[name] = Generator.from_engine(engine, args.model)
        gens[name].eos_ids = frozenset()  # every run generates new_tokens
        memory[name] = round(rss_mib() - before, 1)
    nodes = {name: opt_nodes(engine) for name, engine in engines.items()}
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    classes = sorted({r["class"] for r in rows})
    ref = next(iter(gens.values()))
    encoded = [(r["class"], ref.encode_prompt(r["prompt"])) for r in rows]
    drafted = [next(ids for c, ids in encoded if c == k) for k in classes for _ in range(args.draft_prompts)][
        : len(classes) * args.draft_prompts
    ]
    genai_dir = None
    if args.genai_python:
        genai_dir = build_genai_model(args.genai_python, args.model, args.artifacts.with_name("genai-int4-cpu"))

    decode = {n: {c: [] for c in classes} for n in [*gens, *(["onnxruntime-genai int4"] if genai_dir else [])]}
    steps = {n: {p: {q: [] for q in POSITIONS} for p in PASTS} for n in gens}
    prefill = {n: [] for n in gens}
    drafts = {n: {d: {"tok_s": [], "equal": 0, "runs": 0} for d in ("suffix", "ngram")} for n in gens}
    outputs, genai_out = {n: [] for n in gens}, None
    long_prompt = np.random.default_rng(7).integers(100, ref.config.vocab_size - 1, 512).tolist()
    for rep in range(args.repeats):
        print(f"repeat {rep + 1}/{args.repeats}", file=sys.stderr)
        for cls, ids in encoded:
            for name, g in gens.items():
                r = g.generate_ids([ids], args.new_tokens)[0]
                decode[name][cls].append(r.decode_tokens_per_second)
                if rep == 0:
                    outputs[name].append(r.token_ids)
        if genai_dir:
            got = genai_runs(args.genai_python, genai_dir, [ids for _, ids in encoded], args.new_tokens)
            for (cls, _), run in zip(encoded, got["runs"]):
                decode["onnxruntime-genai int4"][cls].append(run["decode_tok_s"])
            genai_out = genai_out or got
        for past in PASTS:
            for q in POSITIONS:
                for name, g in gens.items():
                    steps[name][past][q].append(step_ms(g, past, q))
        for name, g in gens.items():
            cache = g.session.new_cache(1, len(long_prompt) + 1)
            t0 = time.perf_counter()
            g.session.prefill(cache, [long_prompt])
            prefill[name].append(len(long_prompt) / (time.perf_counter() - t0))
        for ids in drafted:
            for name, g in gens.items():
                plain = g.generate_ids([ids], args.new_tokens)[0].token_ids
                for d in ("suffix", "ngram"):
                    spec = SpeculativeDecoder(g, make_proposer(d), make_policy("auto"))
                    t0 = time.perf_counter()
                    r = spec.generate_ids([ids], args.new_tokens)[0]
                    drafts[name][d]["tok_s"].append(len(r.token_ids) / (time.perf_counter() - t0))
                    drafts[name][d]["equal"] += r.token_ids == plain
                    drafts[name][d]["runs"] += 1

    med = statistics.median
    same = {n: sum(a == b for a, b in zip(outputs[n], outputs["fp32 portable"])) for n in gens}
    result = {
        **envelope("onnxruntime", "onnx", "torch", threads="ORT default (one per physical core)"),
        "settings": {"new_tokens": args.new_tokens, "repeats": args.repeats, "prompts": len(encoded)},
        "nodes": nodes,
        "memory_load_mib": memory,
        "decode_tok_s": {n: {c: round(med(v), 1) for c, v in by.items() if v} for n, by in decode.items()},
        "step_ms": {
            n: {p: {q: round(med(v), 2) for q, v in by.items()} for p, by in s.items()} for n, s in steps.items()
        },
        "prefill_tok_s": {n: round(med(v), 1) for n, v in prefill.items()},
        "drafts": {
            n: {
                d: {"tok_s": round(med(x["tok_s"]), 1), "equal_plain": f"{x['equal']}/{x['runs']}"}
                for d, x in by.items()
            }
            for n, by in drafts.items()
        },
        "greedy_equal_to_fp32_portable": {n: f"{same[n]}/{len(encoded)}" for n in gens},
    }
    if genai_out:
        first = [
            next((i for i, (a, b) in enumerate(zip(run["tokens"], ref_ids)) if a != b), None)
            for run, ref_ids in zip(genai_out["runs"], outputs["fp32 portable"])
        ]
        result["anchor"] = {"onnxruntime_genai": genai_out["version"], "first_token_differing_from_fp32": first}
    print_table(result, classes)
    print(f"wrote {write_result_json(result, args.out, 'fused')}")


def print_table(result: dict, classes: list[str]) -> None:
    names = list(result["decode_tok_s"])
    print(f"\n{'engine':24s} {'nodes':>6s} {'MiB':>6s} " + " ".join(f"{c:>13s}" for c in classes) + f" {'prefill':>9s}")
    for n in names:
        d = result["decode_tok_s"][n]
        row = f"{n:24s} {result['nodes'].get(n, ''):>6} {result['memory_load_mib'].get(n, ''):>6} "
        row += " ".join(f"{d.get(c, float('nan')):13.1f}" for c in classes)
        print(row + f" {result['prefill_tok_s'].get(n, float('nan')):9.1f}")
    print("\nstep ms by positions (Q) at past 64 / 512 / 1024")
    for n, by in result["step_ms"].items():
        cells = "  ".join("/".join(f"{by[p][q]:.1f}" for p in PASTS) for q in POSITIONS)
        print(f"{n:16s} " + cells)
    print("\ndrafts (N = auto): tokens/s end to end, = plain")
    for n, by in result["drafts"].items():
        print(f"{n:16s} " + "  ".join(f"{d} {x['tok_s']:.1f} ({x['equal_plain']})" for d, x in by.items()))
    print("\ngreedy output equal to fp32 portable:", result["greedy_equal_to_fp32_portable"])


if __name__ == "__main__":
    main()
