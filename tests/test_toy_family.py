"""A new trained draft family is its own code and one declaration: this file defines a toy one
(one linear layer from the target's final normed state to the token after the next) and
registers one `Family` (specrt/families/); the runtime's, the trainers' and the head graphs'
registries read it from there, train-draft makes its data, trains it, exports and builds it,
and the runtime drafts with it, with no edit to the CLI, the pipeline, the exporter, the engine
builder, the benchmark or inspect."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from specrt.engines.head import open_head
from specrt.families import Drafting, Family, HeadGraph, Training, register, unregister
from specrt.runtime.drafts import DRAFT_METHODS, make_proposer
from specrt.runtime.verification import DraftTree
from specrt.schema.config import ModelConfig
from specrt.schema.head_io import HEAD_FAMILIES, check_head_target, feature_columns
from specrt.training.families import COMMON, TRAINED_FAMILIES
from specrt.training.loop import CHECKPOINT, Trainer, run_training

TOY = "toy"
TOY_IO = (("features",), ("logits",), {"features": {0: "batch"}, "logits": {0: "batch"}})


# -- export: the head's configuration and module ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    target: ModelConfig
    method: str = TOY
    layers = (-1,)

    @property
    def feature_width(self) -> int:
        return self.target.hidden_size

    def to_dict(self) -> dict:
        t = self.target
        return {"method": self.method, "target": t.to_dict(), "layers": list(self.layers), "draft_vocab": t.vocab_size}

    @classmethod
    def from_dict(cls, d: dict) -> "ToyConfig":
        return cls(ModelConfig.from_dict(d["target"]))


class ToyHead(torch.nn.Module):
    io = TOY_IO

    def __init__(self, hc: ToyConfig):
        super().__init__()
        self.hc = hc
        self.proj = torch.nn.Linear(hc.target.hidden_size, hc.target.vocab_size)
        self.register_buffer("draft_to_target", torch.arange(hc.target.vocab_size, dtype=torch.int64))

    def forward(self, features):
        return (self.proj(features),)

    def example_inputs(self):
        return (torch.zeros(2, self.hc.target.hidden_size),)

    def parity_inputs(self, g: torch.Generator):
        return (torch.randn(3, self.hc.target.hidden_size, generator=g),)


# -- training: its config and trainer ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToyTrainConfig:
    method: str = TOY
    epochs: float = 3.0
    lr: float = 3e-3
    warmup: int = 2
    seed: int = 0
    eval_every: int = 1000
    checkpoint_every: int = 1000
    max_minutes: float | None = None
    precision: str = "float32"


class ToyTrainer(Trainer):
    def __init__(self, head: ToyHead, data, cfg: ToyTrainConfig):
        super().__init__(head, data, cfg)
        self.head = head
        cols = feature_columns(data.target_layers, (-1,), data.hidden_size)
        self.x, self.y = self.examples(data.train, cols)
        self.hx, self.hy = self.examples(data.held_out, cols)
        self.planned = max(1, int(cfg.epochs * 4))

    @staticmethod
    def examples(seqs, cols):
        """The feature at j and the token after the next, t[j+2], inside the answer."""
        x, y = [], []
        for s in seqs:
            j = np.arange(len(s.tokens) - 2)
            j = j[j + 2 >= s.prompt_len]
            x.append(np.asarray(s.features[j][:, cols], np.float32))
            y.append(np.asarray(s.tokens)[j + 2])
        return torch.from_numpy(np.concatenate(x)), torch.from_numpy(np.concatenate(y))

    def advance(self) -> float:
        rows = self.epoch_order(self.step, len(self.x))[:256]
        return self.optimize(lambda: torch.nn.functional.cross_entropy(self.head(self.x[rows])[0], self.y[rows]))

    @torch.no_grad()
    def evaluate(self) -> dict:
        logits = self.head(self.hx)[0]
        a = float((logits.argmax(-1) == self.hy).float().mean())
        loss = float(torch.nn.functional.cross_entropy(logits, self.hy))
        return {"loss": loss, "acceptance": [round(a, 4)], "mean_accepted": round(1 + a, 4)}

    def weights(self) -> dict:
        return {"head": self.head.state_dict()}

    def load_weights(self, st: dict) -> None:
        self.head.load_state_dict(st["head"])


def train_toy(target, data, cfg: ToyTrainConfig, out_dir, progress: bool = True):
    torch.manual_seed(cfg.seed)
    head = ToyHead(ToyConfig(target.cfg))
    trainer = ToyTrainer(head, data, cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = run_training(trainer, head, cfg, out_dir / CHECKPOINT, "train toy", progress)
    return head, run.report(trainer, data, cfg)


# -- runtime: the proposer --------------------------------------------------------------------------


class ToyProposer:
    name, needs_features, cost_per_token, lookup = TOY, True, False, False

    def __init__(self, draft_dir, target):
        self.head = open_head(draft_dir)
        m = self.head.manifest
        check_head_target(m, target.checkpoint_hash, target.precision, str(draft_dir))
        self.cols = feature_columns(target.hidden_layers, m["head"]["layers"], m["config"]["hidden_size"])
        self.calls = 0

    def begin(self, rows, prompts, prefilled):
        pass

    def propose(self, inp):
        feats = np.stack([f[-1, self.cols] for f in inp.features]).astype(np.float32)
        (logits,) = self.head.run({"features": feats})
        self.calls += 1
        return [DraftTree.chain(logits[i].argmax(-1, keepdims=True)) for i in range(len(inp.rows))]

    def commit(self, rows, trees, verdicts, step):
        pass

    def end(self, rows, outputs):
        pass


# -- the family's one declaration, and the family end to end ------------------------------------------


@pytest.fixture
def toy_family():
    family = Family(
        TOY,
        "a toy head",
        Training(lambda method, o: ToyTrainConfig(**o.given(*COMMON)), train_toy),
        Drafting(ToyProposer, "a toy head in --draft-dir"),
        HeadGraph(*TOY_IO[:2], False, ToyConfig, ToyHead, (("batch", "hidden"),)),
    )
    register(family)
    yield family
    unregister(TOY)
    assert TOY not in DRAFT_METHODS and TOY not in TRAINED_FAMILIES and TOY not in HEAD_FAMILIES


def test_a_new_family_trains_exports_builds_and_drafts(toy_family, tiny_checkpoint, tiny_artifacts, tmp_path):
    from specrt.layout import HeadLayout
    from specrt.runtime.generator import Generator
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy
    from specrt.training.pipeline import TrainDraftSpec, train_draft

    out = tmp_path / "toy"
    spec = TrainDraftSpec(
        method=TOY,
        checkpoint=tiny_checkpoint,
        out=out,
        artifacts=tiny_artifacts,
        prompts=12,
        max_new_tokens=16,
        tensorrt="off",
        progress=False,
    )
    assert DRAFT_METHODS[TOY].needs_draft_dir and TRAINED_FAMILIES[TOY].about == "a toy head"
    assert HEAD_FAMILIES[TOY].load_types() == (ToyConfig, ToyHead)
    report = train_draft(spec)
    assert report["method"] == TOY and report["steps"] == report["planned_steps"] > 0
    assert (HeadLayout(out).ort_engine("cpu") / "manifest.json").is_file()

    gen = Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")
    prompts = [[40, 41, 42], [5, 9, 13, 5, 9, 13, 5, 9], [77]]
    plain = gen.generate_ids(prompts, 24)
    proposer = make_proposer(TOY, draft_dir=out, target=gen.session.caps)
    spec_out = SpeculativeDecoder(gen, proposer, make_policy(1)).generate_ids(prompts, 24)
    assert [r.token_ids for r in spec_out] == [r.token_ids for r in plain]
    assert proposer.calls > 0 and spec_out[0].metrics.drafted_tokens > 0


def test_a_cached_head_gets_its_profiles_from_its_declared_graph(tiny_checkpoint):
    """The toy family once cached, with inputs unlike EAGLE's (names, order, count): the engine
    builder's TensorRT profiles (draft and catch-up) shape each input from the dimensions its
    graph declares, with no edit to the builder; a graph naming an unknown dimension is refused."""
    from specrt.engines.head import head_profiles
    from specrt.engines.profiles import EngineShapes
    from specrt.schema.config import ModelConfig

    cached = HeadGraph(
        ("past_state", "tokens", "features"),
        ("logits", "present_state"),
        True,
        ToyConfig,
        ToyHead,
        (("batch", "kv_heads", "past", "head_dim"), ("batch", "q"), ("batch", "q", "features")),
    )
    register(Family(TOY, "a toy head", Training(ToyTrainConfig, train_toy), Drafting(ToyProposer, "a toy"), cached))
    try:
        cfg = ModelConfig.from_json_file(tiny_checkpoint / "config.json").to_dict()
        manifest = {"config": cfg, "head": {"method": TOY, "feature_width": 3 * cfg["hidden_size"]}}
        shapes = EngineShapes(max_batch=4, max_context=256, max_prefill=64, max_verify=9)
        profiles = dict(head_profiles(manifest, shapes))
    finally:
        unregister(TOY)
    assert set(profiles) == {"draft", "catch-up"}
    draft, catch_up = profiles["draft"], profiles["catch-up"]
    assert list(draft) == ["past_state", "tokens", "features"]
    assert draft["tokens"] == ((1, 1), (1, 4), (4, 9)) and catch_up["tokens"][2] == (4, 64)
    assert draft["features"][2] == (4, 9, 3 * cfg["hidden_size"])
    assert draft["past_state"][2] == (4, cfg["num_key_value_heads"], 256 + 9, cfg["head_dim"])
    with pytest.raises(ValueError, match="dimensions"):
        HeadGraph(("x",), ("y",), True, ToyConfig, ToyHead, (("batch", "width"),))
