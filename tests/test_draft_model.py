"""Draft models on tiny models: the reduced output vocabulary (logits scattered into the whole
vocabulary, exported with ONNX Runtime parity), a draft cut from the target (all layers: the
target itself), distillation (held-out KL falls; train-draft end to end), greedy equality with
plain decoding, the sampled distribution (chi-square), and refusals."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from specrt.engines.build import BuildSpec, build_all
from specrt.errors import SpecrtError
from specrt.export.checkpoint import load_model
from specrt.export.llama import causal_mask
from specrt.layout import ArtifactLayout, HeadLayout
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.speculative import SpeculativeDecoder, make_policy
from specrt.training.draft_model import (
    DraftModelConfig,
    default_draft_layers,
    draft_from_target,
    save_draft_checkpoint,
    train_draft_model,
)

from conftest import TINY_HF, random_model, save_checkpoint, tiny_hf_config
from test_speculative import SMALL, two_token_pvalue


def _logits(model, ids):
    q = ids.shape[1]
    with torch.no_grad():
        return model(ids, torch.arange(q)[None], causal_mask(1, q, 0), model.empty_past(1))[0]


def test_a_draft_of_every_layer_and_token_is_the_target(tiny_checkpoint):
    target = load_model(tiny_checkpoint)
    V = target.cfg.vocab_size
    ids = np.random.default_rng(0).permutation(V)  # a reordered full vocabulary
    draft = draft_from_target(target, range(target.cfg.num_hidden_layers), ids)
    x = torch.tensor([[5, 9, 13, 2, 7]])
    assert torch.allclose(_logits(draft, x), _logits(target, x), atol=1e-5)
    assert default_draft_layers(30) == (0, 1, 28, 29) and default_draft_layers(2) == (0, 1)


def test_reduced_vocabulary_exports_and_keeps_other_tokens_at_zero_probability(tiny_checkpoint, tmp_path):
    target = load_model(tiny_checkpoint)
    ids = np.arange(3, 40)  # 37 tokens
    draft = draft_from_target(target, [1], ids)
    x = torch.tensor([[5, 9, 13, 2, 7]])
    logits = _logits(draft, x)
    assert logits.shape[-1] == target.cfg.vocab_size
    assert set(logits.argmax(-1).ravel().tolist()) <= set(ids.tolist())
    outside = np.setdiff1d(np.arange(target.cfg.vocab_size), ids)
    assert torch.softmax(logits, -1)[..., outside].max() == 0
    ckpt = save_draft_checkpoint(draft, tmp_path / "ckpt", tiny_checkpoint)
    assert json.loads((ckpt / "config.json").read_text())["specrt_output_vocab"] == 37
    assert torch.equal(_logits(load_model(ckpt), x), logits)  # the checkpoint round-trips
    list(build_all(BuildSpec(checkpoint=ckpt, out=tmp_path / "art", tensorrt="off")))
    gen = Generator.from_engine(ArtifactLayout(tmp_path / "art").ort_engine("cpu"))
    cache = gen.session.new_cache(1, 16)
    ort_logits = gen.session.forward(cache, [x[0].tolist()]).logits[0]
    inside = logits[0].numpy()[:, ids]
    assert np.abs(ort_logits[:, ids] - inside).max() <= 1e-4 * np.abs(inside).max()


def test_distillation_lowers_the_held_out_kl(training_data, tiny_checkpoint, tmp_path):
    cfg = DraftModelConfig(layers=(1,), draft_vocab=64, epochs=6, batch_tokens=1024, eval_every=1000)
    draft, report = train_draft_model(load_model(tiny_checkpoint), training_data, cfg, tmp_path, progress=False)
    assert report["steps"] == report["planned_steps"] > 6 and report["layers"] == [1]
    assert report["held_out"]["loss"] < 0.8 * report["held_out_before"]["loss"]
    assert draft.cfg.output_vocab == 64 and 2 in draft.output_ids.tolist()  # EOS always in the vocabulary


@pytest.fixture(scope="module")
def distilled(tiny_checkpoint, tiny_artifacts, tmp_path_factory):
    """train-draft --method draft-model end to end on a few prompts (data, distil, checkpoint, engines)."""
    from specrt.training.pipeline import TrainDraftSpec, train_draft

    out = tmp_path_factory.mktemp("draft-model") / "dm"
    spec = TrainDraftSpec(
        method="draft-model",
        checkpoint=tiny_checkpoint,
        out=out,
        artifacts=tiny_artifacts,
        prompts=12,
        max_new_tokens=16,
        train=DraftModelConfig(layers=(0,), draft_vocab=64, epochs=2, batch_tokens=1024),
        tensorrt="off",
        progress=False,
    )
    report = train_draft(spec)
    return out, report


def test_train_draft_writes_a_checkpoint_and_its_engines(distilled, tiny_checkpoint):
    out, report = distilled
    layout = HeadLayout(out)
    assert report["method"] == "draft-model" and report["target"]["checkpoint_hash"].startswith("sha256:")
    assert load_model(layout.weights).cfg.num_hidden_layers == 1
    assert (layout.ort_engine("cpu") / "manifest.json").is_file() and (layout.weights / "tokenizer.json").is_file()


@pytest.mark.parametrize("which", ["the target itself", "distilled", "an engine directory"])
@pytest.mark.parametrize("num_draft", [3, "auto"])
def test_greedy_draft_model_equals_plain(which, num_draft, distilled, tiny_artifacts):
    gen = Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")
    # an engine directory: the draft's engine named itself (a 4-bit engine of a smaller model)
    draft_dir = {"the target itself": tiny_artifacts, "distilled": distilled[0]}.get(which)
    draft_dir = draft_dir or tiny_artifacts / "engines" / "ort-cpu"
    prompts = [[40, 41, 42], [5, 9, 13, 5, 9, 13, 5, 9], [77]]
    plain = gen.generate_ids(prompts, 30)
    prop = make_proposer("draft-model", draft_dir=draft_dir, target=gen.session.caps)
    out = SpeculativeDecoder(gen, prop, make_policy(num_draft)).generate_ids(prompts, 30)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    m = out[0].metrics
    assert prop.calls > 0 and m.drafted_tokens > 0
    if which != "distilled" and num_draft == 3:  # q = p: every draft is accepted
        assert m.accepted_tokens == m.drafted_tokens


def test_the_draft_cache_grows_by_need_and_keeps_its_rows(tiny_artifacts):
    """The draft's own cache starts at what its rows' prompts need and grows (its entries kept)
    as they lengthen, never to the engine's whole context for every row (0.8 GB a row for the
    0.5B draft). With the target itself as draft (q = p), every drafted token
    is accepted only if the moved entries are right."""
    gen = Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")
    gen.eos_ids = frozenset()
    prop = make_proposer("draft-model", draft_dir=tiny_artifacts, target=gen.session.caps)
    seen = []
    ensure = prop._ensure

    def spy(batch, positions):
        ensure(batch, positions)
        seen.append(prop.cache.capacity)

    prop._ensure = spy
    prompts = [[40, 41, 42], [5, 9, 13, 5, 9]]
    out = SpeculativeDecoder(gen, prop, make_policy(3)).generate_ids(prompts, 180)
    assert [r.token_ids for r in out] == [r.token_ids for r in gen.generate_ids(prompts, 180)]
    m = out[0].metrics
    assert m.drafted_tokens > 0 and m.accepted_tokens == m.drafted_tokens
    assert seen[0] < 100 < max(seen) and len(set(seen)) >= 2  # began small, grew as the rows did


@pytest.mark.parametrize("num_draft", [3, "auto"])
def test_auto_with_a_draft_model_equals_plain(num_draft, tiny_artifacts):
    """A draft model as auto's member (`--draft auto --draft-dir` a smaller model's engine): it
    drafts where no copy does, greedy output stays plain's, and the target returns no features
    for it (a draft model reads tokens only)."""
    gen = Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")
    prompts = [[40, 41, 42], [5, 9, 13, 5, 9, 13, 5, 9], [77]]
    plain = gen.generate_ids(prompts, 30)
    prop = make_proposer("auto", draft_dir=tiny_artifacts / "engines" / "ort-cpu", target=gen.session.caps)
    assert prop.head.name == "draft-model" and prop.head.head.lazy and not prop.needs_features
    out = SpeculativeDecoder(gen, prop, make_policy(num_draft)).generate_ids(prompts, 30)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    # the draft is the target itself (q = p): judged to pay, it drafts under N = auto too
    assert prop.head.head.calls > 0 and prop.chosen["draft-model"] > 0
    with pytest.raises(SpecrtError, match="holds a draft model, which drafts chains: leave out --draft-tree"):
        make_proposer("auto", draft_dir=tiny_artifacts, target=gen.session.caps, tree=(4, 6))


@pytest.mark.parametrize("draft_seed", [4, 11], ids=["q=p", "q!=p"])
def test_sampled_draft_model_follows_the_target(draft_seed, tmp_path):
    """The draft samples from its own distribution (its q goes to verification): the first
    tokens follow the target's exact joint distribution, whether q equals p or not."""
    ckpt = save_checkpoint(random_model(SMALL, seed=4, scale=0.15), SMALL, tmp_path / "target")
    gen = Generator.from_checkpoint(ckpt)
    gen.eos_ids = frozenset()
    draft_ckpt = save_checkpoint(random_model(SMALL, seed=draft_seed, scale=0.15), SMALL, tmp_path / "draft")
    list(build_all(BuildSpec(checkpoint=draft_ckpt, out=tmp_path / "draft-art", tensorrt="off")))
    prop = make_proposer("draft-model", draft_dir=tmp_path / "draft-art", target=gen.session.caps)
    spec = SpeculativeDecoder(gen, prop, make_policy(3))
    assert two_token_pvalue(gen, spec, rounds=12, new_tokens=3) > 1e-3


def test_refusals(distilled, tiny_artifacts, tmp_path):
    gen = Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")
    other = dataclasses.replace(gen.session.caps, checkpoint_hash="sha256:" + "0" * 64)
    with pytest.raises(SpecrtError, match="was distilled for the target checkpoint"):
        make_proposer("draft-model", draft_dir=distilled[0], target=other)
    with pytest.raises(SpecrtError, match="holds no draft model engine"):
        make_proposer("draft-model", draft_dir=tmp_path, target=gen.session.caps)
    wide = tiny_hf_config(vocab_size=TINY_HF["vocab_size"] * 2)
    ckpt = save_checkpoint(random_model(wide, seed=1), wide, tmp_path / "wide")
    list(build_all(BuildSpec(checkpoint=ckpt, out=tmp_path / "wide-art", tensorrt="off")))
    # refused when it is built (before, only once a request ran: a server started with it and
    # failed every request with a 500)
    with pytest.raises(
        SpecrtError, match="vocabulary of 256 tokens, the target's has 128.*share the target's tokenizer"
    ):
        make_proposer("draft-model", draft_dir=tmp_path / "wide-art", target=gen.session.caps)
