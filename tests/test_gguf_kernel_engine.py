"""`--quantize gguf-k`: a GGUF model's engine whose products read the file's blocks in place on
specrt's own kernel. Its graph holds no weight of a block tensor, its logits are the float model's
within int8 activations' rounding, speculative output is bitwise plain output, a file changed
under it is refused, and without the library the build falls back to gguf-a8 in one line."""

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from specrt.calibration.gguf_kernel import KernelProducts
from specrt.cli import main
from specrt.engines import kernels
from specrt.engines.build import BuildSpec, build_all
from specrt.layout import ArtifactLayout
from specrt.runtime.generator import Generator

from conftest import CHAT_TEMPLATE, random_model, tiny_hf_config
from test_gguf_blocks import TYPES
from tiny_gguf import write_gguf

pytestmark = pytest.mark.skipif(not kernels.has_ort_ops(), reason=f"the kernel library: {kernels.why_not()}")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-k")
    hf = tiny_hf_config()
    write_gguf(random_model(hf, seed=41), hf, d / "tiny.gguf", TYPES, tokenizer=True, chat_template=CHAT_TEMPLATE)
    r = CliRunner().invoke(main, ["convert", str(d / "tiny.gguf"), "--out", str(d / "ckpt"), "--weights", "gguf"])
    assert r.exit_code == 0, r.output
    lines = list(build_all(BuildSpec(checkpoint=d / "ckpt", out=d / "art", quantize="gguf-k", tensorrt="off")))
    return d, lines


