"""The training loop every draft trainer shares (EAGLE heads, Medusa heads, the distilled draft
model), and what it runs on.

    class MyTrainer(Trainer):                      # a family's trainer: its data and its loss
        def advance(self): return self.optimize(lambda: self.loss(next_batch))
    run = run_training(MyTrainer(module, data, cfg), module, cfg, out / CHECKPOINT, "train mine")

`Trainer` holds AdamW over the module's trainable parameters, the warm-up-cosine schedule, the
optimizer step (learning rate, gradients, clipping), the seeded epoch order, the identity a
checkpoint must match, and saving and resuming (written to a temporary name and renamed).
`run_training` resumes, trains to the planned steps or the time limit, evaluates the held-out
data and checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from pathlib import Path

import numpy as np
import torch

from specrt.errors import SpecrtError

CHECKPOINT = "checkpoint.pt"


def warmup_cosine(step: int, lr: float, warmup: int, planned: int) -> float:
    """The learning rate of every draft trainer: linear warm-up over `warmup` steps, then a
    cosine decay to a tenth of `lr` at step `planned`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, planned - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def save_checkpoint(state: dict, path: Path) -> None:
    """A training checkpoint written to a temporary name and renamed: a run killed while saving
    leaves the previous one whole."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, identity: dict) -> dict:
    """A training checkpoint's state, refused when it belongs to another run (its recorded
    identity: config, data, held-out split, ... differs from `identity`)."""
    import pickle

    try:  # weights_only: tensors, dicts, lists and numbers only; a pickle of anything else runs nothing
        st = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if found is None:  # not a pickle, or cut short
            raise _damaged(path, e) from None
        raise SpecrtError(
            f"{path} names {found.group(1)}, which a specrt training checkpoint never holds (a pickle that would run "
            "code or build objects when loaded), so it was refused and nothing in it ran; delete it to start training "
            f"over (rm {path}), and find out who put it there"
        ) from None
    except Exception as e:  # torch raises RuntimeError, EOFError, ... for a damaged file
        raise _damaged(path, e) from None
    if not isinstance(st, dict) or "identity" not in st:
        raise SpecrtError(f"{path} is not a specrt training checkpoint; delete it to start training over (rm {path})")
    if st["identity"] != identity:
        raise SpecrtError(
            f"{path} is a checkpoint of another training run (other data, method or settings); delete it "
            "to start again, or give the same settings to resume"
        )
    return st


def _damaged(path: Path, e: Exception) -> SpecrtError:
    return SpecrtError(
        f"{path} is damaged ({type(e).__name__}: {str(e)[:120]}), so training cannot resume from it; delete it "
        f"to start training over (rm {path}), or restore it from a copy"
    )


class Trainer:
    """A draft trainer's shared half. The family's trainer sets `planned` (steps in all) and
    writes `advance()` (one step: `self.optimize(loss_fn)`), `evaluate()` (held-out figures:
    acceptance per draft step, mean_accepted), and `weights()` / `load_weights(state)` (what
    of its module a checkpoint keeps)."""

    clip = 1.0  # the gradients' largest norm
    planned: int

    def __init__(self, module: torch.nn.Module, data, cfg):
        self.data, self.cfg = data, cfg
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.step = 0

    def lr_at(self, step: int) -> float:
        return warmup_cosine(step, self.cfg.lr, self.cfg.warmup, self.planned)

    def epoch_order(self, epoch: int, n: int) -> np.ndarray:
        """The seeded order of n batches (or examples) in an epoch."""
        return np.random.default_rng(self.cfg.seed * 1000 + epoch).permutation(n)

    def optimize(self, loss_fn) -> float:
        """One optimizer step on `loss_fn()` at this step's learning rate; returns the loss."""
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step)
        self.opt.zero_grad(set_to_none=True)
        bf16 = getattr(self.cfg, "precision", "float32") == "bfloat16"  # a family's config may not have it
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn()
        loss = loss.float()
        if not torch.isfinite(loss):
            raise self._diverged(f"the training loss is {loss.item()}")
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        if not torch.isfinite(norm):  # before the step: the weights (and the checkpoint) stay finite
            raise self._diverged(f"the gradients' norm is {norm.item()}")
        self.opt.step()
        self.step += 1
        return loss.item()

    def _diverged(self, what: str) -> SpecrtError:
        return SpecrtError(
            f"{what} at step {self.step + 1}: training stopped before it wrote a head of NaN. The training data "
            "holds values that are not finite (a damaged features.bin: delete the data's features directory and "
            "run again; the answers are kept) or the learning rate is too high (give a lower --lr)"
        )

    # -- checkpoints ------------------------------------------------------------------------

    def identity(self) -> dict:
        """What a checkpoint must match to be resumed."""
        c = dataclasses.asdict(self.cfg)
        c.pop("max_minutes")
        if c.get("precision") == "float32":  # a checkpoint from before the option resumes
            c.pop("precision")
        return {"config": c, "data": self.data.data_hash, "held_out": self.data.held_out_ids}

    def weights(self) -> dict:
        raise NotImplementedError

    def load_weights(self, state: dict) -> None:
        raise NotImplementedError

    def save(self, path: Path) -> None:
        state = {"step": self.step, "optimizer": self.opt.state_dict(), "identity": self.identity()}
        save_checkpoint({**self.weights(), **state}, path)

    def load(self, path: Path) -> None:
        st = load_checkpoint(path, self.identity())
        self.load_weights(st)
        self.opt.load_state_dict(st["optimizer"])
        self.step = st["step"]


