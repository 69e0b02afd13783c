"""The trained draft families, as `specrt train-draft` sees them: one registry entry each.

    family = TRAINED_FAMILIES["medusa"]
    cfg = family.config("medusa", TrainOptions(epochs=1.0, heads=3))   # the family's config type
    module, report = family.train()(target, data, cfg, out_dir, progress=True)

An entry says what the family is (for --help), how its training config is made from the
command's options (an option left None takes the family's own default), where its trainer is
(imported when training starts, so the CLI's choices cost no torch import), and what training
writes: a head (weights exported and built as a draft head) or a model (a checkpoint, built as
build-engines builds any model). The CLI's --method choices and the pipeline read this registry.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable


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

    def given(self, *names: str) -> dict:
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def unused(self, method: str) -> list[str]:
        """The options given that `method`'s training never reads (train-draft refuses them)."""
        reads = TRAINED_FAMILIES[method].reads
        given = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]
        return [n for n in given if n not in COMMON + reads]


COMMON = ("epochs", "lr", "seed", "max_minutes")


@dataclasses.dataclass(frozen=True)
class TrainedFamily:
    about: str  # for --help
    config: Callable[[str, TrainOptions], object]  # (method, options) -> the family's training config
    trainer: str  # "module:function": train(target, data, cfg, out_dir, progress) -> (module, report)
    writes: str = "head"  # "head": draft-head weights; "model": a checkpoint of a smaller model
    reads: tuple[str, ...] = ()  # the TrainOptions it reads besides COMMON (others given are refused)

    def train(self) -> Callable:
        module, name = self.trainer.split(":")
        return getattr(importlib.import_module(module), name)


def _eagle_config(method: str, o: TrainOptions):
    from specrt.training.eagle import TrainConfig

    kw = o.given(*COMMON, "batch_tokens", "ttt_steps")
    if method in ("eagle3", "peagle"):  # the other methods predict the target's whole vocabulary
        kw |= o.given("draft_vocab")
    return TrainConfig(method, **kw)


def _medusa_config(method: str, o: TrainOptions):
    from specrt.training.medusa import MedusaTrainConfig

    kw = o.given(*COMMON, "draft_vocab")
    if o.heads is not None:
        kw["num_heads"] = o.heads
    return MedusaTrainConfig(**kw)


def _draft_model_config(method: str, o: TrainOptions):
    from specrt.training.draft_model import DraftModelConfig

    return DraftModelConfig(**o.given(*COMMON, "batch_tokens", "draft_vocab"))


_HEAD = "specrt.training.eagle:train_head"
_EAGLE = ("batch_tokens", "ttt_steps")  # eagle and mtp predict the target's whole vocabulary: no draft_vocab
TRAINED_FAMILIES: dict[str, TrainedFamily] = {
    "eagle": TrainedFamily("an EAGLE-1 head", _eagle_config, _HEAD, reads=_EAGLE),
    "eagle3": TrainedFamily("an EAGLE-3 head", _eagle_config, _HEAD, reads=(*_EAGLE, "draft_vocab")),
    "peagle": TrainedFamily(
        "a parallel EAGLE-3 head (P-EAGLE: --ttt-steps tokens per call)",
        _eagle_config,
        _HEAD,
        reads=(*_EAGLE, "draft_vocab"),
    ),
    "mtp": TrainedFamily("an MTP module (DeepSeek-V3 layout)", _eagle_config, _HEAD, reads=_EAGLE),
    "medusa": TrainedFamily(
        "Medusa heads", _medusa_config, "specrt.training.medusa:train_medusa", reads=("draft_vocab", "heads")
    ),
    "draft-model": TrainedFamily(
        "a draft model distilled from the target's layers",
        _draft_model_config,
        "specrt.training.draft_model:train_draft_model",
        writes="model",
        reads=("batch_tokens", "draft_vocab"),
    ),
}
