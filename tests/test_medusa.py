"""Medusa heads on tiny models: the tree of choices (derived best-first, checked), the heads'
ONNX engine against PyTorch, the proposer's trees against the heads' candidates, training
(held-out loss falls; the tree comes from the measured rank accuracies; resumes), greedy
equality with plain decoding, the sampled distribution (chi-square), refusals, TensorRT-RTX."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from specrt.engines.head import load_head_engine
from specrt.errors import SpecrtError
from specrt.export.checkpoint import load_model
from specrt.export.draft_head import save_head
from specrt.export.medusa import MedusaConfig, medusa_from_target
from specrt.families.medusa import MEDUSA_INPUTS
from specrt.layout import HeadLayout
from specrt.runtime.drafts import DraftInput, make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import SpeculativeDecoder, make_policy
from specrt.schema.head_io import read_head_manifest
from specrt.schema.medusa_tree import DEFAULT_TREE, check_tree, default_tree, derive_tree
from specrt.training.medusa import MedusaTrainConfig, examples, train_medusa
from specrt.training.pipeline import build_draft

from conftest import random_model, save_checkpoint, tiny_hf_config
from test_speculative import SMALL, two_token_pvalue

SMALL_TREE = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))


def make_medusa_dir(checkpoint, out, num_heads=3, draft_vocab=None, top_k=4, seed=0, tree=None, tensorrt="off"):
    """Medusa heads initialised from the target, their blocks randomised (so heads differ), exported and built."""
    target = load_model(checkpoint)
    cfg = target.cfg
    n = draft_vocab or cfg.vocab_size
    ids = np.unique(np.concatenate([[2], np.random.default_rng(seed).permutation(cfg.vocab_size)[:n]]))[:n]
    heads = medusa_from_target(target, MedusaConfig(cfg, num_heads, n, top_k), ids, seed)
    with torch.no_grad():
        for block in heads.blocks:
            block.weight.normal_(0, 0.5)
    layout = HeadLayout(out)
    save_head(heads, layout.weights)
    report = {"target": {"precision": "float32"}, **({"tree": [list(p) for p in tree]} if tree else {})}
    layout.report.write_text(json.dumps(report))
    build_draft(out, checkpoint, tensorrt=tensorrt)
    return layout, heads


@pytest.fixture(scope="module")
def ort_gen(tiny_artifacts):
    return Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")


# -- the tree of choices ------------------------------------------------------------------------


def test_derive_tree_is_best_first_and_prefix_closed():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.3], [0.4]]
    tree = derive_tree(acc, 7)
    value = {p: np.prod([acc[d][r] for d, r in enumerate(p)]) for p in tree}
    assert tree[0] == (0,) and len(tree) == 7
    assert all(value[a] >= value[b] - 1e-12 for a, b in zip(tree, tree[1:]))  # best first
    check_tree(tree, 3, 3)  # every path after its parent: any truncation is a tree
    # the top 7 of all paths by value (exhaustive), since values fall along every path
    paths = [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(2)]
    paths += [(a, b, 0) for a in range(3) for b in range(2)]
    best = sorted((np.prod([acc[d][r] for d, r in enumerate(p)]) for p in paths), reverse=True)[:7]
    assert sorted(value.values(), reverse=True) == pytest.approx(best)
    assert derive_tree([[0.0, 0.0]], 5) == ()  # a head never right proposes nothing
    check_tree(DEFAULT_TREE, 4, 8)


@pytest.mark.parametrize(
    "tree, message",
    [(((0, 0), (0,)), "before its parent"), (((0,), (0,)), "twice"), (((9,),), "does not fit"), (((),), "does not")],
)
def test_bad_trees_are_refused(tree, message):
    with pytest.raises(SpecrtError, match=message):
        check_tree(tree, 2, 4)


# -- the graph and the proposer -----------------------------------------------------------------


def test_engine_matches_the_heads_and_trees_follow_the_candidates(ort_gen, tiny_checkpoint, tmp_path):
    layout, heads = make_medusa_dir(tiny_checkpoint, tmp_path / "m", draft_vocab=64, tree=SMALL_TREE)
    m = read_head_manifest(layout.onnx, verify="full")
    assert m["head"]["method"] == "medusa" and m["inputs"] == list(MEDUSA_INPUTS)
    assert m["ort_parity"]["logits_max_abs"] <= 1e-4 * max(1.0, m["ort_parity"]["logits_scale"])
    session, _, d2t = load_head_engine(layout.ort_engine())
    x = torch.randn(5, heads.hc.target.hidden_size)
    logp, ids = session.run(None, {MEDUSA_INPUTS[0]: x.numpy()})
    want_logp, want_ids = heads(x)
    assert np.abs(logp - want_logp.detach().numpy()).max() < 1e-4 and (ids == want_ids.numpy()).all()
    assert set(ids.ravel()) <= set(d2t.tolist())  # candidates are target ids of the draft vocabulary

    prop = make_proposer("medusa", draft_dir=layout.root, target=ort_gen.session.caps)
    assert prop.tree == SMALL_TREE  # the trained tree (training.json) over the default
    C = heads.hc.target.hidden_size
    width = len(ort_gen.session.caps.hidden_layers) * C
    feats = [np.random.default_rng(i).standard_normal((3, width)).astype(np.float32) for i in range(2)]
    inp = DraftInput([0, 1], [[1, 2, 3], [4, 5]], 5, [100, 3], SamplingParams(), [np.random.default_rng(0)] * 2, feats)
    trees = prop.propose(inp)
    _, ids = heads(torch.from_numpy(np.stack([f[-1, prop.cols] for f in feats])))
    for b, tree in enumerate(trees):
        keep = min(5, inp.budgets[b] - 1)
        assert len(tree) == keep  # the budget N, and a row's token budget, truncate best-first
        for node, path in enumerate(SMALL_TREE[:keep]):
            assert tree.tokens[node] == ids[b, len(path) - 1, path[-1]]
            assert tree.parents[node] == (SMALL_TREE.index(path[:-1]) if len(path) > 1 else -1)


# -- training ------------------------------------------------------------------------------------


def test_examples_align_features_with_the_tokens_k_ahead(training_data):
    s = training_data.train[0]
    x, y = examples([s], list(range(4)), 3)
    j = next(j for j in range(len(s.tokens) - 2) if j + 2 >= s.prompt_len)
    assert np.allclose(x[0], s.features[j][:4])
    assert y[0].tolist() == [int(s.tokens[j + 1 + k]) if j + 1 + k < len(s.tokens) else -1 for k in (1, 2, 3)]
    assert (y[-1] == -1).sum() == 2  # the last position has a label for head 1 only


def test_training_lowers_the_held_out_loss_and_derives_the_tree(training_data, tiny_checkpoint, tmp_path):
    cfg = MedusaTrainConfig(num_heads=3, draft_vocab=64, top_k=4, epochs=6, batch=64, eval_every=1000, tree_size=8)
    heads, report = train_medusa(load_model(tiny_checkpoint), training_data, cfg, tmp_path, progress=False)
    assert report["steps"] == report["planned_steps"] > 6
    assert report["held_out"]["loss"] < 0.9 * report["held_out_before"]["loss"]
    acc = report["held_out"]["rank_accuracy"]
    assert len(acc) == 3 and all(len(r) == 4 for r in acc) and all(0 <= sum(r) <= 1 for r in acc)
    assert report["tree"] == [list(p) for p in derive_tree(acc, 8)]


def test_training_resumes_to_the_same_heads(training_data, tiny_checkpoint, tmp_path, monkeypatch):
    import specrt.training.loop as loop  # the training loop every draft shares (run_training)

    target = load_model(tiny_checkpoint)
    cfg = MedusaTrainConfig(num_heads=2, draft_vocab=64, top_k=4, epochs=2, batch=64, checkpoint_every=1000)
    straight, _ = train_medusa(target, training_data, cfg, tmp_path / "straight", progress=False)
    clock = iter([0.0, *[1e6] * 10_000])
    monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock))
    _, first = train_medusa(
        target, training_data, dataclasses.replace(cfg, max_minutes=1.0), tmp_path / "cut", progress=False
    )
    monkeypatch.undo()
    assert first["stopped"] == "max_minutes" and first["steps"] == 1
    resumed, second = train_medusa(target, training_data, cfg, tmp_path / "cut", progress=False)
    assert second["steps"] == second["planned_steps"]
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    with pytest.raises(SpecrtError, match="another training run"):
        train_medusa(target, training_data, dataclasses.replace(cfg, lr=5e-4), tmp_path / "cut", progress=False)


# -- speculative decoding -----------------------------------------------------------------------


@pytest.mark.parametrize("num_draft", [4, "auto"])
def test_greedy_medusa_equals_plain(ort_gen, tiny_checkpoint, tmp_path, num_draft):
    layout, _ = make_medusa_dir(tiny_checkpoint, tmp_path / "m", top_k=8)
    prompts = [[40, 41, 42], [5, 9, 13, 5, 9, 13, 5, 9], [77]]
    plain = ort_gen.generate_ids(prompts, 40)
    prop = make_proposer("medusa", draft_dir=layout.root, target=ort_gen.session.caps)
    assert prop.tree == default_tree(3, 8) and len(prop.tree) == len(DEFAULT_TREE)
    out = SpeculativeDecoder(ort_gen, prop, make_policy(num_draft)).generate_ids(prompts, 40)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert out[0].metrics.drafted_tokens > 0 and prop.calls > 0


@pytest.mark.parametrize("num_draft", [4, "auto"])
def test_auto_with_medusa_heads_equals_plain(ort_gen, tiny_checkpoint, tmp_path, num_draft):
    """Medusa heads as auto's head member: they draft where no copy does (with a fixed N, every
    such row), greedy output stays plain's; a (TOP_K, DEPTH) tree is refused by name."""
    layout, _ = make_medusa_dir(tiny_checkpoint, tmp_path / "m", top_k=8)
    prompts = [[40, 41, 42], [5, 9, 13, 5, 9, 13, 5, 9], [77]]
    plain = ort_gen.generate_ids(prompts, 40)
    prop = make_proposer("auto", draft_dir=layout.root, target=ort_gen.session.caps)
    out = SpeculativeDecoder(ort_gen, prop, make_policy(num_draft)).generate_ids(prompts, 40)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    if num_draft == 4:
        assert prop.head.head.calls > 0
    with pytest.raises(SpecrtError, match="Medusa heads, which draft their own tree of choices"):
        make_proposer("auto", draft_dir=layout.root, target=ort_gen.session.caps, tree=(4, 6))


