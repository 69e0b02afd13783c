"""The standard step graph (export/standard_graph.py): opset-23 operators only, the portable I/O.

On ONNX Runtime's CPU provider (which runs opset 23) it computes what the portable graph does at
every kind of step (prefill, decode, ragged rows, trees, after tree compaction) and speculative
output equals plain output; TensorRT-RTX parses it and builds both profiles from it on this CPU,
and build-engines records which graph each TensorRT engine was built from.
"""

import collections
import json

import onnx
import pytest
from test_fused_graph import compare, steps

from specrt.engines.ort import OrtOptions, build_ort_engine
from specrt.export.standard_graph import export_standard_graph
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.speculative import SpeculativeDecoder, make_policy

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [40, 41, 42, 43, 40, 41, 42]]


@pytest.fixture(scope="module")
def standard(tiny_checkpoint, tmp_path_factory):
    """The standard graph of the tiny checkpoint and an ORT engine of it."""
    out = tmp_path_factory.mktemp("standard")
    export_standard_graph(tiny_checkpoint, out / "onnx-standard")
    build_ort_engine(out / "onnx-standard", out / "engine", OrtOptions())
    return out


def test_standard_is_standard_opset_only(standard):
    model = onnx.load(str(standard / "onnx-standard" / "model.onnx"), load_external_data=False)
    assert {o.domain for o in model.opset_import} == {""} and model.opset_import[0].version >= 23
    ops = collections.Counter(n.op_type for n in model.graph.node)
    layers = json.loads((standard / "onnx-standard" / "manifest.json").read_text())["config"]["num_hidden_layers"]
    assert ops["Attention"] == ops["RotaryEmbedding"] / 2 == layers
    assert ops["RMSNormalization"] == 2 * layers + 1
    assert "Softmax" not in ops and "Pow" not in ops  # attention and norms are the fused operators


def test_standard_equals_portable_at_every_kind_of_step(standard, tiny_portable_artifacts):
    gen = Generator.from_engine(standard / "engine")
    portable = Generator.from_engine(tiny_portable_artifacts / "engines" / "ort-cpu")
    assert gen.backend.flavour == "standard"
    got, cache = steps(gen.session)
    want, portable_cache = steps(portable.session)
    compare(got, want)
    assert cache.lengths.tolist() == portable_cache.lengths.tolist()


def test_speculative_output_equals_plain_on_the_standard_graph(standard):
    gen = Generator.from_engine(standard / "engine")
    plain = [r.token_ids for r in gen.generate_ids(PROMPTS, 24)]
    for draft in ("suffix", "ngram"):  # trees: steps() above
        dec = SpeculativeDecoder(gen, make_proposer(draft), make_policy(4, 4))
        assert [r.token_ids for r in dec.generate_ids(PROMPTS, 24)] == plain, draft


def test_tensorrt_rtx_builds_both_profiles_from_the_standard_graph(tiny_artifacts):
    """build-engines (fused by default) writes onnx-standard/ and builds TensorRT from it."""
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx is not installed (make setup installs it)")
    manifest = json.loads((tiny_artifacts / "engines" / "trt-tensorrt-rtx" / "manifest.json").read_text())
    assert manifest["graph_flavour"] == "standard" and manifest["fallback_from"] is None
    assert manifest["onnx"]["path"].endswith("onnx-standard")
    assert [p["name"] for p in manifest["profiles"]] == ["verify", "prefill"]


def test_a_parser_that_refuses_the_standard_graph_gets_the_portable_one(tiny_checkpoint, tmp_path, monkeypatch):
    """build-engines says so, records `fallback_from`, and keeps that engine on the next run."""
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx is not installed (make setup installs it)")
    from specrt.engines import trt
    from specrt.engines.build import BuildSpec, build_all
    from specrt.engines.profiles import EngineShapes
    from specrt.engines.trt import TrtBuildSpec, UnparsedGraph

    real = trt.build_trt_engine

    def refusing(onnx_dir, *args, **kwargs):
        if onnx_dir.name == "onnx-standard":
            raise UnparsedGraph(f"TensorRT could not parse {onnx_dir}/model.onnx: no Attention here")
        return real(onnx_dir, *args, **kwargs)

    monkeypatch.setattr(trt, "build_trt_engine", refusing)
    shapes = EngineShapes(max_context=64, max_prefill=16, max_verify=5)
    spec = BuildSpec(checkpoint=tiny_checkpoint, out=tmp_path / "art", trt=TrtBuildSpec(shapes=shapes))
    lines = list(build_all(spec))
    assert any("cannot parse it" in line and "building from the portable graph" in line for line in lines), lines
    manifest = json.loads((tmp_path / "art" / "engines" / "trt-tensorrt-rtx" / "manifest.json").read_text())
    assert manifest["graph_flavour"] == "portable" and manifest["fallback_from"] == "standard"
    again = [line for line in build_all(spec) if line.startswith("tensorrt-rtx")]
    assert len(again) == 1 and again[0].endswith("up to date"), again
