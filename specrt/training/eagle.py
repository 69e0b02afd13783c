"""Training EAGLE heads on the target's own answers and cached features (self-distillation).

    data = TrainingData.load(answers, features, target_layers)   # see specrt.training.data
    result = train_head(target_model, data, TrainConfig("eagle3"), out_dir)

Alignment. For a sequence t[0..n-1] with target features f[0..n-1] (f[j] has read t[0..j] and
predicts t[j+1]), head entry j reads (t[j+1], f[j]) and learns t[j+2]: the token the target says
after the one it has just produced. Only labels inside the answer count (the prompt is context).

Training-time test (EAGLE-3): at test time only the first draft token sees a target feature;
every later one sees the head's own output. So training unrolls `ttt_steps` draft steps: at step
k entry j reads (t[j+1], h_{k-1}[j-1]), its own previous output one position back, and attends
to the target-fed entries up to j-k+1 plus its own chain (one entry per earlier step, on the
diagonal). Step k's loss is weighted 0.8^(k-1). EAGLE-1 trains the first step only, with a
regression of the next target feature (smooth L1) beside 0.1 x cross-entropy, as its paper does.
An MTP module trains like EAGLE-3 (cross-entropy, 2 unrolled steps by default: DeepSeek-V3
trains one module per depth, here one module is chained, so it learns to read its own output).

Held-out sequences (their prompts made from sources no training prompt shares:
prompts.held_out_prompts) give the progress bar's acceptance: per unrolled step, the share of
positions whose draft top-1 equals the target's token, and the expected accepted length of a
greedy chain from them (1 + a1 + a1 a2 + ...; bonus token included).

Deterministic: the seed fixes the initialisation, the batch order and the lr schedule.
Resumable: a checkpoint (head, optimizer, step, schedule) is written atomically every
`checkpoint_every` steps and when `max_minutes` runs out; running again continues from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specrt.errors import SpecrtError
from specrt.export.draft_head import DraftHead, HeadConfig, head_from_target
from specrt.export.llama import LlamaModel
from specrt.families.eagle import variant
from specrt.schema.head_io import feature_columns
from specrt.training.data import Answer
from specrt.training.families import COMMON, TrainOptions
from specrt.training.features import FeatureCache
from specrt.training.loop import CHECKPOINT, Trainer, run_training
from specrt.training.prompts import held_out_prompts, read_prompt_set

STEP_WEIGHT = 0.8  # the loss weight of unrolled step k is STEP_WEIGHT ** (k - 1)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    method: str  # "eagle", "eagle3", "mtp" or "peagle"
    # unrolled draft steps (default: 1 for eagle, 2 for mtp, 3 for eagle3); peagle: the tokens
    # one call drafts, K (default 5: the root's entry and K - 1 mask depths)
    ttt_steps: int | None = None
    epochs: float = 2.0
    lr: float = 1e-3  # small data, few steps: after 31 steps 3e-4 accepted 0.11, 1e-3 0.22, 2e-3 0.26
    warmup: int = 20  # steps of linear warm-up before the cosine decay
    batch_tokens: int = 4096  # padded tokens per batch
    max_len: int = 640  # longer sequences are cut (their answer's end is dropped)
    draft_vocab: int | None = None  # eagle3: most frequent answer tokens kept (default 8192 or the vocab)
    seed: int = 0
    eval_every: int = 25
    checkpoint_every: int = 25
    max_minutes: float | None = None  # stop (with a checkpoint) after this many minutes of training
    precision: str = "float32"  # bfloat16: the loss computed under autocast (training/families.py PRECISIONS)

    def __post_init__(self):
        if variant(self.method).parallel and self.ttt_steps is not None and self.ttt_steps < 2:
            raise SpecrtError(
                f"--ttt-steps {self.ttt_steps}: a parallel head (peagle) drafts at least 2 tokens a call; give "
                "--ttt-steps 2 or more (default 5), or train --method eagle3 for one token a call"
            )

    @property
    def steps(self) -> int:
        return self.ttt_steps or variant(self.method).ttt_steps


@dataclasses.dataclass
class Sequence:
    tokens: np.ndarray  # (n,) int64: prompt + answer
    features: np.ndarray  # (n - 1, W) float16: the target's features (all its layers) but the last
    prompt_len: int


def held_out_ids(n: int) -> list[int]:
    """The sequences kept out of training when their prompts are not known (a list of token
    sequences): 4 consecutive ones of every 80 (5 %). A prompt set comes in class order (chat,
    code edit, summarization, JSON, chat, ...), so every run of 4 holds out one prompt of each
    class. Fewer than 80: the last 4. Data made from a prompt set is split by source instead
    (prompts.held_out_prompts)."""
    return [i for i in range(n) if i % 80 >= 76] or list(range(max(1, n - 4), n))


class TrainingData:
    """Sequences with their features, split into training and held-out parts: `held` (positions
    in `sequences`), by default held_out_ids."""

    def __init__(
        self, sequences: list[Sequence], target_layers, hidden_size: int, data_hash: str, held: list[int] | None = None
    ):
        if len(sequences) < 2:
            raise SpecrtError(f"{len(sequences)} training sequences; generate at least 2 answers")
        self.target_layers, self.hidden_size, self.data_hash = tuple(target_layers), hidden_size, data_hash
        held = set(held_out_ids(len(sequences)) if held is None else held)
        if not held or len(held) >= len(sequences):
            raise SpecrtError(f"a split of {len(sequences)} sequences holds out {len(held)}; give more prompts")
        self.held_out_ids = sorted(held)
        self.train = [s for i, s in enumerate(sequences) if i not in held]
        self.held_out = [s for i, s in enumerate(sequences) if i in held]

    @classmethod
    def load(
        cls, answers: list[Answer], features: FeatureCache, target_layers, hidden_size: int, prompts=None
    ) -> "TrainingData":
        """`prompts`: the prompt set's file (TrainingDataLayout.prompts), whose sources split the
        answers (prompts.held_out_prompts); without it, held_out_ids."""
        if len(features) < len(answers):
            raise SpecrtError(f"features cached for {len(features)} of {len(answers)} sequences; cache them all first")
        seqs = [
            Sequence(np.asarray(a.tokens, dtype=np.int64), features.sequence(i), len(a.prompt_ids))
            for i, a in enumerate(answers)
        ]
        h = hashlib.sha256(json.dumps([[a.id, a.tokens] for a in answers]).encode()).hexdigest()
        held = None
        if prompts is not None:
            by_id = {p.id: p for p in read_prompt_set(prompts)}
            answered = [by_id[a.id] for a in answers if a.id in by_id]
            if len(answered) == len(answers):
                ids = set(held_out_prompts(answered))
                held = [i for i, a in enumerate(answers) if a.id in ids]
        return cls(seqs, target_layers, hidden_size, f"sha256:{h}", held)

    def answer_token_counts(self, vocab_size: int) -> np.ndarray:
        counts = np.zeros(vocab_size, dtype=np.int64)
        for s in self.train:
            np.add.at(counts, s.tokens[s.prompt_len :], 1)
        return counts


def choose_draft_vocab(counts: np.ndarray, size: int, always: tuple[int, ...] = ()) -> np.ndarray:
    """The `size` most frequent tokens (ties by id), `always` included (end-of-sequence ids)."""
    order = np.lexsort((np.arange(len(counts)), -counts))
    chosen = list(dict.fromkeys([*always, *order.tolist()]))[:size]
    return np.array(sorted(chosen, key=lambda t: (-counts[t], t)), dtype=np.int64)


def length_batches(seqs: list[Sequence], max_len: int, batch_tokens: int) -> list[list[int]]:
    """Batches of sequence indices of similar length (cut at max_len), at most batch_tokens
    padded tokens each."""
    order = sorted(range(len(seqs)), key=lambda i: (min(len(seqs[i].tokens), max_len), i))
    out, cur, longest = [], [], 0
    for i in order:
        m = min(len(seqs[i].tokens), max_len)
        if cur and max(longest, m) * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, m)
    if cur:
        out.append(cur)
    return out


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor  # (B, n) t[j+1]
    feats: torch.Tensor  # (B, n, F) f[j] (the head's layers)
    labels: torch.Tensor  # (B, n) t[j+2], -1 where not scored
    next_feats: torch.Tensor | None  # (B, n, C) f[j+1] at the final normed state (EAGLE-1's regression)
    pos: torch.Tensor  # (B, n)


def make_batch(seqs: list[Sequence], cols: list[int], final_cols: list[int] | None, max_len: int) -> Batch:
    n = max(min(len(s.tokens), max_len) for s in seqs) - 1
    B = len(seqs)
    ids = np.zeros((B, n), np.int64)
    labels = np.full((B, n), -1, np.int64)
    feats = np.zeros((B, n, len(cols)), np.float32)
    nxt = np.zeros((B, n, len(final_cols)), np.float32) if final_cols else None
    for b, s in enumerate(seqs):
        m = min(len(s.tokens), max_len)
        t = s.tokens[:m]
        ids[b, : m - 1] = t[1:]
        j = np.arange(m - 2)
        scored = j + 2 >= s.prompt_len
        labels[b, : m - 2] = np.where(scored, t[2:], -1)
        feats[b, : m - 1] = s.features[: m - 1][:, cols]
        if nxt is not None:  # entry m - 2 has no label (nor the feature after it: features.py)
            nxt[b, : m - 2] = s.features[1 : m - 1][:, final_cols]
    pos = np.broadcast_to(np.arange(n), (B, n)).copy()
    return Batch(
        torch.from_numpy(ids),
        torch.from_numpy(feats),
        torch.from_numpy(labels),
        None if nxt is None else torch.from_numpy(nxt),
        torch.from_numpy(pos),
    )


def ttt_mask(n: int, k: int) -> torch.Tensor:
    """(n, k*n) bool: what entry j may read at unrolled step k (1-based): the target-fed entries
    up to j-k+1, and of each step s = 2..k its entry j-k+s (the draft chain it sits on)."""
    q = torch.arange(n)[:, None]
    key = torch.arange(n)[None, :]
    blocks = [key <= q - (k - 1)]
    blocks += [key == q - (k - s) for s in range(2, k + 1)]
    return torch.cat(blocks, dim=1)


def unrolled(head: DraftHead, batch: Batch, steps: int):
    """Per unrolled step: (hidden (B, n, C), the entries it scores (B, n) bool). A parallel
    head's entries after the first step are its mask entries of that depth (export/parallel_head.py)."""
    B, n = batch.ids.shape
    parallel = head.hc.parallel
    past_k, past_v = head.empty_past(B)
    from_draft = torch.zeros(B, n, dtype=torch.bool)
    prev = torch.zeros(B, n, head.hc.target.hidden_size)
    out = []
    for k in range(1, steps + 1):
        mask = ttt_mask(n, k).unsqueeze(0).expand(B, n, k * n)
        args = (batch.ids, batch.feats, prev, from_draft, batch.pos, mask, past_k, past_v)
        if parallel:
            args += (torch.full((B, n), min(k - 1, parallel), dtype=torch.int64),)
        h, key, value = head.body(*args)
        scored = (batch.labels >= 0) & (torch.arange(n)[None, :] >= k - 1)
        out.append((h, scored))
        past_k, past_v = torch.cat([past_k, key], dim=2), torch.cat([past_v, value], dim=2)
        prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)  # own output, one position on
        from_draft = torch.ones(B, n, dtype=torch.bool)
    return out