def test_the_graph_reads_the_files_blocks_in_place(built):
    d, lines = built
    layout = ArtifactLayout(d / "art")
    assert any("built" in line for line in lines if line.startswith("ort"))
    graph = onnx.load(str(layout.fused_onnx("gguf-k") / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node if n.domain == "specrt"]
    products = [n for n in graph.node if n.op_type == "GgufMatMul"]
    parts = [len(next((a.ints for a in n.attribute if a.name == "parts_n"), [0])) for n in products]
    assert ops.count("GgufGather") == 1 and sum(parts) == 2 * (3 + 1 + 2 + 1) + 1  # q k v o gate up down, lm_head
    assert max(parts) > 1  # weights of one block type side by side: one product
    big = [i.name for i in graph.initializer if np.prod(i.dims) >= 64 * 64 and i.data_type == onnx.TensorProto.FLOAT]
    assert not big, big  # no weight of a block tensor written as floats
    m = json.loads((layout.fused_onnx("gguf-k") / "manifest.json").read_text())["quantization"]
    assert m["scheme"] == "gguf-k" and m["gguf"]["relative"] == "../gguf/tiny.gguf"  # a link in the folder
    assert (d / "art" / "gguf" / "tiny.gguf").samefile(d / "tiny.gguf")  # no second copy on disk
    r = CliRunner().invoke(main, ["inspect", str(d / "art")])
    assert "weights read in place from the GGUF (4 Q4_0, 8 Q4_1, 3 Q8_0 products), int8 activations" in r.output
    engine = json.loads((layout.ort_engine("cpu", "gguf-k") / "manifest.json").read_text())
    assert engine["batch_invariance"]["bitwise"]["unpadded"]  # its build found no step floor needed


def test_its_logits_are_the_float_models_within_int8_rounding(built):
    d, _ = built
    engine = Generator.from_engine(ArtifactLayout(d / "art").ort_engine("cpu", "gguf-k"))
    reference = Generator.from_checkpoint(d / "ckpt")  # the GGUF dequantized, in PyTorch float32
    prompts = [np.random.default_rng(2).integers(3, 128, 24).tolist()]
    a = engine.session.prefill(engine.session.new_cache(1, 64), prompts).logits
    b = reference.session.prefill(reference.session.new_cache(1, 64), prompts).logits
    assert np.abs(a - b).max() <= 5e-2 * np.abs(b).max()
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


def test_speculative_output_is_plain_output_bit_for_bit(built):
    d, _ = built
    art = str(d / "art")
    common = ["generate", "--artifacts", art, "--quantize", "gguf-k", "--prompt", "b c d b c d b c", "--no-chat"]
    plain = CliRunner().invoke(main, [*common, "--max-new-tokens", "24"])
    spec = CliRunner().invoke(main, [*common, "--max-new-tokens", "24", "--draft", "suffix"])
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert plain.stdout.splitlines()[0] == spec.stdout.splitlines()[0]


def test_a_gguf_changed_under_the_engine_is_refused(built):
    d, _ = built
    gguf = d / "tiny.gguf"
    original = gguf.read_bytes()
    changed = bytearray(original)
    changed[-4096:-2048] = bytes(2048)
    try:
        gguf.write_bytes(bytes(changed))
        r = CliRunner().invoke(
            main, ["generate", "--artifacts", str(d / "art"), "--quantize", "gguf-k", "--prompt", "b"]
        )
        line = r.output.strip().splitlines()[-1]
        assert r.exit_code == 1 and "changed since" in line and "Traceback" not in r.output, r.output
    finally:
        gguf.write_bytes(original)


def test_without_the_library_the_build_falls_back_to_gguf_a8(built, tmp_path, monkeypatch):
    d, _ = built
    monkeypatch.setattr(kernels, "has_ort_ops", lambda: False)
    lines = list(build_all(BuildSpec(checkpoint=d / "ckpt", out=tmp_path / "art", quantize="gguf-k", tensorrt="off")))
    assert "building gguf-a8 (MatMulNBits) instead" in lines[0]
    assert ArtifactLayout(tmp_path / "art").ort_engine("cpu", "gguf-a8").is_dir()
    args = ["generate", "--artifacts", str(tmp_path / "art"), "--quantize", "gguf-k", "--prompt", "b c", "--no-chat"]
    r = CliRunner().invoke(main, [*args, "--max-new-tokens", "4"])
    assert r.exit_code == 0 and "specrt's kernel library is not available" in r.stderr, r.output


def test_a_copied_folder_carries_the_weights_it_reads_in_place(built, tmp_path):
    """The GGUF is linked into the artifacts folder: a copy answers with the model's file, its
    checkpoint and the build tree gone."""
    import shutil

    d, _ = built
    copy = shutil.copytree(d / "art", tmp_path / "edge" / "art")
    args = ["generate", "--quantize", "gguf-k", "--prompt", "b c d", "--no-chat", "--max-new-tokens", "8"]
    before = CliRunner().invoke(main, [*args, "--artifacts", str(d / "art")])
    shutil.move(d, tmp_path / "hidden")
    try:
        after = CliRunner().invoke(main, [*args, "--artifacts", str(copy)])
    finally:
        shutil.move(tmp_path / "hidden", d)
    assert before.exit_code == after.exit_code == 0, after.output
    assert before.stdout.splitlines()[0] == after.stdout.splitlines()[0]


def test_an_engine_measured_on_another_kernel_build_is_refused_and_rebuilt(built, tmp_path, monkeypatch):
    """Its bitwise step shapes and step costs hold for the library that measured them."""
    import shutil

    from specrt.engines.kernels import build as kernel_build

    d, _ = built
    shutil.copytree(d / "art", tmp_path / "art", symlinks=True)
    monkeypatch.setattr(kernel_build, "sources_digest", lambda: "another")
    args = ["generate", "--artifacts", str(tmp_path / "art"), "--quantize", "gguf-k", "--prompt", "b c", "--no-chat"]
    r = CliRunner().invoke(main, [*args, "--max-new-tokens", "4"])
    assert r.exit_code == 1 and "another build of specrt's kernel library" in r.output, r.output
    assert "specrt build-engines" in r.output
    lines = list(build_all(BuildSpec(checkpoint=d / "ckpt", out=tmp_path / "art", quantize="gguf-k", tensorrt="off")))
    assert any(line.startswith("ort") and "built" in line for line in lines), lines
    engine = json.loads((ArtifactLayout(tmp_path / "art").ort_engine("cpu", "gguf-k") / "manifest.json").read_text())
    assert engine["kernels"] == {"sources": "another"}
    assert CliRunner().invoke(main, [*args, "--max-new-tokens", "4"]).exit_code == 0


@pytest.fixture(scope="module")
def qwen_built(tmp_path_factory):
    """A Qwen2-shaped GGUF (q/k/v biases) whose gate and up share a block type: the kernel adds
    the bias and applies SwiGLU inside the product."""
    d = tmp_path_factory.mktemp("gguf-k-qwen")
    hf = tiny_hf_config(architectures=["Qwen2ForCausalLM"], model_type="qwen2", attention_bias=True)
    types = {r: "Q4_0" for r in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")}
    types |= {"attn_output": "Q8_0", "ffn_down": "Q4_1", "output": "Q8_0"}
    model = random_model(hf, seed=43)
    write_gguf(model, hf, d / "tiny.gguf", types, tokenizer=True, chat_template=CHAT_TEMPLATE, arch="qwen2")
    r = CliRunner().invoke(main, ["convert", str(d / "tiny.gguf"), "--out", str(d / "ckpt"), "--weights", "gguf"])
    assert r.exit_code == 0, r.output
    list(build_all(BuildSpec(checkpoint=d / "ckpt", out=d / "art", quantize="gguf-k", tensorrt="off")))
    return d


def test_the_bias_and_swiglu_are_the_kernels(qwen_built):
    d = qwen_built
    layout = ArtifactLayout(d / "art")
    graph = onnx.load(str(layout.fused_onnx("gguf-k") / "model.onnx"), load_external_data=False).graph
    attrs = [{a.name for a in n.attribute} for n in graph.node if n.op_type == "GgufMatMul"]
    epilogues = [onnx.helper.get_attribute_value(a) for n in graph.node for a in n.attribute if a.name == "epilogue"]
    assert epilogues == [b"swiglu"] * 2 and sum("bias" in a for a in attrs) == 2  # each layer's
    ops = {n.op_type for n in graph.node}
    assert not ops & {"Split", "Sigmoid", "QuickGelu", "Mul"}, ops & {"Split", "Sigmoid", "QuickGelu", "Mul"}
    # against the same graph with ONNX Runtime's Add, Split, Sigmoid and Mul: e^t's own rounding only
    with pytest.MonkeyPatch.context() as mp:
        mp.delattr(KernelProducts, "biased")
        mp.delattr(KernelProducts, "swiglu")
        list(build_all(BuildSpec(checkpoint=d / "ckpt", out=d / "nodes", quantize="gguf-k", tensorrt="off")))
    nodes = ArtifactLayout(d / "nodes")
    graph = onnx.load(str(nodes.fused_onnx("gguf-k") / "model.onnx"), load_external_data=False).graph
    assert {"Split", "Sigmoid"} <= {n.op_type for n in graph.node}
    prompts = [np.random.default_rng(3).integers(3, 128, 24).tolist()]
    a, b = (
        (g := Generator.from_engine(x.ort_engine("cpu", "gguf-k"))).session.prefill(g.session.new_cache(1, 64), prompts)
        for x in (layout, nodes)
    )
    assert np.abs(a.logits - b.logits).max() <= 1e-4 * np.abs(b.logits).max()
    m = json.loads((layout.ort_engine("cpu", "gguf-k") / "manifest.json").read_text())
    assert m["batch_invariance"]["bitwise"]["unpadded"]  # no step floor with the epilogue either
    common = ["generate", "--artifacts", str(d / "art"), "--quantize", "gguf-k", "--prompt", "b c d b c d", "--no-chat"]
    plain = CliRunner().invoke(main, [*common, "--max-new-tokens", "20"])
    spec = CliRunner().invoke(main, [*common, "--max-new-tokens", "20", "--draft", "suffix"])
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert plain.stdout.splitlines()[0] == spec.stdout.splitlines()[0]
