"""A Medusa head's top-1 per prompt class, on the sequences it trained on and on those it never
saw (the trainer's own held-out split), from the cached features: where it generalizes, and
where it only memorized.

    .venv/bin/python bench/bench_heldout.py --head drafts/qwen2.5-coder-1.5b/medusa \
        --data drafts/qwen2.5-coder-1.5b/data [--compare OTHER_HEAD --from-id 300]

Per class (the prompt set's kinds) and per head k: how often the head's first candidate is the
token k + 1 places after the feature's position (the target's own answer), over the answer
positions, as the trainer counts them (training/medusa.py `examples`). With --compare, another
head (trained on fewer of the same prompts, say) on the same sequences; with --from-id N only the
answers to prompts N and on count (ones a head trained on the first N prompts never saw). JSON
in bench/results/heldout-<date>.json.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, required=True, help="A Medusa head's directory (train-draft --out).")
    ap.add_argument("--data", type=Path, required=True, help="Its training data (train-draft --data).")
    ap.add_argument("--compare", type=Path, default=None, help="Another Medusa head, scored on the same sequences.")
    ap.add_argument("--from-id", type=int, default=0, help="Count only the answers to prompts of this id and on.")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    args = ap.parse_args()

    import torch
    from safetensors.torch import load_file

    from specrt.benchmark import write_result_json
    from specrt.export.medusa import MedusaConfig, MedusaHeads
    from specrt.layout import HeadLayout
    from specrt.schema.head_io import feature_columns
    from specrt.training.data import read_answers
    from specrt.training.eagle import TrainingData
    from specrt.training.features import FeatureCache, FeatureStore
    from specrt.training.medusa import examples

    from harness import envelope

    meta = json.loads((args.data / "data.json").read_text())
    kinds = {p["id"]: p["kind"] for p in map(json.loads, (args.data / "prompts.jsonl").read_text().splitlines())}
    answers = sorted(read_answers(args.data / "answers.jsonl"), key=lambda a: a.id)  # the trainer's order
    layers = tuple(meta["hidden_layers"])
    store = FeatureStore(args.data / "features")

    def loaded(head: Path) -> tuple:
        weights = HeadLayout(head).weights
        cfg = MedusaConfig.from_dict(json.loads((weights / "head.json").read_text()))
        heads = MedusaHeads(cfg)
        heads.load_state_dict(load_file(weights / "head.safetensors"))
        return cfg, heads

    models = {str(h): loaded(h) for h in (args.head, args.compare) if h is not None}
    width = models[str(args.head)][0].target.hidden_size  # the heads share the data's target
    feats = FeatureCache(store, answers)  # read once; split as the trainer splits (by source)
    data = TrainingData.load(answers, feats, layers, width, args.data / "prompts.jsonl")
    cols = feature_columns(layers, (-1,), width)
    held = set(data.held_out_ids)

    def scored(cfg, heads) -> dict:
        hits = collections.defaultdict(lambda: np.zeros((2, cfg.num_heads)))
        counts = collections.defaultdict(lambda: np.zeros((2, cfg.num_heads)))
        seqs = [*data.train, *data.held_out]
        ids = [i for i in range(len(answers)) if i not in held] + sorted(held)
        for i, seq in zip(ids, seqs):
            if answers[i].id < args.from_id:
                continue
            x, y = examples([seq], cols, cfg.num_heads)
            with torch.no_grad():
                _, top = heads(torch.from_numpy(x))
            kind, split = kinds[answers[i].id], int(i in held)
            for k in range(cfg.num_heads):
                scored = y[:, k] >= 0
                hits[kind][split, k] += int((top[scored, k, 0].numpy() == y[scored, k]).sum())
                counts[kind][split, k] += int(scored.sum())
        return {
            kind: {
                split: {
                    "positions": int(counts[kind][s, 0]),
                    "top1": [round(float(h), 3) for h in hits[kind][s] / np.maximum(counts[kind][s], 1)],
                }
                for s, split in enumerate(("trained", "held_out"))
            }
            for kind in sorted(hits)
        }

    tables = {name: scored(*model) for name, model in models.items()}
    for head, table in tables.items():
        print(f"{head}\n{'class':15s} {'trained on':>32s} {'never seen':>32s}")
        for kind, row in table.items():
            cells = [f"{' / '.join(f'{v:.2f}' for v in row[s]['top1'])} ({row[s]['positions']})" for s in row]
            print(f"{kind:15s} {cells[0]:>32s} {cells[1]:>32s}")
    result = {
        **envelope("torch", "safetensors"),
        "settings": {"head": str(args.head), "compare": str(args.compare), "data": str(args.data),
                     "from_id": args.from_id, "answers": len(answers)},
        "top1_by_class": tables[str(args.head)],
        "by_head": tables,
    }  # fmt: skip
    print(f"wrote {write_result_json(result, args.out, 'heldout')}")


if __name__ == "__main__":
    main()
