"""Training Medusa heads on the frozen target's features (Medusa-1), self-distilled.

    heads, report = train_medusa(target_model, data, MedusaTrainConfig(), out_dir)

Each position j of a training sequence gives one example: the target's final normed feature
f[j] and the labels t[j+1+k] for heads k = 1..K (only labels inside the answer count; the
prompt is context). A Medusa head is a function of one position's feature, so examples are
shuffled across sequences into fixed-size batches. Loss: sum over heads of 0.8^(k-1) x
cross-entropy (later heads are less often reached, as in Medusa's paper); labels outside the
draft vocabulary are not scored.

The held-out sequences (TrainingData.held_out: prompts.held_out_prompts) give, per head, how
often the right token is the rank-r candidate (`rank_accuracy`): the progress bar shows head 1's
top-1, and the final figures derive the tree of choices the proposer uses (schema/medusa_tree.py derive_tree).

Deterministic (seeded init and order), resumable (checkpoint every `checkpoint_every` steps and
when `max_minutes` runs out; running again continues from it).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specrt.errors import SpecrtError
from specrt.export.llama import LlamaModel
from specrt.export.medusa import MedusaConfig, MedusaHeads, medusa_from_target
from specrt.schema.head_io import feature_columns
from specrt.schema.medusa_tree import DEFAULT_TREE_SIZE, derive_tree
from specrt.training.eagle import STEP_WEIGHT, Sequence, TrainingData, choose_draft_vocab
from specrt.training.families import COMMON, TrainOptions
from specrt.training.loop import CHECKPOINT, Trainer, run_training


@dataclasses.dataclass(frozen=True)
class MedusaTrainConfig:
    num_heads: int = 4
    draft_vocab: int = 8192
    top_k: int = 8
    epochs: float = 1.0
    lr: float = 1e-3
    warmup: int = 20
    batch: int = 1024  # positions per batch
    seed: int = 0
    eval_every: int = 50
    checkpoint_every: int = 50
    tree_size: int = DEFAULT_TREE_SIZE
    max_minutes: float | None = None
    precision: str = "float32"  # bfloat16: the loss computed under autocast (training/families.py PRECISIONS)
    method: str = "medusa"


def examples(seqs: list[Sequence], cols: list[int], num_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """(features (N, C) float32, labels (N, K) int64, -1 where not scored) of every position
    whose first head has a label inside the answer."""
    feats, labels = [], []
    for s in seqs:
        n = len(s.tokens)
        j = np.arange(n - 2)
        j = j[j + 2 >= s.prompt_len]  # head 1's label t[j+2] is in the answer
        if not len(j):
            continue
        lab = np.full((len(j), num_heads), -1, np.int64)
        for k in range(1, num_heads + 1):
            at = j + 1 + k
            ok = at < n
            lab[ok, k - 1] = s.tokens[at[ok]]
        feats.append(np.asarray(s.features[j][:, cols], dtype=np.float32))
        labels.append(lab)
    if not feats:
        raise SpecrtError("no answer positions to train Medusa heads on; generate longer answers")
    return np.concatenate(feats), np.concatenate(labels)


class MedusaTrainer(Trainer):
    def __init__(self, heads: MedusaHeads, data: TrainingData, cfg: MedusaTrainConfig):
        super().__init__(heads, data, cfg)
        self.heads = heads
        cols = feature_columns(data.target_layers, (-1,), data.hidden_size)
        self.x, self.y = examples(data.train, cols, cfg.num_heads)
        self.hx, self.hy = examples(data.held_out, cols, cfg.num_heads)
        V = heads.hc.target.vocab_size
        self.t2d = torch.full((V,), -1, dtype=torch.int64)  # target id -> draft row (-1: outside)
        self.t2d[heads.draft_to_target] = torch.arange(heads.hc.draft_vocab)
        self.per_epoch = max(1, len(self.x) // cfg.batch)
        self.planned = max(1, math.ceil(cfg.epochs * self.per_epoch))
        self.step_weights = torch.tensor([STEP_WEIGHT**k for k in range(cfg.num_heads)])

    def batch_rows(self, step: int) -> np.ndarray:
        epoch, within = divmod(step, self.per_epoch)
        order = self.epoch_order(epoch, len(self.x))
        return order[within * self.cfg.batch : (within + 1) * self.cfg.batch]

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.heads.logits(x)  # (N, K, Vd)
        labels = torch.where(y >= 0, self.t2d[y.clamp(min=0)], -1)
        total = torch.zeros(())
        for k in range(self.cfg.num_heads):
            scored = labels[:, k] >= 0
            if scored.any():
                total = total + self.step_weights[k] * F.cross_entropy(logits[scored, k], labels[scored, k])
        return total

    def advance(self) -> float:
        rows = self.batch_rows(self.step)
        return self.optimize(lambda: self.loss(torch.from_numpy(self.x[rows]), torch.from_numpy(self.y[rows])))

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss and, per head, the share of positions whose right token is the
        rank-r candidate (r < top_k; a token outside the draft vocabulary is never a candidate)."""
        K, top = self.cfg.num_heads, self.cfg.top_k
        hits, counts, losses = np.zeros((K, top)), np.zeros(K), []
        for start in range(0, len(self.hx), 2048):
            x, y = torch.from_numpy(self.hx[start : start + 2048]), torch.from_numpy(self.hy[start : start + 2048])
            losses.append(float(self.loss(x, y)) * len(x))
            _, ids = self.heads(x)  # (N, K, top) target ids
            for k in range(K):
                valid = y[:, k] >= 0
                match = ids[valid, k] == y[valid, k].unsqueeze(-1)  # (n, top), at most one True per row
                hits[k] += match.sum(0).numpy()
                counts[k] += int(valid.sum())
        rank = hits / np.maximum(counts, 1)[:, None]
        return {
            "loss": float(np.sum(losses) / max(1, len(self.hx))),
            "top1": [round(float(r), 4) for r in rank[:, 0]],
            # as EAGLE's report has them: per draft step (head) top-1, and a greedy chain's
            # expected accepted length from them (1 + a1 + a1 a2 + ...; bonus token included)
            "acceptance": [round(float(r), 4) for r in rank[:, 0]],
            "mean_accepted": round(float(1 + np.cumprod(rank[:, 0]).sum()), 4),
            "rank_accuracy": [[round(float(v), 4) for v in row] for row in rank],
        }

    def weights(self) -> dict:
        return {"heads": {n: p.detach().clone() for n, p in self.heads.state_dict().items()}}

    def load_weights(self, st: dict) -> None:
        self.heads.load_state_dict(st["heads"])


