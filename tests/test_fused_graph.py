"""The fused step graph (export/fused_graph.py) against the portable graph and PyTorch: the same
logits and features at prefill, decode, ragged rows, trees and after tree compaction; the cache
written in place; a handful of nodes a layer; batch invariance recorded in the manifest.

Every other test that runs `tiny_artifacts`' ORT engine runs the fused graph too (it is what
build-engines builds): greedy speculative output equal to plain for every draft family, the
chi-square tests, continuous batching and the server.
"""

import collections
import json

import numpy as np
import pytest

from specrt.engines.build import BuildSpec, build_all
from specrt.export.checkpoint import load_model
from specrt.layout import ArtifactLayout
from specrt.runtime.backends import TorchBackend
from specrt.runtime.generator import Generator

from conftest import random_model, save_checkpoint, tiny_hf_config

TOL = 1e-4  # of the logits' range: float rounding of the same computation in another order


def steps(session, rng_seed=0):
    """A run through every kind of step on a 2-row cache; returns what each produced, flat."""
    rng = np.random.default_rng(rng_seed)
    V = session.config.vocab_size
    cache = session.new_cache(2, 96)
    first = session.prefill(cache, [rng.integers(3, V, 37).tolist(), rng.integers(3, V, 9).tolist()], hidden=True)
    out = [first.logits, *first.hidden]
    for t in range(3):  # decode, both rows
        o = session.forward(cache, [[5 + t], [9 + t]], hidden=True)
        out += [o.logits, o.hidden_states]
    # a tree on row 0 (root, two children, a grandchild) beside a chain of two on row 1
    depths, mask = np.array([0, 1, 1, 2]), np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    o = session.forward(cache, [[3, 4, 5, 6], [7, 8]], trees=[(depths, mask), None], hidden=True)
    out += [o.logits[0], o.logits[1, :2], o.hidden_states[0], o.hidden_states[1, :2]]
    root = int(cache.lengths[0]) - 4
    cache.keep_path(0, root, [0, 2])  # accept the first child and its child: compacted behind the root
    cache.rollback(cache.lengths - np.array([0, 1]))  # row 1 rejected its last token
    o = session.forward(cache, [[11, 12], [13]])  # a ragged step after both
    out += [o.logits[0], o.logits[1, :1]]
    return out, cache


def compare(a, b):
    for x, y in zip(a, b):
        assert x.shape == y.shape
        assert np.abs(x - y).max() <= TOL * max(float(np.ptp(x)), 1.0), np.abs(x - y).max()


@pytest.fixture(scope="module")
def three(tiny_checkpoint, tiny_artifacts, tiny_portable_artifacts):
    fused = Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")
    portable = Generator.from_engine(tiny_portable_artifacts / "engines" / "ort-cpu")
    torch_gen = Generator(TorchBackend(load_model(tiny_checkpoint)))
    assert fused.backend.flavour == "fused" and portable.backend.flavour == "portable"
    return fused, portable, torch_gen


def test_fused_equals_portable_and_pytorch_at_every_kind_of_step(three):
    fused, portable, torch_gen = three
    got, fused_cache = steps(fused.session)
    want, portable_cache = steps(portable.session)
    compare(got, want)
    compare(got, steps(torch_gen.session)[0])
    # the cache the fused graph wrote in place holds what the portable one appended
    assert fused_cache.lengths.tolist() == portable_cache.lengths.tolist()
    for b, n in enumerate(fused_cache.lengths):
        for buf in ("keys", "values"):
            a, c = getattr(fused_cache, buf)[:, b, :, :n], getattr(portable_cache, buf)[:, b, :, :n]
            assert np.abs(a - c).max() <= 1e-5


def test_the_cache_is_written_in_place_and_nowhere_else(three):
    fused = three[0]
    session = fused.session
    cache = session.new_cache(1, 32)
    session.prefill(cache, [[5, 6, 7, 8]])
    keys, before = cache.keys, cache.keys.copy()
    session.forward(cache, [[9, 10, 11]])
    assert cache.keys is keys  # the same buffers, no copy
    assert np.array_equal(keys[:, :, :, :4], before[:, :, :, :4])  # the past untouched
    assert not np.array_equal(keys[:, :, :, 4:7], before[:, :, :, 4:7])  # the new positions written there
    assert np.array_equal(keys[:, :, :, 7:], before[:, :, :, 7:])  # nothing past them
    assert cache.keys.shape[3] == 32 + session.caps.cache_slack and cache.capacity == 32


