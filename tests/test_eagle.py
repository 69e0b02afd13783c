"""EAGLE heads on tiny models: the head's ONNX engine against PyTorch, the proposer against the
head run from scratch, training (loss falls, resumes to the same head), greedy equality with
plain decoding (chains and dynamic trees), the sampled distribution (chi-square), and refusal of
a head that belongs to another target."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from specrt.engines.head import build_head_engine, load_head_engine
from specrt.errors import SpecrtError
from specrt.export.checkpoint import load_model
from specrt.export.draft_head import HeadConfig, head_from_target, load_head, save_head
from specrt.export.head_graph import export_head
from specrt.families.eagle import HEAD_INPUTS
from specrt.layout import HeadLayout
from specrt.runtime.backends import TorchBackend
from specrt.runtime.drafts import make_proposer
from specrt.runtime.drafts.base import DraftInput
from specrt.runtime.generator import Generator
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import SpeculativeDecoder, make_policy
from specrt.schema.head_io import eagle3_layers, read_head_manifest
from specrt.training.eagle import TrainConfig, train_head
from specrt.training.pipeline import build_draft

from conftest import random_model, save_checkpoint, tiny_hf_config
from test_speculative import SMALL, two_token_pvalue

METHODS = ("eagle", "eagle3")


def make_head_dir(
    checkpoint, method, out, draft_vocab=None, seed=0, precision="float32", tensorrt="off", lowest_ids=False
):
    """A head initialised from the target (untrained), exported and built in `out`; an EAGLE-3
    draft vocabulary of random ids (EOS included), or the lowest ids (BPE's most frequent)."""
    target = load_model(checkpoint)
    cfg = target.cfg
    if method == "eagle":
        hc, ids = HeadConfig("eagle", cfg, (-1,), cfg.vocab_size), None
    else:
        n = draft_vocab or cfg.vocab_size
        ids = np.arange(n) if lowest_ids else np.random.default_rng(seed).permutation(cfg.vocab_size)[:n]
        ids = np.unique(np.concatenate([[2], ids]))[:n]  # EOS kept, as training does
        hc = HeadConfig("eagle3", cfg, eagle3_layers(cfg.num_hidden_layers), n)
    head = head_from_target(target, hc, ids, seed)
    layout = HeadLayout(out)
    save_head(head, layout.weights)
    (layout.report).write_text(json.dumps({"target": {"precision": precision}}))
    build_draft(out, checkpoint, tensorrt=tensorrt)
    return layout


@pytest.fixture(scope="module")
def ort_gen(tiny_artifacts):
    return Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")


@pytest.fixture(scope="module", params=METHODS)
def head_dir(request, tiny_checkpoint, tmp_path_factory):
    return make_head_dir(tiny_checkpoint, request.param, tmp_path_factory.mktemp(request.param), draft_vocab=64).root


# -- the head's graph ------------------------------------------------------------------------


def random_head_inputs(head, B=3, Q=4, P=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = head.hc.target
    mask = torch.rand(B, Q, P + Q, generator=g) < 0.6
    mask[:, :, 0] = True
    return (
        torch.randint(0, cfg.vocab_size, (B, Q), generator=g),
        torch.randn(B, Q, head.hc.feature_width, generator=g),
        torch.randn(B, Q, cfg.hidden_size, generator=g),
        torch.rand(B, Q, generator=g) < 0.5,
        torch.arange(Q).repeat(B, 1) + P,
        mask,
        torch.randn(B, cfg.num_key_value_heads, P, cfg.head_dim, generator=g),
        torch.randn(B, cfg.num_key_value_heads, P, cfg.head_dim, generator=g),
    )


def test_head_engine_matches_the_pytorch_head(head_dir):
    """The built engine (ORT-optimized graph) computes what the PyTorch head computes, for a
    ragged, tree-masked step that mixes target features and the head's own hidden states."""
    head = load_head(HeadLayout(head_dir).weights)
    session, manifest, d2t = load_head_engine(HeadLayout(head_dir).ort_engine())
    assert (d2t == head.draft_to_target.numpy()).all()
    inputs = random_head_inputs(head)
    with torch.no_grad():
        want = head(*inputs)
    got = session.run(None, dict(zip(HEAD_INPUTS, (t.numpy() for t in inputs))))
    scale = float(want[0].abs().max())
    assert np.abs(got[0] - want[0].numpy()).max() <= 1e-4 * max(1.0, scale)
    for a, b in zip(got[1:], want[1:]):
        assert np.abs(a - b.numpy()).max() <= 1e-4 * max(1.0, float(b.abs().max()))
    assert manifest["ort_parity"]["logits_max_abs"] <= 1e-4 * max(1.0, manifest["ort_parity"]["logits_scale"])
    # the draft's own hidden state really is used where from_draft is set (else the test is blind)
    flipped = list(inputs)
    flipped[3] = ~inputs[3]
    with torch.no_grad():
        assert not torch.allclose(head(*flipped)[0], want[0])


def reference_chain(head, features, tokens, committed, n):
    """The greedy chain the head drafts after `committed` positions, recomputed from scratch for
    every token (no cache): entries 0..committed-1 read target features, draft entries the
    previous entry's own hidden state."""
    ids, feats, own, from_draft = [], [], [], []
    for j in range(committed):
        ids.append(tokens[j + 1])
        feats.append(features[j])
        own.append(np.zeros(head.hc.target.hidden_size, np.float32))
        from_draft.append(False)
    chain = []
    for _ in range(n):
        Q = len(ids)
        args = (
            torch.tensor([ids]),
            torch.tensor(np.stack(feats)[None]),
            torch.tensor(np.stack(own)[None]),
            torch.tensor([from_draft]),
            torch.arange(Q)[None],
            torch.ones(Q, Q, dtype=torch.bool).tril()[None],
            *head.empty_past(1),
        )
        with torch.no_grad():
            logits, hidden, _, _ = head(*args)
        t = int(head.draft_to_target[int(logits[0, -1].argmax())])
        chain.append(t)
        ids.append(t)
        feats.append(np.zeros(head.hc.feature_width, np.float32))
        own.append(hidden[0, -1].numpy())
        from_draft.append(True)
    return chain


@pytest.mark.parametrize("method", METHODS)
def test_proposer_chain_equals_the_head_run_from_scratch(method, ort_gen, tiny_checkpoint, tmp_path):
    """Catch-up (in two proposals, the second after more committed positions), the head's cache
    and its chain steps give the same greedy chain as the head recomputed from scratch."""
    layout = make_head_dir(tiny_checkpoint, method, tmp_path / method, draft_vocab=64)
    head = load_head(layout.weights)
    prop = make_proposer(method, draft_dir=layout.root, target=ort_gen.session.caps)
    tokens = [5, 9, 13, 21, 34, 55, 89, 3, 7, 11, 19]
    cache = ort_gen.session.new_cache(1, 32)
    feats = ort_gen.session.prefill(cache, [tokens], hidden=True).hidden[0]  # (n, all target layers)
    cols = prop.cols
    prop.begin([0], [tokens[:4]], None)
    for committed, new in ((4, slice(0, 4)), (9, slice(4, 9))):
        inp = DraftInput([0], [tokens[: committed + 1]], 5, [50], SamplingParams(), [np.random.default_rng(0)])
        inp.features = [feats[new]]
        tree = prop.propose(inp)[0]
        assert tree.parents.tolist() == list(range(-1, len(tree) - 1))  # a chain
        assert tree.tokens.tolist() == reference_chain(head, feats[:, cols], tokens, committed, 5)
    prop.end([0], [[]])


# -- training --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_training_lowers_the_held_out_loss(method, training_data, tiny_checkpoint, tmp_path):
    cfg = TrainConfig(method, epochs=4, lr=1e-3, batch_tokens=1024, draft_vocab=64, eval_every=1000)
    head, report = train_head(load_model(tiny_checkpoint), training_data, cfg, tmp_path, progress=False)
    assert report["steps"] == report["planned_steps"] > 4
    assert report["held_out"]["loss"] < 0.9 * report["held_out_before"]["loss"]
    if method == "eagle3":
        assert head.hc.draft_vocab == 64 and 2 in head.draft_to_target.tolist()  # EOS always drafted
        assert 0 < report["draft_vocab_coverage"] <= 1


def test_training_resumes_to_the_same_head(training_data, tiny_checkpoint, tmp_path, monkeypatch):
    """A run stopped after its first steps (checkpointed) and run again ends with the same head
    as an uninterrupted run: the seed fixes initialisation, batch order and schedule."""
    import specrt.training.loop as loop  # the training loop every draft shares (run_training)

    target = load_model(tiny_checkpoint)
    cfg = TrainConfig("eagle3", epochs=2, lr=1e-3, batch_tokens=1024, draft_vocab=64, checkpoint_every=1000)
    straight, _ = train_head(target, training_data, cfg, tmp_path / "straight", progress=False)
    clock = iter([0.0, *[1e6] * 10_000])  # the budget runs out after the first step
    monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock))
    _, first = train_head(
        target, training_data, dataclasses.replace(cfg, max_minutes=1.0), tmp_path / "cut", progress=False
    )
    monkeypatch.undo()
    assert first["stopped"] == "max_minutes" and first["steps"] == 1
    resumed, second = train_head(target, training_data, cfg, tmp_path / "cut", progress=False)
    assert second["steps"] == second["planned_steps"]
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    with pytest.raises(SpecrtError, match="another training run"):
        train_head(target, training_data, dataclasses.replace(cfg, lr=5e-4), tmp_path / "cut", progress=False)


