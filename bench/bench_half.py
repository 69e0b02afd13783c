"""What 16 bits do to the default model: the fp16 and bf16 step graphs against float32.

    python bench/bench_half.py [--artifacts artifacts/SmolLM2-135M-Instruct]

needs `specrt build-engines ... --quantize fp16` and `... --quantize bf16` first (the graphs in
ARTIFACTS/onnx-fp16/ and onnx-bf16/). The graphs are meant for TensorRT on a GPU; here each is
scored by what runs it on a CPU:

  fp16 graph   its ORT engine (ONNX Runtime's CPU provider has float16 kernels)
  bf16 graph   ONNX's reference evaluator (ORT's CPU provider has no bfloat16 kernels): the
               graph's own ops, in numpy, each rounding to bfloat16
  torch fp16 / bf16   the PyTorch module both graphs are traced from, cast to that dtype

teacher-forced on held-out text (the benchmark's prompts and the float engine's answers to
prompts of another seed of the prompt set): perplexity, top-1 agreement with float32 and the mean
KL divergence of the next-token distribution from float32's. Prints a table and writes JSON
(date, versions, machine) to bench/results/.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from harness import bench_arguments, envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def reference_scorer(onnx_dir: Path):
    """A function of a text returning (len - 1, V) float64 next-token log-probabilities from the
    step graph in `onnx_dir`, run by onnx.reference.ReferenceEvaluator (the text prefilled in chunks)."""
    import json

    import onnx
    from onnx.reference import ReferenceEvaluator

    from specrt.runtime.logprobs import log_softmax

    cfg = json.loads((onnx_dir / "manifest.json").read_text())["config"]
    evaluator = ReferenceEvaluator(onnx.load(str(onnx_dir / "model.onnx")))
    layers = range(cfg["num_hidden_layers"])
    kv_names = [f"past_key_values.{i}.{kind}" for i in layers for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in layers for kind in ("key", "value")]

    def score(ids: list[int]) -> np.ndarray:
        past = {n: np.zeros((1, cfg["num_key_value_heads"], 0, cfg["head_dim"]), np.float32) for n in kv_names}
        rows = []
        # chunks of 48 positions: the evaluator's GatherElements (numpy's choose) takes at most 64
        for start in range(0, len(ids) - 1, 48):
            piece = ids[start : min(start + 48, len(ids) - 1)]
            q, p = len(piece), start
            mask = np.concatenate([np.ones((q, p), bool), np.tril(np.ones((q, q), bool))], axis=1)[None]
            feeds = {
                "input_ids": np.array([piece], np.int64),
                "position_ids": np.arange(p, p + q, dtype=np.int64)[None],
                "attention_mask": mask,
                "logits_index": np.arange(q, dtype=np.int64)[None],
                **past,
            }
            logits, *new = evaluator.run(["logits", *present], feeds)
            past = {n: np.concatenate([past[n], kv], axis=2) for n, kv in zip(kv_names, new)}
            rows.append(logits[0].astype(np.float64))
        return log_softmax(np.concatenate(rows))

    return score


def main():
    ap = bench_arguments(__doc__, model=True, prompts=True)
    ap.add_argument("--held-out", type=int, default=16, help="held-out prompts answered by the float model")
    args = ap.parse_args()

    from specrt.benchmark import write_result_json
    from specrt.layout import ArtifactLayout
    from specrt.report import held_out_texts, quality
    from specrt.runtime.generator import Generator
    from specrt.training.prompts import benchmark_prompts

    layout = ArtifactLayout(args.artifacts)
    for scheme in ("fp16", "bf16"):
        if not (layout.quant_onnx(scheme) / "model.onnx").is_file():
            sys.exit(
                f"no {scheme} graph in {layout.quant_onnx(scheme)}: build it with specrt build-engines "
                f"--model {args.model} --out {args.artifacts} --quantize {scheme}"
            )
    ref = Generator.from_engine(layout.ort_engine("cpu"), args.model)
    gens = {
        "float32": ref,
        "fp16 graph (ORT)": Generator.from_engine(layout.ort_engine("cpu", "fp16"), args.model),
        "torch float16": Generator.from_checkpoint(args.model, dtype="float16"),
        "torch bfloat16": Generator.from_checkpoint(args.model, dtype="bfloat16"),
    }
    scorers = {"bf16 graph (reference)": reference_scorer(layout.quant_onnx("bf16"))}
    texts, _ = held_out_texts(ref, benchmark_prompts(args.prompts), args.held_out, 96)
    measured = quality(ref, gens, texts, scorers)
    table = {
        s: {
            "perplexity": round(q["perplexity"], 3),
            "top1_agreement": round(q["top1_agreement"], 4),
            "mean_kl": round(q["mean_kl"], 5),
        }
        for s, q in measured.items()
    }
    print(f"\n{'graph':<24}{'ppl':>9}{'top-1 =fp32':>13}{'KL(fp32||q)':>13}")
    for s, r in table.items():
        print(f"{s:<24}{r['perplexity']:>9}{r['top1_agreement']:>13.4f}{r['mean_kl']:>13.5f}")
    result = {
        "benchmark": "16-bit-graphs",
        **envelope("onnxruntime", "onnx", "numpy", "torch"),
        "model": str(args.model),
        "held_out_tokens": measured["float32"]["positions"],
        "graphs": table,
    }
    print(f"wrote {write_result_json(result, args.out, 'half')}")


if __name__ == "__main__":
    main()
