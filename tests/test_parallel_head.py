"""The parallel EAGLE-3 head (P-EAGLE) on tiny models: its engine against PyTorch, one head
call per proposal whose chain equals the head run from scratch, training (the loss falls),
greedy equality with plain decoding (chains, trees, inside auto), the sampled distribution
(chi-square, chains with q and trees)."""

import json

import numpy as np
import pytest
import torch

from specrt.engines.head import head_profiles, load_head_engine
from specrt.engines.profiles import EngineShapes
from specrt.export.checkpoint import load_model
from specrt.export.draft_head import HeadConfig, head_from_target, load_head, save_head
from specrt.families.parallel import PARALLEL_INPUTS
from specrt.layout import HeadLayout
from specrt.runtime.drafts import make_proposer
from specrt.runtime.drafts.base import DraftInput
from specrt.runtime.generator import Generator
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import SpeculativeDecoder, make_policy
from specrt.schema.head_io import eagle3_layers, read_head_manifest
from specrt.training.eagle import TrainConfig, train_head
from specrt.training.pipeline import build_draft

from test_eagle import PROMPTS, random_head_inputs, small_target  # noqa: F401 (a fixture)
from test_speculative import two_token_pvalue

K = 4  # tokens a call drafts: the root's entry and 3 mask depths