class HeadTrainer(Trainer):
    clip = 0.5

    def __init__(self, head: DraftHead, data: TrainingData, cfg: TrainConfig):
        super().__init__(head, data, cfg)
        self.head = head
        C = data.hidden_size
        self.cols = feature_columns(data.target_layers, head.hc.layers, C)
        regress = head.hc.variant.regress_feature  # the next feature: the final normed state's columns
        self.final_cols = feature_columns(data.target_layers, (-1,), C) if regress else None
        V = head.hc.target.vocab_size
        self.t2d = torch.full((V,), -1, dtype=torch.int64)  # target id -> draft row (-1: outside)
        self.t2d[head.draft_to_target] = torch.arange(head.hc.draft_vocab)
        self.batches = self._plan(data.train)
        self.held_batches = self._plan(data.held_out)
        self.planned = max(1, math.ceil(cfg.epochs * len(self.batches)))

    def _plan(self, seqs: list[Sequence]) -> list[list[int]]:
        return length_batches(seqs, self.cfg.max_len, self.cfg.batch_tokens)

    def loss(self, batch: Batch) -> torch.Tensor:
        total = torch.zeros(())
        for k, (h, scored) in enumerate(unrolled(self.head, batch, self.cfg.steps), start=1):
            labels = self.t2d[batch.labels.clamp(min=0)]
            scored = scored & (labels >= 0)
            if not scored.any():
                continue
            logits = self.head.project(h[scored])
            ce = F.cross_entropy(logits, labels[scored])
            if self.head.hc.variant.regress_feature:
                reg = F.smooth_l1_loss(h[scored], batch.next_feats[scored])
                step_loss = reg + 0.1 * ce
            else:
                step_loss = ce
            total = total + STEP_WEIGHT ** (k - 1) * step_loss
        return total

    def advance(self) -> float:
        """One training step on the next batch of the seeded order; returns its loss."""
        epoch, within = divmod(self.step, len(self.batches))
        batch = self.batch_of(self.data.train, self.batches[self.epoch_order(epoch, len(self.batches))[within]])
        return self.optimize(lambda: self.loss(batch))

    @torch.no_grad()
    def evaluate(self, steps: int | None = None) -> dict:
        """Held-out loss, per-step top-1 acceptance and the greedy chain's expected accepted length."""
        steps = steps or (self.cfg.steps if self.head.hc.parallel else max(self.cfg.steps, 3))
        hits, counts, losses = np.zeros(steps), np.zeros(steps), []
        for idx in self.held_batches:
            batch = self.batch_of(self.data.held_out, idx)
            losses.append(float(self.loss(batch)))
            for k, (h, scored) in enumerate(unrolled(self.head, batch, steps)):
                if not scored.any():
                    continue
                top = self.head.draft_to_target[self.head.project(h[scored]).argmax(-1)]
                hits[k] += int((top == batch.labels[scored]).sum())
                counts[k] += int(scored.sum())
        acc = hits / np.maximum(counts, 1)
        return {
            "loss": float(np.mean(losses)),
            "acceptance": [round(float(a), 4) for a in acc],
            "mean_accepted": round(float(1 + np.cumprod(acc).sum()), 4),
        }

    def batch_of(self, seqs: list[Sequence], idx: list[int]) -> Batch:
        return make_batch([seqs[i] for i in idx], self.cols, self.final_cols, self.cfg.max_len)

    # -- checkpoints ------------------------------------------------------------------------

    def weights(self) -> dict:
        trainable = {n: p.detach().clone() for n, p in self.head.named_parameters() if p.requires_grad}
        return {"planned": self.planned, "head": trainable, "draft_to_target": self.head.draft_to_target.clone()}

    def load_weights(self, st: dict) -> None:
        with torch.no_grad():
            params = dict(self.head.named_parameters())
            for n, w in st["head"].items():
                params[n].copy_(w)
            self.head.draft_to_target.copy_(st["draft_to_target"])
        self.planned = st["planned"]

    def identity(self) -> dict:
        return {**super().identity(), "head": self.head.hc.to_dict()}


