"""What fitting buys on weights that are not on a 4-bit grid: hqq and gptq against round to nearest.

    python bench/bench_fit.py [--model models/SmolLM2-135M-Instruct] [--seed 0]

The default model's weights are already 4-bit blocks (its GGUF's Q4_1, head Q8_0), so every
recipe that starts from min-max finds them again and nothing is left to fit (bench_quant.py).
The float model that GGUF was made from had each weight somewhere inside its 4-bit cell; this
benchmark makes such a model: every weight moved by a uniform draw within its own cell (±d/2,
d the block's step: Q4_1 for the layers, Q8_0 for the tied embedding / head), a stand-in for a
float checkpoint of the same network. Then, against that model's own float32 engine:

  int4       round to nearest, symmetric (the `int4` scheme)
  hqq        HQQ offsets, output head in 8 bits
  gptq       GPTQ on a calibration set made by that model (32 prompts + its answers)
  awq        AWQ's activation-aware scales on the same set

teacher-forced on held-out text (the benchmark's prompts and answers the float model gives to
prompts of another seed of the prompt set): perplexity, top-1 agreement and the mean KL
divergence of the next-token distribution from float32's. Prints a table and writes JSON (date,
versions, machine) to bench/results/.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from harness import bench_arguments, envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def jittered_checkpoint(src: Path, out: Path, seed: int) -> Path:
    """A copy of `src` with every matrix moved uniformly within its block cells."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, out)
    rng = np.random.default_rng(seed)
    state = load_file(str(src / "model.safetensors"))
    for name, w in state.items():
        if w.ndim != 2 or w.shape[1] % 32:
            continue
        g = w.reshape(w.shape[0], -1, 32).astype(np.float64)
        if "embed" in name or "lm_head" in name:  # Q8_0: d = max |w| / 127
            step = np.abs(g).max(-1, keepdims=True) / 127
        else:  # Q4_1: d = (max - min) / 15
            step = (g.max(-1, keepdims=True) - g.min(-1, keepdims=True)) / 15
        g = g + rng.uniform(-0.5, 0.5, g.shape) * step
        state[name] = g.reshape(w.shape).astype(np.float32)
    save_file(state, str(out / "model.safetensors"))
    (out / "gguf_source.json").unlink(missing_ok=True)  # not that GGUF's dequantization any more
    return out


def main():
    ap = bench_arguments(__doc__, artifacts=False, model=True, prompts=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--held-out", type=int, default=24, help="held-out prompts answered by the float model")
    args = ap.parse_args()

    from specrt.benchmark import write_result_json
    from specrt.engines.build import BuildSpec, build_all
    from specrt.layout import ArtifactLayout
    from specrt.report import held_out_texts, quality
    from specrt.runtime.generator import Generator
    from specrt.training.calibration_set import make_calibration_set
    from specrt.training.prompts import benchmark_prompts

    tmp = Path(tempfile.mkdtemp(prefix="specrt-fit-"))
    ckpt = jittered_checkpoint(args.model, tmp / "ckpt", args.seed)
    art = tmp / "art"
    layout = ArtifactLayout(art)
    list(build_all(BuildSpec(checkpoint=ckpt, out=art, tensorrt="off")))
    ref = Generator.from_engine(layout.ort_engine("cpu"), ckpt)
    held = benchmark_prompts(args.prompts)
    cal = make_calibration_set(ref, layout.calibration, hold_out=held, progress=False)
    schemes = ["int4", "hqq", "gptq", "awq"]
    for s in schemes:
        cal_file = layout.calibration / "set.json" if s in ("gptq", "awq") else None
        list(build_all(BuildSpec(checkpoint=ckpt, out=art, tensorrt="off", quantize=s, calibration=cal_file)))
    gens = {"float32": ref, **{s: Generator.from_engine(layout.ort_engine("cpu", s), ckpt) for s in schemes}}

    # held-out text: the benchmark's prompts, and the float model's answers to prompts of a third seed
    texts, _ = held_out_texts(ref, held, args.held_out, 96)
    measured = quality(ref, gens, texts)
    table = {
        s: {
            "perplexity": round(q["perplexity"], 3),
            "top1_agreement": round(q["top1_agreement"], 4),
            "mean_kl": round(q["mean_kl"], 4),
        }
        for s, q in measured.items()
    }
    print(f"\n{'recipe':<9}{'ppl':>9}{'top-1 =fp32':>13}{'KL(fp32||q)':>13}")
    for s, r in table.items():
        print(f"{s:<9}{r['perplexity']:>9}{r['top1_agreement']:>13.3f}{r['mean_kl']:>13.4f}")
    result = {
        "benchmark": "fitted-int4-off-grid",
        **envelope("onnxruntime", "onnx", "numpy", "torch"),
        "model": str(args.model),
        "jitter": {"seed": args.seed, "law": "uniform within each weight's block step (Q4_1 layers, Q8_0 head)"},
        "held_out_tokens": measured["float32"]["positions"],
        "calibration": cal.describe(),
        "recipes": table,
    }
    print(f"wrote {write_result_json(result, args.out, 'fit')}")


if __name__ == "__main__":
    main()