def test_sampled_medusa_follows_the_target(tmp_path):
    ckpt = save_checkpoint(random_model(SMALL, seed=4, scale=0.15), SMALL, tmp_path / "ck")
    gen = Generator.from_checkpoint(ckpt)
    gen.eos_ids = frozenset()
    layout, _ = make_medusa_dir(ckpt, tmp_path / "m", num_heads=2, draft_vocab=6, top_k=3, tree=SMALL_TREE[:5])
    spec = SpeculativeDecoder(
        gen, make_proposer("medusa", draft_dir=layout.root, target=gen.session.caps), make_policy(3)
    )
    assert two_token_pvalue(gen, spec, rounds=12, new_tokens=3) > 1e-3


def test_medusa_heads_of_another_target_or_kind_are_refused(ort_gen, tmp_path):
    other = save_checkpoint(random_model(tiny_hf_config(), seed=9), tiny_hf_config(), tmp_path / "other")
    layout, _ = make_medusa_dir(other, tmp_path / "m")
    with pytest.raises(SpecrtError, match="trained for the target checkpoint"):
        make_proposer("medusa", draft_dir=layout.root, target=ort_gen.session.caps)
    layout, _ = make_medusa_dir(ort_gen.checkpoint, tmp_path / "t", num_heads=2, top_k=2)
    with pytest.raises(SpecrtError, match="does not fit 2 heads of 2 candidates"):
        make_proposer("medusa", draft_dir=layout.root, target=ort_gen.session.caps, tree=[(0,), (0, 2)])
    from test_eagle import make_head_dir

    eagle = make_head_dir(ort_gen.checkpoint, "eagle3", tmp_path / "e", draft_vocab=64)
    with pytest.raises(SpecrtError, match="not Medusa heads"):
        make_proposer("medusa", draft_dir=eagle.root, target=ort_gen.session.caps)