# -- speculative decoding with heads --------------------------------------------------------

PROMPTS = [[40, 41, 42], [5, 9, 13, 5, 9, 13, 5, 9], [77]]


@pytest.mark.parametrize("tree", [None, (3, 4)], ids=["chain", "tree"])
def test_greedy_eagle_equals_plain(head_dir, tree, ort_gen):
    plain = ort_gen.generate_ids(PROMPTS, 40)
    prop = make_proposer(
        read_head_manifest(HeadLayout(head_dir).onnx)["head"]["method"],
        draft_dir=head_dir,
        target=ort_gen.session.caps,
        tree=tree,
    )
    out = SpeculativeDecoder(ort_gen, prop, make_policy(6)).generate_ids(PROMPTS, 40)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    m = out[0].metrics
    assert m.drafted_tokens > 0 and prop.calls > 0
    if tree is not None:
        assert m.drafted_tokens > m.steps  # trees of several nodes were verified


def test_greedy_auto_with_a_head_equals_plain(ort_gen, tiny_checkpoint, tmp_path):
    """--draft auto --draft-dir: with a fixed N the head drafts the rows no copy draft serves
    (one prompt repeats, one does not), catching up on the features of the steps it skipped;
    the output is plain greedy either way."""
    layout = make_head_dir(tiny_checkpoint, "eagle3", tmp_path / "h", draft_vocab=64)
    prompts = [[5, 9, 13, 21, 34] * 6, [77, 78]]
    plain = ort_gen.generate_ids(prompts, 60)
    prop = make_proposer("auto", draft_dir=layout.root, target=ort_gen.session.caps)
    assert prop.needs_features
    out = SpeculativeDecoder(ort_gen, prop, make_policy(4)).generate_ids(prompts, 60)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert prop.chosen["eagle3"] > 0 and prop.chosen["suffix"] + prop.chosen["ngram"] > 0


