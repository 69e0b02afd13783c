"""The exported step graph: checker, manifest, and ONNX Runtime against PyTorch.

Parity tolerance: max |ORT - PyTorch| <= 1e-4 on logits (tiny model, |logits| ~ 1-10) and 1e-5 on KV.
"""

import json

import numpy as np
import onnx
import pytest
import torch

from specrt.engines.ort import load_ort_session
from specrt.export.checkpoint import checkpoint_hash, load_model
from specrt.runtime.backends import OrtBackend, TorchBackend
from specrt.runtime.generator import Generator
from specrt.runtime.kv_cache import KVCache

ATOL_LOGITS = 1e-4
ATOL_KV = 1e-5


@pytest.fixture(scope="module")
def backends(tiny_checkpoint, tiny_portable_artifacts):
    """The portable graph's engine (its I/O is what these tests feed; the fused graph has its own
    tests, test_fused_graph.py) and the PyTorch model in the form the export traces."""
    session, manifest, provider = load_ort_session(tiny_portable_artifacts / "engines" / "ort-cpu")
    ort_backend = OrtBackend.from_manifest(session, manifest, provider)
    return ort_backend, TorchBackend(load_model(tiny_checkpoint), in_place=False)


def new_cache(cfg, batch, capacity):
    return KVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, capacity, cfg.head_dim)


def run_both(backends, ids, positions, mask_fn, prefix=None, capacity=128):
    """Run the same step on ORT and torch, each on its own cache holding `prefix` tokens first."""
    outs = []
    for backend in backends:
        gen = Generator(backend)
        cache = new_cache(backend.config, ids.shape[0], capacity)
        if prefix is not None:
            gen.session.forward(cache, [list(p) for p in prefix])
        mask = mask_fn(cache)
        index = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()
        outs.append(backend.step(ids, positions, mask, index, cache, hidden_index=index))
    return outs


def assert_close(a, b):
    assert np.abs(a.logits - b.logits).max() <= ATOL_LOGITS
    assert np.abs(a.hidden_states - b.hidden_states).max() <= ATOL_LOGITS
    for (ka, va), (kb, vb) in zip(a.present, b.present):
        assert np.abs(ka - kb).max() <= ATOL_KV and np.abs(va - vb).max() <= ATOL_KV


def test_onnx_passes_full_check_and_manifest_is_complete(tiny_checkpoint, tiny_artifacts):
    onnx_dir = tiny_artifacts / "onnx"
    onnx.checker.check_model(str(onnx_dir / "model.onnx"), full_check=True)
    m = json.loads((onnx_dir / "manifest.json").read_text())
    assert m["kind"] == "onnx-step-graph"
    assert m["checkpoint"]["hash"] == checkpoint_hash(tiny_checkpoint)
    assert m["inputs"][:4] == ["input_ids", "position_ids", "attention_mask", "logits_index"]
    assert m["inputs"][4:6] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert m["graph_version"] == 2 and m["dynamic_axes"]["logits"] == {"0": "batch", "1": "n_logits"}
    assert m["outputs"][:4] == ["logits", "hidden_states", "present.0.key", "present.0.value"]
    assert m["dynamic_axes"]["past_key_values.0.key"] == {"0": "batch", "2": "past_len"}
    assert m["opset"] == 17 and m["versions"]["torch"] and m["versions"]["onnx"]
    assert m["config"]["num_hidden_layers"] == 2
    proto = onnx.load(str(onnx_dir / "model.onnx"), load_external_data=False)
    dims = [d.dim_param or d.dim_value for d in proto.graph.input[2].type.tensor_type.shape.dim]
    assert dims == ["batch", "q_len", "kv_len"]


def test_prefill_64(backends):
    ids = np.random.default_rng(0).integers(0, 128, (1, 64))
    pos = np.arange(64)[None]
    a, b = run_both(backends, ids, pos, lambda c: c.attention_mask(64))
    assert_close(a, b)


def test_decode_one_token_at_past_64(backends):
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 128, (1, 64))
    a, b = run_both(backends, rng.integers(0, 128, (1, 1)), np.array([[64]]), lambda c: c.attention_mask(1), prefix)
    assert_close(a, b)


def test_verify_5_positions_at_past_64(backends):
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, 128, (1, 64))
    a, b = run_both(
        backends, rng.integers(0, 128, (1, 5)), np.arange(64, 69)[None], lambda c: c.attention_mask(5), prefix
    )
    assert_close(a, b)


def test_empty_past_runs(backends):
    """P = 0 (capacity 0) is a valid shape for the graph."""
    ids = np.array([[5, 6, 7]])
    a, b = run_both(backends, ids, np.arange(3)[None], lambda c: c.attention_mask(3), capacity=0)
    assert_close(a, b)


