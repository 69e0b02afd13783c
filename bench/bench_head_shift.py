"""How well a trained EAGLE head predicts the target on prompts like its training prompts, and on
the benchmark's prompts: the gap is what the training data's topics cost.

    python bench/bench_head_shift.py [--draft-dir drafts/SmolLM2-135M-Instruct/eagle3] [--prompts 12]

(the default head: `specrt train-draft --method eagle3 --model models/SmolLM2-135M-Instruct
--artifacts artifacts/SmolLM2-135M-Instruct --data drafts/SmolLM2-135M-Instruct/data --prompts 1000
--out drafts/SmolLM2-135M-Instruct/eagle3`; `make drafts` trains Medusa heads only)

For each prompt the target answers greedily (96 tokens); the head then reads the target's real
features over prompt + answer and predicts, teacher-forced, every answer token at each of 3
unrolled draft steps (as training measures its held-out acceptance: step k uses the head's own
hidden states for k > 1). Prompt sets: the benchmark (bench/prompts.jsonl, held out of training)
and the same number of the training data's held-out prompts (training.prompts.held_out_prompts:
made from sources no training prompt shares).
Prints per-step acceptance per set and per class and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from harness import envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def teacher_forced(gen, head, cols, prompts, new_tokens):
    import torch

    from specrt.training.eagle import Sequence, make_batch, unrolled

    per_prompt = []
    for p in prompts:
        ids = gen.encode_prompt(p, chat=True)
        tokens = ids + gen.generate_ids([ids], new_tokens)[0].token_ids
        cache = gen.session.new_cache(1, len(tokens))
        feats = gen.session.prefill(cache, [tokens], hidden=True).hidden[0].astype(np.float16)
        gen.session.release(cache)
        batch = make_batch([Sequence(np.array(tokens), feats, len(ids))], cols, None, 4096)
        with torch.no_grad():
            steps = []
            for h, scored in unrolled(head, batch, 3):
                top = head.draft_to_target[head.project(h[scored]).argmax(-1)]
                steps.append(float((top == batch.labels[scored]).float().mean()))
        per_prompt.append(steps)
    return per_prompt


def _mean(rows):
    return [round(float(x), 4) for x in np.mean(rows, axis=0)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", type=Path, default=ROOT / "artifacts/SmolLM2-135M-Instruct")
    ap.add_argument("--draft-dir", type=Path, default=ROOT / "drafts/SmolLM2-135M-Instruct/eagle3")
    ap.add_argument("--data", type=Path, default=ROOT / "drafts/SmolLM2-135M-Instruct/data")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args()

    from specrt.benchmark import write_result_json
    from specrt.export.draft_head import load_head
    from specrt.layout import ArtifactLayout, HeadLayout, TrainingDataLayout
    from specrt.runtime.generator import Generator
    from specrt.schema.head_io import feature_columns
    from specrt.training.prompts import held_out_prompts, read_prompt_set

    gen = Generator.from_engine(ArtifactLayout(args.artifacts).ort_engine())
    head = load_head(HeadLayout(args.draft_dir).weights)
    cols = feature_columns(gen.session.caps.hidden_layers, head.hc.layers, gen.config.hidden_size)
    bench = [json.loads(line) for line in (ROOT / "bench/prompts.jsonl").read_text().splitlines()]
    bench = [(b["class"], b["prompt"]) for b in bench]
    train = read_prompt_set(TrainingDataLayout(args.data).prompts)
    held = set(held_out_prompts(train))
    sets = {
        "benchmark prompts (held out)": bench[: args.prompts],
        "training-distribution prompts (held out)": [(t.kind, t.prompt) for t in train if t.id in held][: args.prompts],
    }
    result = {"head": str(args.draft_dir), "method": head.hc.method, "new_tokens": args.new_tokens, "sets": {}}
    for name, prompts in sets.items():
        rows = teacher_forced(gen, head, cols, [p for _, p in prompts], args.new_tokens)
        acc = _mean(rows)
        by_class = {
            kind: _mean([r for (k, _), r in zip(prompts, rows) if k == kind])
            for kind in dict.fromkeys(k for k, _ in prompts)
        }
        result["sets"][name] = {"prompts": len(prompts), "acceptance_per_step": acc, "by_class": by_class}
        print(f"{name:<44} acceptance per draft step {acc}  chain length {1 + float(np.cumprod(acc).sum()):.2f}")
        for kind, a in by_class.items():
            print(f"  {kind:<42} acceptance per draft step {a}  chain length {1 + float(np.cumprod(a).sum()):.2f}")
    import platform

    result |= {
        **envelope("onnxruntime", "torch", platform=platform.platform()),
    }
    print(f"wrote {write_result_json(result, args.out, f'head-shift-{head.hc.method}')}")


if __name__ == "__main__":
    main()
