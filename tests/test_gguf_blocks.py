"""build-engines --quantize gguf: a 4-bit step graph computed from the GGUF file's own blocks
(Q4_0, Q4_1, Q8_0), equal to the float engine within float rounding, batch-invariant, and
refused for a GGUF the checkpoint was not converted from."""

import json

import numpy as np
import pytest

from specrt.calibration.gguf_blocks import _split_blocks
from specrt.engines.build import BuildSpec, build_all
from specrt.errors import SpecrtError
from specrt.export.checkpoint import load_model
from specrt.export.gguf import GGUF_SOURCE, gguf_origin
from specrt.layout import ArtifactLayout
from specrt.runtime.generator import Generator

from conftest import random_model, save_checkpoint, tiny_hf_config
from tiny_gguf import write_gguf

TYPES = {  # every supported block type, on every kind of projection
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q4_1",
    "attn_output": "Q8_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q4_0",
    "ffn_down": "Q4_1",
    "output": "Q8_0",
    "token_embd": "Q8_0",
}


@pytest.fixture(scope="module", params=["fused", "portable"])
def gguf_target(tmp_path_factory, request):
    """(GGUF file, the checkpoint converted from it, build-engines output with --quantize gguf,
    the graph flavour): both flavours, the fused graph written from the blocks and the portable
    one rewritten onto them."""
    d = tmp_path_factory.mktemp("gguf")
    hf = tiny_hf_config()
    write_gguf(random_model(hf, seed=11), hf, d / "tiny.gguf", TYPES)
    # the checkpoint is the GGUF's dequantization, as `specrt convert` writes it
    ckpt = save_checkpoint(load_model(d / "tiny.gguf"), hf, d / "ckpt")
    out = d / "art"
    spec = BuildSpec(
        checkpoint=ckpt, out=out, quantize="gguf", gguf=d / "tiny.gguf", tensorrt="off", graph=request.param
    )
    lines = list(build_all(spec))
    assert any("gguf" in line and "quantized" in line for line in lines)
    return d / "tiny.gguf", ckpt, out, request.param


def gguf_graph(out, flavour):
    return ArtifactLayout(out).source_onnx("gguf", flavour)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_fields_dequantize_as_the_gguf_package_does(kind):
    import gguf

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((6, 96)) * rng.uniform(0.01, 3, (6, 1))).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w, qtype)
    ours = _split_blocks(raw, 6, kind).dequantize()
    assert np.array_equal(ours, gguf.quants.dequantize(raw, qtype).reshape(6, 96))  # bit for bit


def test_gguf_engine_is_the_float_model(gguf_target):
    path, ckpt, out, flavour = gguf_target
    layout = ArtifactLayout(out)
    q = json.loads((gguf_graph(out, flavour) / "manifest.json").read_text())["quantization"]
    assert q["rewritten_matmuls"] == {"Q4_0": 4, "Q4_1": 8, "Q8_0": 3}  # per layer: q, up / k, v, gate, down / o
    # the fused graph looks the embedding up in its blocks; the portable rewrite keeps the float table
    assert q["block_tensors_unused"] == ([] if flavour == "fused" else ["token_embd.weight"])
    import onnx

    graph = onnx.load(str(gguf_graph(out, flavour) / "model.onnx"), load_external_data=False).graph
    # per layer q, k + v (one input, both Q4_1: fused), o (Q8_0: two), gate, up, down; the head (two)
    assert sum(n.op_type == "MatMulNBits" for n in graph.node) == 2 * 7 + 2
    engine = json.loads((layout.ort_engine("cpu", "gguf") / "manifest.json").read_text())
    assert engine["batch_invariance"]["relative"] <= 1e-4 and engine["precision"] == "float32"
    assert engine["graph_flavour"] == flavour

    flt, q4 = Generator.from_engine(layout.ort_engine("cpu")), Generator.from_engine(layout.ort_engine("cpu", "gguf"))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 128, 40).tolist(), rng.integers(3, 128, 9).tolist()]
    for g in (flt, q4):
        g.eos_ids = frozenset()
    a = flt.session.prefill(flt.session.new_cache(2, 64), prompts)
    b = q4.session.prefill(q4.session.new_cache(2, 64), prompts)
    assert np.abs(a.logits - b.logits).max() <= 1e-4 * np.abs(a.logits).max()
    assert [r.token_ids for r in q4.generate_ids(prompts, 30)] == [r.token_ids for r in flt.generate_ids(prompts, 30)]


