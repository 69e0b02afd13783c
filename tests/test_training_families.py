"""The trained-family registry (training/families.py): what train-draft and the pipeline read."""

from __future__ import annotations

import dataclasses

import pytest

from specrt.errors import SpecrtError
from specrt.training.families import TRAINED_FAMILIES, TrainOptions


def test_every_family_makes_its_config_and_names_a_trainer():
    for method, family in TRAINED_FAMILIES.items():
        cfg = family.config(method, TrainOptions())
        assert cfg.method == method and callable(family.train()), method
        assert family.writes in ("head", "model")


def test_options_reach_the_config_and_none_keeps_the_family_default():
    from specrt.training.eagle import TrainConfig
    from specrt.training.medusa import MedusaTrainConfig

    o = TrainOptions(epochs=0.5, lr=2e-3, seed=3, draft_vocab=128, heads=2, ttt_steps=2, batch_tokens=512)
    medusa = TRAINED_FAMILIES["medusa"].config("medusa", o)
    assert (medusa.num_heads, medusa.draft_vocab, medusa.epochs, medusa.seed) == (2, 128, 0.5, 3)
    eagle3 = TRAINED_FAMILIES["eagle3"].config("eagle3", o)
    assert (eagle3.draft_vocab, eagle3.ttt_steps, eagle3.batch_tokens) == (128, 2, 512)
    assert TRAINED_FAMILIES["eagle"].config("eagle", o).draft_vocab is None  # the whole vocabulary
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name != "method"}
    cfg = TRAINED_FAMILIES["eagle3"].config("eagle3", TrainOptions())
    assert {n: getattr(cfg, n) for n in defaults} == defaults
    assert TRAINED_FAMILIES["medusa"].config("medusa", TrainOptions()) == MedusaTrainConfig()


def test_train_draft_offers_the_registry_and_refuses_an_unknown_family():
    from click.testing import CliRunner

    from specrt.cli import main
    from specrt.training.pipeline import trained_family

    out = CliRunner().invoke(main, ["train-draft", "--help"])
    assert out.exit_code == 0 and all(m in out.output for m in TRAINED_FAMILIES)
    with pytest.raises(SpecrtError, match="unknown draft family 'toy'; choose one of eagle"):
        trained_family("toy")


def test_every_head_family_names_its_graph_and_its_module():
    """schema/head_io.py's HEAD_FAMILIES: the I/O the manifest is checked against and the PyTorch
    types load_head makes; a family it does not know is refused with the way to make a head."""
    from specrt.artifacts import ArtifactError
    from specrt.schema.head_io import HEAD_FAMILIES, head_family, head_io

    for method, family in HEAD_FAMILIES.items():
        config, module = family.load_types()
        assert hasattr(config, "from_dict") and callable(module)
        assert head_io(method) == (family.inputs, family.outputs)
    assert HEAD_FAMILIES["eagle3"].cached and not HEAD_FAMILIES["medusa"].cached
    with pytest.raises(ArtifactError, match="unknown head family 'toy'.*specrt train-draft"):
        head_family("toy")


VALUES = {"batch_tokens": 512, "draft_vocab": 128, "ttt_steps": 4, "heads": 2}


@pytest.mark.parametrize("method", list(TRAINED_FAMILIES))
def test_each_family_reads_exactly_the_options_it_declares(method):
    """An option a family declares changes its config; one it does not leaves the config as it
    was (train-draft refuses those: they were silently unused)."""
    family, base = TRAINED_FAMILIES[method], TRAINED_FAMILIES[method].config(method, TrainOptions())
    for name, value in VALUES.items():
        o = TrainOptions(**{name: value})
        changed = family.config(method, o) != base
        assert changed == (name in family.reads), (method, name)
        assert o.unused(method) == ([] if name in family.reads else [name])


@pytest.mark.parametrize(
    "method, extra, message",
    [
        ("medusa", ["--ttt-steps", "3"], "--ttt-steps: --method medusa does not read it (--ttt-steps is for eagle"),
        ("eagle3", ["--medusa-heads", "2"], "--medusa-heads is for medusa"),
        ("eagle", ["--draft-vocab", "64"], "--draft-vocab is for eagle3, peagle, medusa, draft-model"),
        ("mtp", ["--draft-vocab", "64", "--medusa-heads", "3"], "--draft-vocab, --medusa-heads: --method mtp"),
        ("medusa", ["--batch-tokens", "512"], "--batch-tokens: --method medusa does not read it"),
        ("peagle", ["--ttt-steps", "1"], "--ttt-steps 1: a parallel head (peagle) drafts at least 2 tokens a call"),
    ],
)
def test_options_a_method_would_not_use_are_refused_before_any_work(tmp_path, method, extra, message):
    from click.testing import CliRunner

    from specrt.cli import main

    out = tmp_path / "head"
    args = ["train-draft", "--method", method, "--model", str(tmp_path / "no-model"), "--out", str(out), *extra]
    r = CliRunner().invoke(main, args)
    assert r.exit_code in (1, 2) and message in " ".join(r.output.split()), r.output
    assert "Traceback" not in r.output and not out.exists()