def test_medusa_builds_a_tensorrt_rtx_engine(tiny_checkpoint, tmp_path):
    from specrt.engines.head import read_head_trt_manifest

    layout, _ = make_medusa_dir(tiny_checkpoint, tmp_path / "m", tensorrt="tensorrt-rtx")
    m = read_head_trt_manifest(layout.trt_engine("tensorrt-rtx"), verify="full")
    assert [p["name"] for p in m["profiles"]] == ["draft"] and m["head"]["method"] == "medusa"
    from specrt.inspection import inspect_artifact

    lines = inspect_artifact(layout.trt_engine("tensorrt-rtx")).lines
    assert any("profile draft" in line and "batch 1.." in line for line in lines)
    assert any("3 heads of 4 candidates" in line for line in inspect_artifact(layout.ort_engine()).lines)


def test_bfloat16_training_learns_as_float32_does_and_keeps_float32_weights(training_data, tiny_checkpoint, tmp_path):
    """precision="bfloat16" computes the loss under CPU autocast: the held-out loss falls as it
    does in float32 (within 10 %), and the weights (and so the head written) stay float32."""
    target = load_model(tiny_checkpoint)
    cfg = MedusaTrainConfig(num_heads=2, draft_vocab=64, top_k=4, epochs=6, batch=64, eval_every=1000, tree_size=8)
    _, f32 = train_medusa(target, training_data, cfg, tmp_path / "f32", progress=False)
    bf16 = dataclasses.replace(cfg, precision="bfloat16")
    heads, b16 = train_medusa(target, training_data, bf16, tmp_path / "bf16", progress=False)
    assert b16["held_out"]["loss"] < 0.9 * b16["held_out_before"]["loss"]
    assert abs(b16["held_out"]["loss"] - f32["held_out"]["loss"]) < 0.1 * f32["held_out"]["loss"]
    assert {p.dtype for p in heads.parameters()} == {torch.float32}


def test_auto_precision_is_bfloat16_only_where_the_cpu_computes_it():
    from specrt.training.families import resolve_precision

    assert resolve_precision("auto", "fpu avx2 avx512f avx512_bf16 avx512_vnni") == "bfloat16"
    assert resolve_precision("auto", "fpu avx2 amx_bf16 amx_tile") == "bfloat16"
    assert resolve_precision("auto", "fpu avx2 avx512f avx512_vnni") == "float32"
    assert resolve_precision("float32", "avx512_bf16") == "float32"
    assert resolve_precision("bfloat16", "") == "bfloat16"
