"""Distilling a small draft model from the target (train-draft --method draft-model).

The default model is the smallest of its family, so no smaller checkpoint with its tokenizer
exists to draft with; this makes one:

    layers      a few of the target's decoder layers (default: the first two and the last two;
                dropping middle layers hurts a model least), its embedding and final norm
    output      a reduced vocabulary (the most frequent answer tokens, end of sequence included):
                the output head keeps those rows of the target's (ModelConfig.output_vocab;
                the graph's logits stay vocabulary-wide, other tokens at probability 0)
    loss        KL(target || draft) of the next-token distribution at every answer position,
                the target's distribution computed from its cached final feature through its
                own output head, restricted to the draft vocabulary and renormalised

The result is an ordinary checkpoint directory (config.json, model.safetensors, the target's
tokenizer) exported through the same step graph and built by build-engines, so the runtime
drafts with it like with any smaller model of the family (runtime/drafts/draft_model.py).

Deterministic (seeded order), resumable (checkpoint every `checkpoint_every` steps and when
`max_minutes` runs out), held-out figures as the other heads report them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specrt.errors import SpecrtError
from specrt.export.llama import LlamaModel, causal_mask
from specrt.schema.head_io import feature_columns
from specrt.training.eagle import Sequence, TrainingData, choose_draft_vocab, length_batches
from specrt.training.families import COMMON, TrainOptions
from specrt.training.loop import CHECKPOINT, Trainer, run_training

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclasses.dataclass(frozen=True)
class DraftModelConfig:
    layers: tuple[int, ...] | None = None  # target layers the draft keeps (default: default_draft_layers)
    draft_vocab: int = 8192
    epochs: float = 1.0
    lr: float = 5e-4
    warmup: int = 20
    batch_tokens: int = 4096
    max_len: int = 640
    seed: int = 0
    eval_every: int = 25
    checkpoint_every: int = 25
    max_minutes: float | None = None
    precision: str = "float32"  # bfloat16: the loss computed under autocast (training/families.py PRECISIONS)
    method: str = "draft-model"


def default_draft_layers(num_layers: int) -> tuple[int, ...]:
    """The first two and the last two layers (all of them for a model of 4 or fewer)."""
    return tuple(sorted({0, 1, num_layers - 2, num_layers - 1} & set(range(num_layers))))


def draft_from_target(target: LlamaModel, layers, draft_ids) -> LlamaModel:
    """A draft model of the target's `layers`, embedding and final norm, whose output head is
    the target's rows `draft_ids`."""
    layers = tuple(int(i) for i in layers)
    if not layers or min(layers) < 0 or max(layers) >= target.cfg.num_hidden_layers:
        raise SpecrtError(f"draft layers {list(layers)} must be in 0..{target.cfg.num_hidden_layers - 1}")
    ids = torch.as_tensor(np.asarray(draft_ids), dtype=torch.int64)
    cfg = dataclasses.replace(
        target.cfg, num_hidden_layers=len(layers), tie_word_embeddings=False, output_vocab=len(ids)
    )
    draft = LlamaModel(cfg, hidden_layers=(-1,))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.embed_tokens.weight)
        for mine, theirs in zip(draft.layers, layers):
            mine.load_state_dict(target.layers[theirs].state_dict())
        draft.norm.weight.copy_(target.norm.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight[ids])
        draft.output_ids.copy_(ids)
    return draft