def test_auto_judges_its_head_by_hindsight(ort_gen, tiny_checkpoint, tmp_path, monkeypatch):
    """With N = auto the head is not verified on a prior: it probes where no copy draft is worth
    verifying (here its time is ~3 tiny target steps, so it only probes), and hindsight reads
    its drafts under their own evidence. Output stays plain greedy."""
    from specrt.runtime.policy import CostModel

    layout = make_head_dir(tiny_checkpoint, "eagle3", tmp_path / "h", draft_vocab=64)
    prompts = [[77, 78], [3, 100, 7]]
    plain = ort_gen.generate_ids(prompts, 80)
    read = []
    real = CostModel.observe_reading
    monkeypatch.setattr(CostModel, "observe_reading", lambda self, r: read.append(r.evidence) or real(self, r))
    prop = make_proposer("auto", draft_dir=layout.root, target=ort_gen.session.caps)
    out = SpeculativeDecoder(ort_gen, prop, make_policy("auto")).generate_ids(prompts, 80)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert prop.head.times.calls and ("eagle3", 0) in read


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    """The chi-square model (vocab 8) as a checkpoint, so a head can be exported against it."""
    ckpt = save_checkpoint(random_model(SMALL, seed=4, scale=0.15), SMALL, tmp_path_factory.mktemp("small") / "ck")
    gen = Generator.from_checkpoint(ckpt)
    gen.eos_ids = frozenset()  # every token counts, EOS included
    return ckpt, gen


