"""What a trained draft family declares (specrt/families/__init__.py says how it is used)."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any


def load(ref):
    """The object a reference names ("module:attribute"), or the reference itself."""
    if not isinstance(ref, str):
        return ref
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


DIMS = frozenset(("batch", "q", "past", "kv", "hidden", "features", "kv_heads", "head_dim"))


@dataclasses.dataclass(frozen=True)
class HeadGraph:
    """A head's graph, for the exporters, the engine builders and the proposers: its I/O,
    whether it keeps a KV cache of its own (steps over a past: draft and catch-up profiles) or
    reads one feature per row, and its PyTorch configuration and module.

    What the exporter and the engine builder ask of the two: the module is made from its
    configuration and has `io` (inputs, outputs, dynamic axes), `example_inputs()`,
    `parity_inputs(generator)`, a `draft_to_target` buffer and `hc`, the configuration, with
    `method`, `target` (the ModelConfig), `layers` (the target features it reads),
    `feature_width`, `to_dict()` (holding method, target, layers) and `from_dict`; its forward
    returns a tuple whose first output is floating (the parity check reads it).

    `dims`: each input's dimensions by name, for the engine builder's profiles (engines/head.py):
    "batch", "q" (new positions), "past" (cached positions), "kv" (q + past), "hidden" (the
    target's hidden size), "features" (the head's feature width), "kv_heads", "head_dim"."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    cached: bool
    config: Any  # reference to the configuration class (with from_dict)
    module: Any  # reference to the module class, made from its configuration
    dims: tuple[tuple[str, ...], ...]  # per input, in order: its dimensions' names (above)

    def __post_init__(self):
        if len(self.dims) != len(self.inputs) or not all(set(d) <= DIMS for d in self.dims):
            raise ValueError(f"a head graph names each input's dimensions among {sorted(DIMS)}: {self.dims}")
        if not self.cached and any({"q", "past", "kv"} & set(d) for d in self.dims):
            raise ValueError("a head graph without a cache has no new or past positions in its inputs")

    def load_types(self) -> tuple[type, type]:
        return load(self.config), load(self.module)


@dataclasses.dataclass(frozen=True)
class Training:
    """How `specrt train-draft --method NAME` trains it."""

    config: Any  # reference to config(method, TrainOptions) -> the family's training config (with .method)
    train: Any  # reference to train(target, data, cfg, out_dir, progress) -> (module, report)
    writes: str = "head"  # "head": draft-head weights; "model": a checkpoint of a smaller model
    reads: tuple[str, ...] = ()  # the TrainOptions it reads besides the common ones (others are refused)


@dataclasses.dataclass(frozen=True)
class Drafting:
    """How `--draft NAME --draft-dir DIR` drafts with it."""

    proposer: Any  # reference to the proposer class (or function): (**options) -> Proposer
    about: str  # for --help: what it drafts from
    takes_tree: bool = False  # drafts EAGLE-2 dynamic trees: --draft-tree TOP_K,DEPTH
    fixed: tuple[tuple[str, Any], ...] = ()  # keyword arguments the proposer always gets (e.g. its method)
    in_auto: bool = False  # `--draft auto --draft-dir` takes it as its head (the benchmark runs auto with it)
    own_tree: bool = False  # drafts a tree of its own choosing (Medusa): --draft-tree is refused

    def make(self, **options):
        return load(self.proposer)(**dict(self.fixed), **options)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # --method and --draft
    about: str  # train-draft's --help
    training: Training
    drafting: Drafting
    head: HeadGraph | None = None  # None: it writes a model, built as build-engines builds any