def test_tree_mask_two_branches_matches_chains(backends):
    """Root r with branches (a1, a2) and (b1, b2), verified in one pass with a tree mask, gives
    the logits of the two chains r a1 a2 and r b1 b2 run separately."""
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 128, (1, 20))
    r, a1, a2, b1, b2 = (int(x) for x in rng.integers(0, 128, 5))
    tree_ids = np.array([[r, a1, a2, b1, b2]])
    tree_pos = np.array([[20, 21, 22, 21, 22]])
    parents = [-1, 0, 1, 0, 3]
    tree = np.zeros((5, 5), dtype=bool)
    for i in range(5):
        j = i
        while j != -1:
            tree[i, j] = True
            j = parents[j]
    tree_out = run_both(backends, tree_ids, tree_pos, lambda c: c.attention_mask(5, tree), prefix)
    assert_close(*tree_out)
    for chain, rows in (([r, a1, a2], [0, 1, 2]), ([r, b1, b2], [0, 3, 4])):
        chain_out = run_both(
            backends, np.array([chain]), np.arange(20, 23)[None], lambda c: c.attention_mask(3), prefix
        )
        for t, c in zip(tree_out, chain_out):
            assert np.abs(t.logits[0, rows] - c.logits[0]).max() <= ATOL_LOGITS


def test_batch_of_two_different_lengths(backends):
    """Ragged batch (prompts of 10 and 6 tokens, then a decode step) equals each row run alone."""
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(0, 128, 10)), list(rng.integers(0, 128, 6))]
    nxt = [[int(rng.integers(0, 128))], [int(rng.integers(0, 128))]]
    for backend in backends:
        gen = Generator(backend)
        cache = new_cache(backend.config, 2, 32)
        batch_prefill = gen.session.forward(cache, prompts)
        batch_decode = gen.session.forward(cache, nxt)
        assert cache.lengths.tolist() == [11, 7]
        for b in range(2):
            single = new_cache(backend.config, 1, 32)
            p = gen.session.forward(single, [prompts[b]])
            d = gen.session.forward(single, [nxt[b]])
            n = len(prompts[b])
            assert np.abs(batch_prefill.logits[b, :n] - p.logits[0]).max() <= ATOL_LOGITS
            assert np.abs(batch_decode.logits[b, 0] - d.logits[0, 0]).max() <= ATOL_LOGITS
            assert np.abs(cache.keys[:, b, :, : 11 if b == 0 else 7] - single.keys[:, 0, :, : n + 1]).max() <= ATOL_KV
    ort_gen, torch_gen = Generator(backends[0]), Generator(backends[1])
    caches = [new_cache(backends[0].config, 2, 32) for _ in range(2)]
    a = ort_gen.session.forward(caches[0], prompts)
    b = torch_gen.session.forward(caches[1], prompts)
    for row, n in enumerate((10, 6)):
        assert np.abs(a.logits[row, :n] - b.logits[row, :n]).max() <= ATOL_LOGITS


def test_export_is_atomic_on_failure(tiny_checkpoint, tmp_path, monkeypatch):
    """A failing export leaves the previous artifact in place and no temporary directory behind."""
    from specrt.export import step_graph

    out = tmp_path / "onnx"
    out.mkdir()
    (out / "keep.txt").write_text("previous export")

    def boom(*a, **k):
        raise RuntimeError("exporter crashed")

    monkeypatch.setattr(torch.onnx, "export", boom)
    with pytest.raises(RuntimeError, match="exporter crashed"):
        step_graph.export_step_graph(tiny_checkpoint, out, progress=False)
    assert (out / "keep.txt").read_text() == "previous export"
    assert [p.name for p in tmp_path.iterdir()] == ["onnx"]


def test_onnx_from_other_checkpoint_is_refused(tiny_artifacts):
    from specrt.errors import ManifestMismatchError
    from specrt.schema.graph_files import read_onnx_manifest

    with pytest.raises(ManifestMismatchError, match="ONNX export .* was made from checkpoint .* Re-export with"):
        read_onnx_manifest(tiny_artifacts / "onnx", "sha256:" + "0" * 64)


def test_export_with_eagle3_hidden_layers(tiny_checkpoint, tmp_path):
    """--hidden-layers 0,1,-1: hidden_states concatenates two layer outputs and the final state."""
    import onnxruntime as ort

    from specrt.export.step_graph import export_step_graph

    out = export_step_graph(tiny_checkpoint, tmp_path / "onnx3", hidden_layers=(0, 1, -1), progress=False)
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    model = load_model(tiny_checkpoint, hidden_layers=(0, 1, -1))
    cfg = model.cfg
    cache = new_cache(cfg, 1, 0)
    ids = np.array([[3, 4, 5, 6]])
    feeds = {
        "input_ids": ids,
        "position_ids": np.arange(4)[None],
        "attention_mask": cache.attention_mask(4),
        "logits_index": np.array([[3]]),
    }
    for i in range(cfg.num_hidden_layers):
        feeds[f"past_key_values.{i}.key"], feeds[f"past_key_values.{i}.value"] = cache.past(i)
    hidden = sess.run(["hidden_states"], feeds)[0]
    expected = (
        TorchBackend(model, in_place=False)
        .step(
            ids,
            feeds["position_ids"],
            feeds["attention_mask"],
            feeds["logits_index"],
            cache,
            hidden_index=np.arange(4)[None],
        )
        .hidden_states
    )
    assert hidden.shape == (1, 4, 3 * cfg.hidden_size)
    assert np.abs(hidden - expected).max() <= ATOL_LOGITS