@pytest.mark.parametrize("tree", [None, (2, 3)], ids=["chain with q", "tree"])
def test_sampled_eagle_follows_the_target(small_target, tree, tmp_path):
    """Chains sample from the head's distribution (its real q goes to verification); tree
    children are its top-k (point masses). Either way the first two sampled tokens follow the
    target's exact joint distribution (chi-square), and drafts were accepted."""
    ckpt, gen = small_target
    layout = make_head_dir(ckpt, "eagle3", tmp_path / "h", draft_vocab=6)
    prop = make_proposer("eagle3", draft_dir=layout.root, target=gen.session.caps, tree=tree)
    spec = SpeculativeDecoder(gen, prop, make_policy(3))
    assert two_token_pvalue(gen, spec, rounds=12, new_tokens=3) > 1e-3


def test_sampled_auto_with_a_head_follows_the_target(small_target, tmp_path):
    """auto's head chains carry their q through the choice: the first two sampled tokens follow
    the target's joint (chi-square), and the head drafted."""
    ckpt, gen = small_target
    layout = make_head_dir(ckpt, "eagle3", tmp_path / "h", draft_vocab=6)
    prop = make_proposer("auto", draft_dir=layout.root, target=gen.session.caps)
    spec = SpeculativeDecoder(gen, prop, make_policy(3))
    assert two_token_pvalue(gen, spec, rounds=12, new_tokens=3) > 1e-3
    assert prop.chosen["eagle3"] > 0


# -- refusals --------------------------------------------------------------------------------


def test_a_head_of_another_target_or_precision_is_refused(ort_gen, tiny_artifacts, tmp_path):
    other = save_checkpoint(random_model(tiny_hf_config(), seed=9), tiny_hf_config(), tmp_path / "other")
    layout = make_head_dir(other, "eagle3", tmp_path / "h", draft_vocab=64)
    with pytest.raises(SpecrtError, match="trained for the target checkpoint"):
        make_proposer("eagle3", draft_dir=layout.root, target=ort_gen.session.caps)
    ckpt = ort_gen.checkpoint
    layout = make_head_dir(ckpt, "eagle3", tmp_path / "q", draft_vocab=64, precision="float32")
    int8 = dataclasses.replace(ort_gen.session.caps, precision="int8-a8")
    with pytest.raises(SpecrtError, match="trained against the target in float32.*runs int8-a8"):
        make_proposer("eagle3", draft_dir=layout.root, target=int8)
    narrow = dataclasses.replace(ort_gen.session.caps, hidden_layers=(-1,))
    with pytest.raises(SpecrtError, match="re-export the target"):
        make_proposer("eagle3", draft_dir=layout.root, target=narrow)
    with pytest.raises(SpecrtError, match="holds an eagle3 head, not eagle"):
        make_proposer("eagle", draft_dir=layout.root, target=ort_gen.session.caps)
    with pytest.raises(SpecrtError, match="does not exist"):
        make_proposer("eagle3", draft_dir=tmp_path / "nothing", target=ort_gen.session.caps)


def test_a_swapped_draft_vocabulary_map_is_refused(ort_gen, tmp_path):
    layout = make_head_dir(ort_gen.checkpoint, "eagle3", tmp_path / "h", draft_vocab=64)
    d2t = layout.ort_engine() / "draft_to_target.npy"
    np.save(d2t, np.load(d2t)[::-1].copy())
    with pytest.raises(SpecrtError, match="draft_to_target.npy"):
        make_proposer("eagle3", draft_dir=layout.root, target=ort_gen.session.caps, verify="full")


def test_export_needs_a_trained_head(tmp_path, tiny_checkpoint):
    with pytest.raises(SpecrtError, match="holds no draft head"):
        export_head(tmp_path / "none", tmp_path / "onnx", tiny_checkpoint)
    with pytest.raises(SpecrtError):
        build_head_engine(tmp_path / "none", tmp_path / "engine")


def test_target_backend_declares_its_features(tiny_checkpoint):
    backend = TorchBackend(load_model(tiny_checkpoint))
    assert backend.caps.hidden_layers == (0, 1, -1) and backend.caps.precision == "float32"


def test_head_builds_a_tensorrt_rtx_engine_with_draft_profiles(tiny_checkpoint, tmp_path):
    """TensorRT-RTX (installed with the test extra) parses the head's graph and builds an engine
    with a draft and a catch-up profile; inspect checks it and says it needs a GPU to run."""
    from specrt.engines.head import read_head_trt_manifest
    from specrt.inspection import find_artifacts, inspect_artifact

    layout = make_head_dir(tiny_checkpoint, "eagle3", tmp_path / "h", draft_vocab=64, tensorrt="tensorrt-rtx")
    engine = layout.trt_engine("tensorrt-rtx")
    m = read_head_trt_manifest(engine, verify="full")
    assert [p["name"] for p in m["profiles"]] == ["draft", "catch-up"]
    assert m["head"]["method"] == "eagle3" and [i["name"] for i in m["inputs"]] == list(HEAD_INPUTS)
    found = find_artifacts(layout.root)
    assert engine in found and layout.onnx in found and layout.ort_engine() in found
    report = inspect_artifact(engine)
    assert any("profile draft" in line for line in report.lines)
    assert inspect_artifact(layout.ort_engine()).usable