def save_draft_checkpoint(draft: LlamaModel, out: Path, tokenizer_from: Path) -> Path:
    """An ordinary checkpoint directory (config.json, model.safetensors, the tokenizer), written
    to a temporary name and renamed."""
    from safetensors.torch import save_file

    from specrt.artifacts import atomic_dir

    with atomic_dir(out) as tmp:
        state = {
            ("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v.contiguous()
            for k, v in draft.state_dict().items()
        }
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(draft.cfg.to_hf_dict(), indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).is_file():
                shutil.copyfile(Path(tokenizer_from) / name, tmp / name)
    return out


class DistillTrainer(Trainer):
    def __init__(self, draft: LlamaModel, target: LlamaModel, data: TrainingData, cfg: DraftModelConfig):
        super().__init__(draft, data, cfg)
        self.draft = draft
        self.cols = feature_columns(data.target_layers, (-1,), data.hidden_size)
        self.head = target.lm_head.weight.detach()[draft.output_ids].clone()  # (Vd, C): the target's rows
        self.batches = length_batches(data.train, cfg.max_len, cfg.batch_tokens)
        self.held = length_batches(data.held_out, cfg.max_len, cfg.batch_tokens)
        self.planned = max(1, math.ceil(cfg.epochs * len(self.batches)))

    def batch(self, seqs: list[Sequence], idx: list[int]):
        """(ids (B, n), target features (B, n, C), scored (B, n) bool, next tokens (B, n))."""
        n = max(min(len(seqs[i].tokens), self.cfg.max_len) for i in idx) - 1
        B = len(idx)
        ids, nxt = np.zeros((B, n), np.int64), np.zeros((B, n), np.int64)
        feats = np.zeros((B, n, len(self.cols)), np.float32)
        scored = np.zeros((B, n), bool)
        for b, i in enumerate(idx):
            s = seqs[i]
            m = min(len(s.tokens), self.cfg.max_len) - 1
            ids[b, :m] = s.tokens[:m]
            nxt[b, :m] = s.tokens[1 : m + 1]
            feats[b, :m] = s.features[:m][:, self.cols]
            scored[b, :m] = np.arange(1, m + 1) >= s.prompt_len  # the next token is in the answer
        return torch.from_numpy(ids), torch.from_numpy(feats), torch.from_numpy(scored), torch.from_numpy(nxt)

    def forward(self, ids, feats, scored):
        """(KL summed over scored positions, draft logits (N, Vd), target logits (N, Vd)) at the scored positions."""
        B, n = ids.shape
        last = torch.zeros(B, 1, dtype=torch.int64)  # the model's own vocabulary-wide logits are not needed
        _, hidden, _ = self.draft(
            ids, torch.arange(n).expand(B, n), causal_mask(B, n, 0), self.draft.empty_past(B), last
        )
        q = self.draft.lm_head(hidden[scored])  # (N, Vd)
        p = feats[scored] @ self.head.T
        kl = F.kl_div(F.log_softmax(q, -1), F.log_softmax(p, -1), log_target=True, reduction="sum")
        return kl, q, p

    def advance(self) -> float:
        epoch, within = divmod(self.step, len(self.batches))
        ids, feats, scored, _ = self.batch(
            self.data.train, self.batches[self.epoch_order(epoch, len(self.batches))[within]]
        )
        return self.optimize(lambda: self.forward(ids, feats, scored)[0] / max(1, int(scored.sum())))

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out mean KL, and how often the draft's top token is the target's next token
        (the data is the target's greedy answers: a greedy chain's per-token acceptance)."""
        total, hits, count = 0.0, 0, 0
        for idx in self.held:
            ids, feats, scored, nxt = self.batch(self.data.held_out, idx)
            kl, q, _ = self.forward(ids, feats, scored)
            total += float(kl)
            hits += int((self.draft.output_ids[q.argmax(-1)] == nxt[scored]).sum())
            count += int(scored.sum())
        a = hits / max(1, count)
        return {
            "loss": total / max(1, count),
            "acceptance": [round(a, 4)],
            "mean_accepted": round(float(sum(a**k for k in range(5))), 4),  # a chain of 4, bonus included
        }

    def weights(self) -> dict:
        return {"draft": self.draft.state_dict()}

    def load_weights(self, st: dict) -> None:
        self.draft.load_state_dict(st["draft"])


def train_draft_model(
    target: LlamaModel, data: TrainingData, cfg: DraftModelConfig, out_dir: str | Path, progress: bool = True
) -> tuple[LlamaModel, dict]:
    """Distil (or resume distilling) a draft model in out_dir; returns it and a report."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    V = target.cfg.vocab_size
    layers = cfg.layers or default_draft_layers(target.cfg.num_hidden_layers)
    ids = choose_draft_vocab(data.answer_token_counts(V), min(cfg.draft_vocab, V), tuple(target.cfg.eos_token_id))
    draft = draft_from_target(target, layers, ids)
    trainer = DistillTrainer(draft, target, data, cfg)
    run = run_training(trainer, draft, cfg, out_dir / CHECKPOINT, "train draft-model", progress)
    report = run.report(trainer, data, cfg) | {"layers": list(layers)}
    return draft, report


def train_config(method: str, o: TrainOptions) -> DraftModelConfig:
    """The distilled draft model's training config from train-draft's options."""
    return DraftModelConfig(**o.given(*COMMON, "batch_tokens", "draft_vocab"))