def new_medusa(target: LlamaModel, data: TrainingData, cfg: MedusaTrainConfig) -> MedusaHeads:
    V = target.cfg.vocab_size
    size = min(cfg.draft_vocab, V)
    ids = choose_draft_vocab(data.answer_token_counts(V), size, tuple(target.cfg.eos_token_id))
    hc = MedusaConfig(target.cfg, cfg.num_heads, size, min(cfg.top_k, size))
    return medusa_from_target(target, hc, ids, cfg.seed)


def train_medusa(
    target: LlamaModel, data: TrainingData, cfg: MedusaTrainConfig, out_dir: str | Path, progress: bool = True
) -> tuple[MedusaHeads, dict]:
    """Train (or resume training) Medusa heads in out_dir; returns them and a report whose
    `tree` is the tree of choices derived from the held-out rank accuracies."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    heads = new_medusa(target, data, cfg)
    trainer = MedusaTrainer(heads, data, cfg)
    run = run_training(trainer, heads, cfg, out_dir / CHECKPOINT, "train medusa", progress)
    report = run.report(trainer, data, cfg) | {
        "train_positions": int(len(trainer.x)),
        "tree": [list(p) for p in derive_tree(run.final["rank_accuracy"], cfg.tree_size)],
    }
    return heads, report


def train_config(method: str, o: TrainOptions) -> MedusaTrainConfig:
    """Medusa's training config from train-draft's options (--heads: K)."""
    kw = o.given(*COMMON, "draft_vocab")
    if o.heads is not None:
        kw["num_heads"] = o.heads
    return MedusaTrainConfig(**kw)