def make_parallel_dir(checkpoint, out, draft_vocab=None, seed=0):
    """An untrained parallel head (the target's last layer, random mask entries so that each
    depth drafts something of its own), exported and built in `out`."""
    target = load_model(checkpoint)
    cfg = target.cfg
    n = draft_vocab or cfg.vocab_size
    ids = np.unique(np.concatenate([[2], np.random.default_rng(seed).permutation(cfg.vocab_size)[:n]]))[:n]
    hc = HeadConfig("peagle", cfg, eagle3_layers(cfg.num_hidden_layers), n, parallel=K - 1)
    head = head_from_target(target, hc, ids, seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        head.mask_emb.normal_(0, 1, generator=g)
        head.mask_hidden.normal_(0, 1, generator=g)
    layout = HeadLayout(out)
    save_head(head, layout.weights)
    layout.report.write_text(json.dumps({"target": {"precision": "float32"}}))
    build_draft(out, checkpoint, tensorrt="off")
    return layout


@pytest.fixture(scope="module")
def ort_gen(tiny_artifacts):
    return Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")


@pytest.fixture(scope="module")
def parallel_dir(tiny_checkpoint, tmp_path_factory):
    return make_parallel_dir(tiny_checkpoint, tmp_path_factory.mktemp("peagle"), draft_vocab=64)


def test_engine_matches_the_pytorch_head_and_reads_the_mask_entries(parallel_dir):
    head = load_head(parallel_dir.weights)
    session, manifest, _ = load_head_engine(parallel_dir.ort_engine())
    assert manifest["head"]["parallel"] == K - 1 and manifest["head"]["method"] == "peagle"
    base = random_head_inputs(head)
    depth = torch.randint(0, K, base[0].shape, generator=torch.Generator().manual_seed(1))
    inputs = (*base, depth)
    with torch.no_grad():
        want = head(*inputs)
    got = session.run(None, dict(zip(PARALLEL_INPUTS, (t.numpy() for t in inputs))))
    for a, b in zip(got, want):
        assert np.abs(a - b.numpy()).max() <= 1e-4 * max(1.0, float(b.abs().max()))
    with torch.no_grad():  # a mask entry reads its depth's parameters
        other = head(*base, (depth + 1) % K)[0]
    masked = depth > 0
    assert masked.any() and not torch.allclose(other[masked], want[0][masked])
    # and not its token or feature: entries that see only themselves, all mask entries
    B, Q, P = base[0].shape[0], base[0].shape[1], base[6].shape[2]
    alone = torch.zeros(B, Q, P + Q, dtype=torch.bool)
    alone[:, torch.arange(Q), P + torch.arange(Q)] = True
    with torch.no_grad():
        a = head(*base[:5], alone, *base[6:], torch.ones_like(depth))[0]
        b = head(base[0] + 1, -base[1], *base[2:5], alone, *base[6:], torch.ones_like(depth))[0]
    assert torch.allclose(a, b)


def test_trt_profiles_carry_the_mask_depth(parallel_dir):
    m = read_head_manifest(parallel_dir.onnx)
    for _, shapes in head_profiles(m, EngineShapes()):
        assert set(shapes) == set(PARALLEL_INPUTS)


def reference_drafts(head, features, tokens, committed, n):
    """The greedy draft of n tokens after `committed` positions, the head run from scratch: the
    committed entries, then mask entries of depths 1..n-1, one causal forward."""
    Q = committed + n - 1
    ids = np.zeros(Q, np.int64)
    ids[:committed] = tokens[1 : committed + 1]
    feats = np.zeros((Q, head.hc.feature_width), np.float32)
    feats[:committed] = features[:committed]
    depth = np.zeros(Q, np.int64)
    depth[committed:] = np.arange(1, n)
    args = (
        torch.tensor(ids[None]),
        torch.tensor(feats[None]),
        torch.zeros(1, Q, head.hc.target.hidden_size),
        torch.zeros(1, Q, dtype=torch.bool),
        torch.arange(Q)[None],
        torch.ones(Q, Q, dtype=torch.bool).tril()[None],
        *head.empty_past(1),
        torch.tensor(depth[None]),
    )
    with torch.no_grad():
        logits = head(*args)[0][0, committed - 1 :]
    return head.draft_to_target[logits.argmax(-1)].tolist()


def test_one_call_per_proposal_drafts_what_the_head_computes(parallel_dir, ort_gen):
    head = load_head(parallel_dir.weights)
    prop = make_proposer("peagle", draft_dir=parallel_dir.root, target=ort_gen.session.caps)
    assert not prop.cost_per_token
    tokens = [5, 9, 13, 21, 34, 55, 89, 3, 7, 11, 19]
    cache = ort_gen.session.new_cache(1, 32)
    feats = ort_gen.session.prefill(cache, [tokens], hidden=True).hidden[0]
    prop.begin([0], [tokens[:4]], None)
    for committed, new in ((4, slice(0, 4)), (9, slice(4, 9))):
        calls = prop.calls
        inp = DraftInput([0], [tokens[: committed + 1]], 6, [50], SamplingParams(), [np.random.default_rng(0)])
        inp.features = [feats[new]]
        tree = prop.propose(inp)[0]
        assert prop.calls == calls + 1  # catch-up and K drafts in one call
        assert tree.parents.tolist() == list(range(-1, K - 1))  # K tokens: the call's most
        assert tree.tokens.tolist() == reference_drafts(head, feats[:, prop.cols], tokens, committed, K)
        assert prop.length[0] == committed  # the mask entries were scratch
    prop.end([0], [[]])


def test_training_lowers_the_held_out_loss(training_data, tiny_checkpoint, tmp_path):
    cfg = TrainConfig("peagle", ttt_steps=3, epochs=4, lr=3e-3, batch_tokens=1024, draft_vocab=64, eval_every=1000)
    head, report = train_head(load_model(tiny_checkpoint), training_data, cfg, tmp_path, progress=False)
    assert head.hc.parallel == 2 and len(report["held_out"]["acceptance"]) == 3
    assert report["steps"] == report["planned_steps"] > 4
    assert report["held_out"]["loss"] < 0.9 * report["held_out_before"]["loss"]
    trained = head.mask_hidden.detach()
    assert not torch.allclose(trained[0], trained[1])  # each depth learnt its own mask entry


@pytest.mark.parametrize("tree", [None, (3, 4)], ids=["chain", "tree"])
def test_greedy_parallel_equals_plain(parallel_dir, tree, ort_gen):
    plain = ort_gen.generate_ids(PROMPTS, 40)
    prop = make_proposer("peagle", draft_dir=parallel_dir.root, target=ort_gen.session.caps, tree=tree)
    out = SpeculativeDecoder(ort_gen, prop, make_policy(6)).generate_ids(PROMPTS, 40)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    m = out[0].metrics
    assert m.drafted_tokens > 0 and prop.calls <= m.steps  # one call per step at most
    if tree is not None:
        assert m.drafted_tokens > m.steps


def test_greedy_auto_with_a_parallel_head_equals_plain(parallel_dir, ort_gen):
    prompts = [[5, 9, 13, 21, 34] * 6, [77, 78]]
    plain = ort_gen.generate_ids(prompts, 60)
    prop = make_proposer("auto", draft_dir=parallel_dir.root, target=ort_gen.session.caps)
    assert prop.head.name == "peagle" and not prop.head.times.per_token
    out = SpeculativeDecoder(ort_gen, prop, make_policy(4)).generate_ids(prompts, 60)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert prop.chosen["peagle"] > 0


def test_eagle3_refuses_a_parallel_head(parallel_dir, ort_gen):
    from specrt.errors import SpecrtError

    with pytest.raises(SpecrtError, match="--draft peagle"):
        make_proposer("eagle3", draft_dir=parallel_dir.root, target=ort_gen.session.caps)
    with pytest.raises(SpecrtError, match="not Medusa heads; use --draft peagle$"):  # it advised eagle3
        make_proposer("medusa", draft_dir=parallel_dir.root, target=ort_gen.session.caps)


@pytest.mark.parametrize("tree", [None, (2, 3)], ids=["chain with q", "tree"])
def test_sampled_parallel_follows_the_target(small_target, tree, tmp_path):  # noqa: F811
    """Each depth's token is drawn from that depth's q (which verification gets), or trees of
    top-k point masses: the first two sampled tokens follow the target's exact joint."""
    ckpt, gen = small_target
    layout = make_parallel_dir(ckpt, tmp_path / "h", draft_vocab=6)
    prop = make_proposer("peagle", draft_dir=layout.root, target=gen.session.caps, tree=tree)
    spec = SpeculativeDecoder(gen, prop, make_policy(3))
    assert two_token_pvalue(gen, spec, rounds=12, new_tokens=3) > 1e-3


def test_inspect_names_the_draft_tokens_a_call(parallel_dir):
    from click.testing import CliRunner

    from specrt.cli import main

    r = CliRunner().invoke(main, ["inspect", str(parallel_dir.root)])
    assert r.exit_code == 0, r.output
    assert "peagle: reads target layers" in r.output and f"{K} draft tokens a call" in r.output


def test_one_token_a_call_is_refused_before_any_data_is_made(tiny_checkpoint, tmp_path):
    """--ttt-steps 1 for a parallel head is refused at once (a clear error, not after minutes of
    answers), and nothing is written."""
    from click.testing import CliRunner

    from specrt.cli import main

    out = tmp_path / "p"
    args = ["train-draft", "--method", "peagle", "--ttt-steps", "1", "--model", str(tiny_checkpoint), "--out", str(out)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code != 0 and "at least 2 tokens a call" in r.output and "Traceback" not in r.output
    assert not out.exists()