def test_a_step_that_does_not_fit_its_buffers_is_refused(three):
    session = three[0].session
    cache = session.new_cache(1, 8)
    session.prefill(cache, [[5, 6, 7, 8, 9, 10, 11]])
    with pytest.raises(ValueError, match="does not fit the cache's buffers"):
        session.forward(cache, [list(range(3, 3 + session.caps.cache_slack + 2))])


def test_a_handful_of_nodes_a_layer(tiny_artifacts):
    import onnx

    graph = onnx.load(str(ArtifactLayout(tiny_artifacts).fused_onnx() / "model.onnx"), load_external_data=False).graph
    layers = 2
    per_layer = collections.Counter(n.op_type for n in graph.node if n.name.startswith("layers.0."))
    assert sum(per_layer.values()) <= 14, per_layer  # a Pad and a Slice: one-position steps' attention
    assert per_layer["GroupQueryAttention"] == 1 and per_layer["MatMul"] == 4  # q|k|v, o, gate|up, down
    # and a few for the embedding, the head and the padded attention inputs (shared by the layers)
    assert len(graph.node) <= 14 * layers + 24
    assert not any(n.op_type == "Concat" and any("past" in i for i in n.input) for n in graph.node)


def test_batch_invariance_is_recorded_and_float_rounding(tiny_artifacts):
    m = json.loads((tiny_artifacts / "engines" / "ort-cpu" / "manifest.json").read_text())
    assert m["graph_flavour"] == "fused"
    assert m["batch_invariance"]["relative"] < 1e-5 and m["batch_invariance"]["positions"] == 17


def test_step_costs_are_measured_at_build_and_seed_the_cost_model(tiny_artifacts):
    """build-engines times steps of 1-17 positions; the speculative decoder's cost model starts
    from them (alpha, beta of their line) instead of the generic priors."""
    from specrt.runtime.generator import Generator

    m = json.loads((tiny_artifacts / "engines" / "ort-cpu" / "manifest.json").read_text())
    assert sorted(int(q) for q in m["step_ms"]) == [1, 2, 3, 5, 9, 17] and min(m["step_ms"].values()) > 0
    gen = Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")
    assert gen.session.caps.step_ms == {int(q): ms for q, ms in m["step_ms"].items()}


@pytest.mark.parametrize(
    "overrides", [{"tie_word_embeddings": True}, {"attention_bias": True}], ids=["tied-embedding", "qkv-bias"]
)
def test_model_variants_equal_pytorch(tmp_path, overrides):
    """A tied embedding (stored once: looked up from the head's W^T) and q/k/v biases (Qwen2)."""
    cfg = tiny_hf_config(**overrides)
    model = random_model(cfg, seed=4)
    if overrides.get("attention_bias"):
        import torch

        with torch.no_grad():
            for layer in model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.copy_(0.3 * torch.randn_like(proj.bias))
    ckpt = save_checkpoint(model, cfg, tmp_path / "ckpt")
    list(build_all(BuildSpec(checkpoint=ckpt, out=tmp_path / "art", tensorrt="off")))
    fused = Generator.from_engine(tmp_path / "art" / "engines" / "ort-cpu")
    assert fused.backend.flavour == "fused"
    compare(steps(fused.session)[0], steps(Generator(TorchBackend(load_model(ckpt))).session)[0])


def test_inspect_names_the_flavour_and_tensorrt_refuses_the_fused_graph(tiny_artifacts, tmp_path):
    from click.testing import CliRunner

    from specrt.cli import main
    from specrt.engines.trt import build_trt_engine
    from specrt.errors import SpecrtError

    r = CliRunner().invoke(main, ["inspect", str(tiny_artifacts)])
    assert "graph       fused (version" in r.output and "CPUExecutionProvider, measured on" in r.output
    assert "portable graph" not in r.output.split("[ort-engine]")[1].split("\n\n")[0]
    if (tiny_artifacts / "engines" / "trt-tensorrt-rtx").is_dir():  # built from the standard graph
        assert (
            "graph       standard (version" in r.output and "SM120+ (the library default), standard graph" in r.output
        )
    with pytest.raises(SpecrtError, match="TensorRT builds from the standard or the portable one"):
        build_trt_engine(ArtifactLayout(tiny_artifacts).fused_onnx(), tmp_path / "trt")
