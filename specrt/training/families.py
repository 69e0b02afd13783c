"""The trained draft families, as `specrt train-draft` sees them: one registry entry each, read
from the families' declarations (specrt/families/).

    family = TRAINED_FAMILIES["medusa"]
    cfg = family.config("medusa", TrainOptions(epochs=1.0, heads=3))   # the family's config type
    module, report = family.train()(target, data, cfg, out_dir, progress=True)

An entry says what the family is (for --help), how its training config is made from the
command's options (an option left None takes the family's own default), where its trainer is
(imported when training starts, so the CLI's choices cost no torch import), and what training
writes: a head (weights exported and built as a draft head) or a model (a checkpoint, built as
build-engines builds any model). The CLI's --method choices and the pipeline read this registry;
each family's config function lives beside its trainer (training/eagle.py, medusa.py,
draft_model.py: `train_config`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from specrt.families import Family, View, load


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """train-draft's training options; None: the family's default."""

    epochs: float | None = None
    lr: float | None = None
    seed: int | None = None
    max_minutes: float | None = None
    batch_tokens: int | None = None
    draft_vocab: int | None = None
    ttt_steps: int | None = None  # EAGLE and MTP: unrolled draft steps
    heads: int | None = None  # Medusa: heads (K)
    precision: str | None = None  # float32 or bfloat16 (PRECISIONS, resolve_precision)

    def given(self, *names: str) -> dict:
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def unused(self, method: str) -> list[str]:
        """The options given that `method`'s training never reads (train-draft refuses them)."""
        reads = TRAINED_FAMILIES[method].reads
        given = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]
        return [n for n in given if n not in COMMON + reads]


COMMON = ("epochs", "lr", "seed", "max_minutes", "precision")

# what a trainer computes its loss in: bfloat16 runs the forward (and so the backward) under CPU
# autocast, the weights and AdamW's state staying float32. EAGLE-3 on the 1.5B took 16.1 s a step
# against 33.2 in float32 on a Zen 4 (AVX-512 BF16), its losses the same to 3-4 digits, its peak
# 14.4 GB against 11.9 (bench/results/train-precision-2026-12-07-qwen2.5-coder-1.5b-eagle3.json);
# where the CPU lacks bfloat16 instructions oneDNN emulates them, so "auto" takes float32 there
PRECISIONS = ("auto", "float32", "bfloat16")  # train-draft --precision (Trainer.optimize reads the config's)
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs that compute bfloat16


def resolve_precision(precision: str, flags: str | None = None) -> str:
    """ "auto": bfloat16 where the CPU has bfloat16 instructions (`flags`: /proc/cpuinfo's), else
    float32; the others as given."""
    if precision != "auto":
        return precision
    if flags is None:
        try:
            with open("/proc/cpuinfo") as fh:
                flags = next((ln for ln in fh if ln.startswith("flags")), "")
        except OSError:
            flags = ""
    return "bfloat16" if any(f in flags.split() for f in NATIVE_BF16) else "float32"


@dataclasses.dataclass(frozen=True)
class TrainedFamily:
    about: str  # for --help
    config: Callable[[str, TrainOptions], object]  # (method, options) -> the family's training config
    trainer: object  # reference: train(target, data, cfg, out_dir, progress) -> (module, report)
    writes: str = "head"  # "head": draft-head weights; "model": a checkpoint of a smaller model
    reads: tuple[str, ...] = ()  # the TrainOptions it reads besides COMMON (others given are refused)

    def train(self) -> Callable:
        return load(self.trainer)


def _trained(family: Family) -> TrainedFamily:
    t = family.training
    return TrainedFamily(family.about, lambda method, o: load(t.config)(method, o), t.train, t.writes, t.reads)


TRAINED_FAMILIES = View(_trained)  # every family's trainer (specrt/families/: one unit per family)