def test_a_gguf_the_checkpoint_did_not_come_from_is_refused(gguf_target, tmp_path):
    _, ckpt, out, flavour = gguf_target
    hf = tiny_hf_config()
    write_gguf(random_model(hf, seed=12), hf, tmp_path / "other.gguf", TYPES)
    other = tmp_path / "other.gguf"
    spec = BuildSpec(checkpoint=ckpt, out=out, quantize="gguf", gguf=other, tensorrt="off", graph=flavour)
    with pytest.raises(SpecrtError, match="not converted from this GGUF file"):
        list(build_all(spec))
    assert json.loads((gguf_graph(out, flavour) / "manifest.json").read_text())  # the old one intact


def test_the_gguf_file_comes_from_the_checkpoints_record(gguf_target, tmp_path):
    path, ckpt, out, flavour = gguf_target
    spec = BuildSpec(checkpoint=ckpt, out=out, quantize="gguf", tensorrt="off", graph=flavour)
    with pytest.raises(SpecrtError, match="records no GGUF file"):
        list(build_all(spec))
    from specrt.artifacts import file_sha256

    (ckpt / GGUF_SOURCE).write_text(json.dumps({"file": str(path), "sha256": file_sha256(path)}))
    try:
        assert gguf_origin(ckpt) == path
        assert any("up to date" in line and str(gguf_graph(out, flavour)) in line for line in build_all(spec))
    finally:
        (ckpt / GGUF_SOURCE).unlink()


def test_split_backend_decodes_on_gguf_and_verifies_on_float(gguf_target):
    """--split: steps of one row and one position on the gguf engine, the rest (a batch's steps
    too) on float32; the same greedy and speculative output as float32 alone."""
    from specrt.runtime.backends import SplitBackend
    from specrt.runtime.drafts import make_proposer
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy

    _, _, out, _ = gguf_target
    layout = ArtifactLayout(out)
    split = Generator.from_engine(layout.ort_engine("cpu", "gguf"), multi_engine=layout.ort_engine("cpu"))
    flt = Generator.from_engine(layout.ort_engine("cpu"))
    assert isinstance(split.backend, SplitBackend) and split.backend.caps.precision == "float32"
    calls = {"single": [], "multi": []}
    for name in calls:
        inner = getattr(split.backend, name)
        original = inner.step

        def counted(ids, *args, _name=name, _original=original, **kw):
            calls[_name].append(ids.shape[1])
            return _original(ids, *args, **kw)

        inner.step = counted
    for g in (split, flt):
        g.eos_ids = frozenset()
    prompt = [list(np.random.default_rng(2).integers(3, 128, 30))]
    plain = split.generate_ids(prompt, 24)[0].token_ids
    assert plain == flt.generate_ids(prompt, 24)[0].token_ids
    assert set(calls["single"]) == {1} and calls["multi"] == [30]  # decode on gguf, the prefill on float32
    rep = prompt[0][:10] * 3  # repetitive: the n-gram draft proposes, so verification steps happen
    spec = SpeculativeDecoder(split, make_proposer("ngram"), make_policy(4)).generate_ids([rep], 24)[0]
    assert spec.token_ids == split.generate_ids([rep], 24)[0].token_ids
    assert any(q > 1 for q in calls["multi"][1:])
    # its step costs, measured when each engine was built: one position on gguf, more on float32
    costs = split.backend.caps.step_ms
    assert costs[1] == split.backend.single.caps.step_ms[1]
    assert costs[9] == flt.backend.caps.step_ms[9] and sorted(costs) == [1, 2, 3, 5, 9, 17]
    single = len(calls["single"])
    split.generate_ids([prompt[0], prompt[0][:12]], 6)  # two rows: every step on float32
    assert len(calls["single"]) == single and 1 in calls["multi"]


def test_split_refuses_engines_of_different_models(gguf_target, tmp_path):
    from specrt.runtime.backends import SplitBackend

    _, ckpt, out, flavour = gguf_target
    list(build_all(BuildSpec(checkpoint=ckpt, out=out, quantize="hqq", tensorrt="off", graph=flavour)))
    layout = ArtifactLayout(out)
    hqq = Generator.from_engine(layout.ort_engine("cpu", "hqq")).backend
    flt = Generator.from_engine(layout.ort_engine("cpu")).backend
    with pytest.raises(SpecrtError, match="compute different models"):
        SplitBackend(single=hqq, multi=flt)