def test_logits_index_selects_positions(backends):
    """Asking for the logits of chosen positions (per row) gives those rows of the full logits."""
    rng = np.random.default_rng(6)
    ids = rng.integers(0, 128, (2, 7))
    pos = np.broadcast_to(np.arange(7), (2, 7)).copy()
    for backend in backends:
        cache = new_cache(backend.config, 2, 0)
        mask = cache.attention_mask(7)
        every = np.broadcast_to(np.arange(7), (2, 7)).copy()
        full = backend.step(ids, pos, mask, every, cache, hidden_index=every)
        picked = backend.step(ids, pos, mask, np.array([[6, 2], [4, 4]]), cache, hidden_index=np.array([[1], [5]]))
        assert picked.logits.shape == (2, 2, 128)
        assert np.abs(picked.logits[0] - full.logits[0, [6, 2]]).max() <= ATOL_LOGITS
        assert np.abs(picked.logits[1] - full.logits[1, [4, 4]]).max() <= ATOL_LOGITS
        # hidden states: only the positions asked for, and none at all when nobody asks
        assert picked.hidden_states.shape == (2, 1, backend.config.hidden_size * len(backend.caps.hidden_layers))
        assert np.abs(picked.hidden_states[:, 0] - full.hidden_states[[0, 1], [1, 5]]).max() <= ATOL_LOGITS
        assert backend.step(ids, pos, mask, every, cache).hidden_states is None


def test_export_of_older_graph_version_is_refused(tiny_artifacts, tmp_path):
    import json
    import shutil

    from specrt.errors import ArtifactError
    from specrt.schema.graph_files import read_onnx_manifest

    d = shutil.copytree(tiny_artifacts / "onnx", tmp_path / "onnx")
    m = json.loads((d / "manifest.json").read_text())
    del m["graph_version"]
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="step graph version 1, this specrt runs version 2; re-export"):
        read_onnx_manifest(d)


def polygraphy_lint(onnx_path, tmp_path) -> dict:
    """`polygraphy check lint`: an independent check of the graph (ONNX checker, per-node
    inference with ONNX Runtime on generated data, unused and dead nodes)."""
    import shutil
    import subprocess
    import sys

    pytest.importorskip("polygraphy", reason="polygraphy is not installed (the test extra installs it)")
    exe = shutil.which("polygraphy") or str(__import__("pathlib").Path(sys.executable).parent / "polygraphy")
    report = tmp_path / "lint.json"
    r = subprocess.run(
        [exe, "check", "lint", str(onnx_path), "-o", str(report)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(report.read_text())


def test_polygraphy_lint_tiny(tiny_artifacts, tmp_path):
    lint = polygraphy_lint(tiny_artifacts / "onnx" / "model.onnx", tmp_path)
    assert lint["summary"]["failing"] == [] and len(lint["summary"]["passing"]) > 100
    assert lint["lint_entries"] == []


@pytest.mark.real_model
def test_polygraphy_lint_default_model(real_artifacts, tmp_path):
    lint = polygraphy_lint(real_artifacts / "onnx" / "model.onnx", tmp_path)
    assert lint["summary"]["failing"] == [] and lint["lint_entries"] == []


def test_tied_embedding_is_stored_once(tmp_path, tiny_checkpoint):
    """A tied model's export keeps one copy of the embedding (the LM head's W^T, which the lookup
    gathers along axis 1) and still matches PyTorch on prefill and decode; untied models keep both."""
    import onnxruntime as ort

    from specrt.export.step_graph import export_step_graph
    from specrt.schema.graph_files import read_onnx_manifest

    from conftest import random_model, save_checkpoint, tiny_hf_config

    hf = tiny_hf_config(tie_word_embeddings=True)
    ckpt = save_checkpoint(random_model(hf, seed=5), hf, tmp_path / "tied")
    out = export_step_graph(ckpt, tmp_path / "onnx", progress=False)
    assert read_onnx_manifest(out)["tied_embedding_shared"] is True
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    big = [i.name for i in proto.graph.initializer if np.prod(i.dims) == hf["vocab_size"] * hf["hidden_size"]]
    assert len(big) == 1 and big[0] != "model.embed_tokens.weight"
    backends = [
        OrtBackend(
            ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"]),
            load_model(ckpt).cfg,
            "cpu",
        ),
        TorchBackend(load_model(ckpt), in_place=False),
    ]
    ids = np.array([[3, 9, 27, 81 % 128, 100, 127, 0, 5]])
    a, b = run_both(backends, ids, np.arange(8)[None], lambda c: c.attention_mask(8))
    assert_close(a, b)
    a, b = run_both(backends, ids[:, :1], np.array([[8]]), lambda c: c.attention_mask(1), prefix=ids)
    assert_close(a, b)


def test_untied_export_keeps_both_matrices(tiny_artifacts):
    from specrt.schema.graph_files import read_onnx_manifest

    assert read_onnx_manifest(tiny_artifacts / "onnx")["tied_embedding_shared"] is False
