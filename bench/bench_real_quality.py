"""Quality of a GGUF-backed model's engines against the float model of the same file, and the
float model against transformers, which loads the GGUF itself.

    .venv/bin/python bench/bench_real_quality.py --model models/qwen2.5-coder-1.5b \
        --artifacts artifacts/qwen2.5-coder-1.5b [--schemes gguf-a8] [--greedy-prompts 12]

  teacher-forced  every position of the prompt texts (bench/prompts_real.jsonl, in the chat
                  template): perplexity of the text under the float model (the file's blocks
                  dequantized to float32, PyTorch) and under each engine, the mean KL(float ||
                  engine) of the next-token distributions and their top-1 agreement
  greedy          --greedy-prompts prompts (training/prompts.py, seed 11) x --greedy-tokens:
                  transformers' float32 model of the GGUF (its own dequantization) against
                  specrt's float model (equal tokens: the same model) and against each engine
                  (the first position where the engine's own numbers pick another token)

The models run one after another (the float model of a 1.5B is 6.2 GB). JSON in bench/results/.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

from harness import bench_arguments, envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHUNK = 64  # positions per engine step (a verification step's size class)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def texts(path: Path, tokenizer) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = []
    for r in rows:
        messages = r.get("messages") or [{"role": "user", "content": r["prompt"]}]
        out.append(tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False)))
    return out


def step_logits(gen, ids: list[int]) -> np.ndarray:
    """Every position's logits of `ids`, teacher-forced in steps of CHUNK positions."""
    s = gen.session
    cache = s.new_cache(1, len(ids) + CHUNK)
    out = [
        s.forward(cache, [ids[i : i + CHUNK]]).logits[0, : len(ids[i : i + CHUNK])] for i in range(0, len(ids), CHUNK)
    ]
    s.release(cache)
    return np.concatenate(out)


def compare(ref: np.ndarray, got: np.ndarray, ids: list[int]) -> dict:
    """Next-token figures over positions 0..T-2 (position t predicts ids[t + 1])."""
    lr, lg = log_softmax(ref[:-1]), log_softmax(got[:-1])
    nxt = np.array(ids[1:])
    pos = np.arange(len(nxt))
    return {
        "nll_ref": -lr[pos, nxt],
        "nll": -lg[pos, nxt],
        "kl": (np.exp(lr) * (lr - lg)).sum(-1),
        "top1": lr.argmax(-1) == lg.argmax(-1),
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    ap = bench_arguments(__doc__, artifacts=True, model=True)
    ap.add_argument("--schemes", default="gguf-a8")
    ap.add_argument("--texts", type=Path, default=ROOT / "bench" / "prompts_real.jsonl")
    ap.add_argument("--greedy-prompts", type=int, default=12)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    args = ap.parse_args()

    import torch

    from specrt.layout import ArtifactLayout
    from specrt.runtime.generator import Generator
    from specrt.schema.checkpoint_files import gguf_weights
    from specrt.training.prompts import build_prompt_set

    torch.set_num_threads(2)
    schemes = args.schemes.split(",")
    gens = {s: Generator.from_engine(ArtifactLayout(args.artifacts).ort_engine("cpu", s), args.model) for s in schemes}
    for g in gens.values():
        g.eos_ids = frozenset()  # every greedy run makes --greedy-tokens
    tok = next(iter(gens.values())).tokenizer
    corpus = texts(args.texts, tok)
    prompts = [p.prompt for p in build_prompt_set(args.greedy_prompts, seed=11)]
    encoded = [next(iter(gens.values())).encode_prompt(p) for p in prompts]
    engine_out = {
        s: [g.generate_ids([ids], args.greedy_tokens)[0].token_ids for ids in encoded] for s, g in gens.items()
    }
    engine_tf = {s: [step_logits(g, ids) for ids in corpus] for s, g in gens.items()}
    del gens
    gc.collect()

    t0 = time.perf_counter()
    ref = Generator.from_checkpoint(args.model)  # the file's blocks dequantized to float32, PyTorch
    ref.eos_ids = frozenset()
    float_tf = [step_logits(ref, ids) for ids in corpus]
    figures = {s: [compare(float_tf[k], engine_tf[s][k], ids) for k, ids in enumerate(corpus)] for s in schemes}
    float_out = [ref.generate_ids([ids], args.greedy_tokens)[0].token_ids for ids in encoded]
    float_seconds = time.perf_counter() - t0
    del ref, float_tf
    gc.collect()

    from transformers import AutoModelForCausalLM

    gguf = Path(gguf_weights(args.model))
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32).eval()
    hf_out = []
    with torch.no_grad():
        for ids in encoded:
            out = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=args.greedy_tokens,
                do_sample=False,
                min_new_tokens=args.greedy_tokens,
            )
            hf_out.append(out[0, len(ids) :].tolist())
    del hf

    def cat(key, s):
        return np.concatenate([f[key] for f in figures[s]])

    result = {
        **envelope("torch", "onnxruntime", "transformers"),
        "settings": {
            "model": str(args.model),
            "texts": str(args.texts),
            "positions": int(sum(len(i) - 1 for i in corpus)),
            "greedy_prompts": len(prompts),
            "greedy_tokens": args.greedy_tokens,
        },
        "float_perplexity": float(np.exp(cat("nll_ref", schemes[0]).mean())),
        "engines": {
            s: {
                "perplexity": float(np.exp(cat("nll", s).mean())),
                "perplexity_change": float(np.exp(cat("nll", s).mean() - cat("nll_ref", s).mean()) - 1),
                "kl_mean": float(cat("kl", s).mean()),
                "top1_agreement": float(cat("top1", s).mean()),
                "greedy_first_difference_vs_transformers": [
                    first_difference(a, b) for a, b in zip(engine_out[s], hf_out)
                ],
                "greedy_equal_transformers": sum(a == b for a, b in zip(engine_out[s], hf_out)),
            }
            for s in schemes
        },
        "float_equal_transformers": sum(a == b for a, b in zip(float_out, hf_out)),
        "float_first_difference_vs_transformers": [first_difference(a, b) for a, b in zip(float_out, hf_out)],
        "float_seconds": round(float_seconds, 1),
    }
    print(f"float32 perplexity {result['float_perplexity']:.3f} over {result['settings']['positions']} positions")
    for s, e in result["engines"].items():
        print(
            f"{s:10s} perplexity {e['perplexity']:.3f} ({e['perplexity_change']:+.2%}), KL {e['kl_mean']:.4f}, "
            f"top-1 {e['top1_agreement']:.1%}, greedy = transformers on {e['greedy_equal_transformers']}/{len(prompts)}"
        )
    print(f"specrt float32 = transformers on {result['float_equal_transformers']}/{len(prompts)} prompts")
    from specrt.benchmark import write_result_json

    print(f"wrote {write_result_json(result, args.out, 'real-quality')}")


if __name__ == "__main__":
    main()