def new_head(target: LlamaModel, data: TrainingData, cfg: TrainConfig) -> DraftHead:
    V = target.cfg.vocab_size
    v = variant(cfg.method)
    if v.full_vocab:
        hc = HeadConfig(cfg.method, target.cfg, (-1,), V)
        return head_from_target(target, hc, None, cfg.seed)
    from specrt.schema.head_io import eagle3_layers

    size = min(cfg.draft_vocab or 8192, V)
    ids = choose_draft_vocab(data.answer_token_counts(V), size, tuple(target.cfg.eos_token_id))
    layers = eagle3_layers(target.cfg.num_hidden_layers)
    parallel = cfg.steps - 1 if v.parallel else 0
    head = head_from_target(target, HeadConfig(cfg.method, target.cfg, layers, size, parallel), ids, cfg.seed)
    if parallel:
        from specrt.export.parallel_head import init_masks

        seqs = data.train[:16]
        cols = feature_columns(data.target_layers, layers, data.hidden_size)
        with torch.no_grad():
            emb = head.embed_tokens(torch.from_numpy(np.concatenate([s.tokens[s.prompt_len :] for s in seqs])))
            feats = torch.from_numpy(np.concatenate([s.features[:, cols] for s in seqs]).astype(np.float32))
            init_masks(head, emb, head.fc(feats))
    return head