def test_training_data_refuses_other_settings_and_grows(ort_gen, tmp_path):
    """A data directory records how its prompts and target were chosen and refuses other
    settings (naming them); asking for more prompts keeps the answers it has."""
    from specrt.training.pipeline import TrainDraftSpec, prepare_data

    spec = TrainDraftSpec(
        "eagle3", ort_gen.checkpoint, tmp_path / "h", data=tmp_path / "d", prompts=4, max_new_tokens=4, progress=False
    )
    first = prepare_data(ort_gen, spec)
    assert len(first.train) + len(first.held_out) == 4
    with pytest.raises(SpecrtError, match="other settings \\(prompt_source\\)"):
        prepare_data(ort_gen, dataclasses.replace(spec, seed=1))
    lines = (tmp_path / "d" / "answers.jsonl").read_text().splitlines()
    grown = prepare_data(ort_gen, dataclasses.replace(spec, prompts=6))
    assert len(grown.train) + len(grown.held_out) == 6
    assert (tmp_path / "d" / "answers.jsonl").read_text().splitlines()[:4] == lines  # kept, not redone
    # each run that added answers says what made them; a run that added none, nothing
    prepare_data(ort_gen, dataclasses.replace(spec, prompts=6))
    runs = [json.loads(line) for line in (tmp_path / "d" / "runs.jsonl").read_text().splitlines()]
    assert [(r["answers_added"], r["answers"]) for r in runs] == [(4, 4), (2, 6)]
    assert runs[1]["answer_tokens"] == sum(len(s.tokens) - s.prompt_len for s in grown.train + grown.held_out)
    assert runs[0]["commit"] and runs[0]["command"] and runs[0]["engine"]["precision"] == "float32"
    assert runs[0]["batch"] == spec.gen_batch and runs[0]["answer_tokens_per_second"] > 0


def test_make_data_makes_a_corpus_and_extends_it(tiny_checkpoint, tiny_artifacts, tmp_path):
    """`specrt make-data` answers the prompt set without training (answers, features, a runs
    line each run); more --prompts extend it, keeping what it has; a second run on the directory
    and a file in the way are one line each."""
    from click.testing import CliRunner

    from specrt.cli import main
    from specrt.training.data import read_answers
    from specrt.training.features import FeatureStore

    d = tmp_path / "d"
    base = ["make-data", "--model", tiny_checkpoint, "--artifacts", tiny_artifacts, "--data", d]
    base += ["--max-new-tokens", 4, "--hold-out", tmp_path / "none.jsonl"]
    r = CliRunner().invoke(main, [str(a) for a in base + ["--prompts", 3]])
    assert r.exit_code == 0, r.output
    assert "3 answers" in r.output and "runs.jsonl" in r.output
    lines = (d / "answers.jsonl").read_text().splitlines()
    r = CliRunner().invoke(main, [str(a) for a in base + ["--prompts", 5]])
    assert r.exit_code == 0 and "5 answers" in r.output, r.output
    assert (d / "answers.jsonl").read_text().splitlines()[:3] == lines
    store = FeatureStore(d / "features")
    assert all(store.has(a.id, a.tokens) for a in read_answers(d / "answers.jsonl"))
    runs = [json.loads(line) for line in (d / "runs.jsonl").read_text().splitlines()]
    assert [r["answers_added"] for r in runs] == [3, 2] and runs[1]["answers"] == 5
    from specrt.artifacts import exclusive_lock

    with exclusive_lock(d, "a test"):  # another run on the same directory: refused, nothing written
        r = CliRunner().invoke(main, [str(a) for a in base + ["--prompts", 6]])
    assert r.exit_code != 0 and "is being written by pid" in r.output and "another --data" in r.output
    assert len(read_answers(d / "answers.jsonl")) == 5
    (tmp_path / "f").write_text("")
    r = CliRunner().invoke(main, [str(a) for a in base[:5] + ["--data", tmp_path / "f"]])
    assert r.exit_code != 0 and "is a file" in r.output and "Traceback" not in r.output