@dataclasses.dataclass
class Run:
    """What run_training did: why it stopped, the loss history, the held-out figures."""

    stopped: str  # "done" or "max_minutes"
    history: list[dict]
    before: dict | None  # held-out figures before the first step (None: resumed)
    final: dict
    seconds: float

    def report(self, trainer, data, cfg) -> dict:
        """The fields every draft's training report has (the method adds its own)."""
        return {
            "method": cfg.method,
            "stopped": self.stopped,
            "steps": trainer.step,
            "planned_steps": trainer.planned,
            "train_seconds": round(self.seconds, 1),
            "train_sequences": len(data.train),
            "held_out_sequences": len(data.held_out),
            "answer_tokens": int(sum(len(s.tokens) - s.prompt_len for s in data.train)),
            "held_out_before": self.before,
            "held_out": self.final,
            "history": self.history,
            "config": dataclasses.asdict(cfg),
        }


def run_training(trainer, model: torch.nn.Module, cfg, ckpt: Path, desc: str, progress: bool = True) -> Run:
    """The loop every draft trainer shares: resume from `ckpt` when it exists, train until
    trainer.planned steps or cfg.max_minutes, evaluate the held-out data every cfg.eval_every
    steps and at the last one (the progress bar shows the loss, the first draft step's
    acceptance and the chain length), checkpoint every cfg.checkpoint_every steps and at the
    stop. `trainer` has step, planned, advance() -> loss, evaluate() -> {acceptance,
    mean_accepted, ...}, save(path) and load(path)."""
    from tqdm import tqdm

    if ckpt.is_file():
        trainer.load(ckpt)
    evaluation = trainer.evaluate()  # held-out figures for the progress bar, kept current below
    evaluated_at = trainer.step
    before = evaluation if trainer.step == 0 else None
    history, stopped, t0 = [], "done", time.perf_counter()
    bar = tqdm(total=trainer.planned, initial=trainer.step, desc=desc, unit="step", disable=not progress)
    model.train()
    while trainer.step < trainer.planned:
        loss = trainer.advance()
        history.append({"step": trainer.step, "loss": round(loss, 4)})
        if trainer.step % cfg.eval_every == 0 or trainer.step == trainer.planned:
            model.eval()
            evaluation, evaluated_at = trainer.evaluate(), trainer.step
            model.train()
            history[-1]["held_out"] = evaluation
        if trainer.step % cfg.checkpoint_every == 0:
            trainer.save(ckpt)
        bar.update(1)
        bar.set_postfix(
            loss=f"{loss:.3f}", acc=f"{evaluation['acceptance'][0]:.3f}", accepted=f"{evaluation['mean_accepted']:.2f}"
        )
        if cfg.max_minutes is not None and time.perf_counter() - t0 > 60 * cfg.max_minutes:
            stopped = "max_minutes"
            break
    bar.close()
    model.eval()
    trainer.save(ckpt)
    final = evaluation if evaluated_at == trainer.step else trainer.evaluate()
    return Run(stopped, history, before, final, time.perf_counter() - t0)