def train_head(
    target: LlamaModel, data: TrainingData, cfg: TrainConfig, out_dir: str | Path, progress: bool = True
) -> tuple[DraftHead, dict]:
    """Train (or resume training) a head in out_dir; returns the head and a report (losses,
    held-out acceptance, time, data size). Stops early at cfg.max_minutes, checkpointed."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    head = new_head(target, data, cfg)
    trainer = HeadTrainer(head, data, cfg)
    run = run_training(trainer, head, cfg, out_dir / CHECKPOINT, f"train {cfg.method}", progress)
    report = run.report(trainer, data, cfg) | {"train_tokens": int(sum(len(s.tokens) for s in data.train))}
    if not head.hc.variant.full_vocab:
        counts = data.answer_token_counts(head.hc.target.vocab_size)
        report["draft_vocab_coverage"] = round(float(counts[head.draft_to_target].sum() / max(1, counts.sum())), 4)
    return head, report


def train_config(method: str, o: TrainOptions) -> TrainConfig:
    """The training config of `method` (eagle, eagle3, mtp, peagle) from train-draft's options."""
    kw = o.given(*COMMON, "batch_tokens", "ttt_steps")
    if not variant(method).full_vocab:  # the others predict the target's whole vocabulary
        kw |= o.given("draft_vocab")
    return TrainConfig(method, **kw)
