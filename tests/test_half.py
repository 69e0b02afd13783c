"""16-bit step graphs (fp16, bf16) on the tiny model: the traced graph's types (weights and
compute in 16 bits, I/O and the declared float32 islands kept), its numbers against float32 and
against the PyTorch module cast to the same dtype, the float32 export left untouched, and the
build: an ORT engine for fp16 only, TensorRT-RTX engines for both."""

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto

from specrt.engines.build import BuildSpec, build_all
from specrt.engines.trt import available_flavours
from specrt.export.checkpoint import load_model
from specrt.export.llama import causal_mask
from specrt.export.step_graph import example_inputs
from specrt.layout import ArtifactLayout

ONNX_TYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


@pytest.fixture(scope="module")
def built(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("half") / "art"
    lines = []
    for scheme in ("fp16", "bf16"):
        lines += list(build_all(BuildSpec(checkpoint=tiny_checkpoint, out=out, quantize=scheme, tensorrt="auto")))
    return out, lines


def _feeds(tiny_checkpoint, onnx_dir):
    from specrt.schema.config import ModelConfig

    cfg = ModelConfig.from_dict(json.loads((onnx_dir / "manifest.json").read_text())["config"])
    torch.manual_seed(3)
    args = example_inputs(cfg, batch=2, q=5, past=6)
    args = (*args[:4], *[torch.randn_like(t) for t in args[4:]])  # a past of real values
    names = [i.name for i in onnx.load(str(onnx_dir / "model.onnx"), load_external_data=False).graph.input]
    return args, dict(zip(names, [a.numpy() for a in args]))


def _torch_logits(tiny_checkpoint, args, dtype):
    model = load_model(tiny_checkpoint)
    if dtype != torch.float32:
        model.to_dtype(dtype)
    ids, pos, mask, index, *flat = args
    with torch.no_grad():
        logits, _, present = model(ids, pos, mask, list(zip(flat[0::2], flat[1::2])), index)
    assert logits.dtype == torch.float32 and present[0][0].dtype == torch.float32  # the I/O contract
    return logits.numpy()


@pytest.mark.parametrize("scheme", ["fp16", "bf16"])
def test_graph_types(built, scheme):
    out, _ = built
    layout = ArtifactLayout(out)
    model = onnx.load(str(layout.quant_onnx(scheme) / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    # every weight matrix in 16 bits; the I/O in float32 as in the float32 export
    matrices = [i for i in model.graph.initializer if len(i.dims) == 2]
    assert matrices and all(i.data_type == ONNX_TYPES[scheme] for i in matrices)
    io = [*model.graph.input, *model.graph.output]
    floats = [t for t in io if t.type.tensor_type.elem_type not in (TensorProto.INT64, TensorProto.BOOL)]
    assert floats and all(t.type.tensor_type.elem_type == TensorProto.FLOAT for t in floats)
    manifest = json.loads((layout.quant_onnx(scheme) / "manifest.json").read_text())
    assert manifest["quantization"]["scheme"] == scheme and manifest["compute_dtype"] in ("float16", "bfloat16")
    assert "rmsnorm statistics" in manifest["quantization"]["kept_in_float32"]
    # RMSNorm's statistics really are float32: the squares feeding each ReduceMean come from a Cast to float
    casts_to_float = [n for n in model.graph.node if n.op_type == "Cast" and n.attribute[0].i == TensorProto.FLOAT]
    assert (
        len(casts_to_float)
        >= 2 * json.loads((layout.onnx / "manifest.json").read_text())["config"]["num_hidden_layers"]
    )
    # the float32 export casts no float32 tensor to float32 (the dtype casts trace as nothing there)
    f32 = onnx.shape_inference.infer_shapes(onnx.load(str(layout.onnx / "model.onnx")))
    types = {v.name: v.type.tensor_type.elem_type for v in [*f32.graph.value_info, *f32.graph.input]}
    casts = [n for n in f32.graph.node if n.op_type == "Cast" and n.attribute[0].i == TensorProto.FLOAT]
    assert casts and all(n.input[0] in types for n in casts)  # (position ids to float for the rotary angles)
    assert not [n.name for n in casts if types[n.input[0]] == TensorProto.FLOAT]


def test_fp16_graph_numbers(built, tiny_checkpoint):
    """ONNX Runtime's fp16 graph against the float32 graph and the float16 PyTorch module: within
    float16 rounding of the logits' range (measured 2e-3 of it on this model)."""
    import onnxruntime as ort

    out, _ = built
    layout = ArtifactLayout(out)
    args, feeds = _feeds(tiny_checkpoint, layout.onnx)

    def run(d):
        return ort.InferenceSession(str(d / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)

    ref, half = run(layout.onnx), run(layout.quant_onnx("fp16"))
    scale = np.abs(ref[0]).max()
    assert np.abs(half[0] - ref[0]).max() <= 1e-2 * scale
    assert (half[0].argmax(-1) == ref[0].argmax(-1)).mean() >= 0.9
    for a, b in zip(ref[2:], half[2:]):  # the new KV too
        assert np.abs(a - b).max() <= 1e-2 * np.abs(a).max()
    assert np.abs(half[0] - _torch_logits(tiny_checkpoint, args, torch.float16)).max() <= 5e-3 * scale


def test_bf16_graph_numbers(built, tiny_checkpoint):
    """The bf16 graph run by ONNX's reference evaluator (ORT's CPU provider has no bfloat16
    kernels): within bfloat16 rounding (8 bits of mantissa) of float32 and of the bfloat16 module."""
    from onnx.reference import ReferenceEvaluator

    out, _ = built
    layout = ArtifactLayout(out)
    args, feeds = _feeds(tiny_checkpoint, layout.onnx)
    logits = ReferenceEvaluator(onnx.load(str(layout.quant_onnx("bf16") / "model.onnx"))).run(["logits"], feeds)[0]
    ref = _torch_logits(tiny_checkpoint, args, torch.float32)
    scale = np.abs(ref).max()
    assert np.abs(logits - ref).max() <= 5e-2 * scale
    assert np.abs(logits - _torch_logits(tiny_checkpoint, args, torch.bfloat16)).max() <= 5e-2 * scale
    # and bf16 really rounds: it is not the float32 graph under another name
    assert np.abs(logits - ref).max() > 1e-4 * scale


def test_engines_built(built):
    out, lines = built
    layout = ArtifactLayout(out)
    assert (layout.ort_engine("cpu", "fp16") / "manifest.json").is_file()
    assert not layout.ort_engine("cpu", "bf16").exists()
    assert any("ort       skipped" in line and "bf16" in line for line in lines)
    if "tensorrt-rtx" in available_flavours():
        for scheme in ("fp16", "bf16"):
            assert (layout.trt_engine("tensorrt-rtx", scheme) / "model.engine").is_file()


def test_torch_generator_in_bf16(tiny_checkpoint):
    """The PyTorch backend runs the module in bfloat16 (what the bf16 graph is traced from) and
    keeps the float32 cache contract."""
    from specrt.runtime.generator import Generator

    f32 = Generator.from_checkpoint(tiny_checkpoint)
    b16 = Generator.from_checkpoint(tiny_checkpoint, dtype="bfloat16")
    prompt = [[5, 9, 13, 2, 7]]
    a, b = f32.generate_ids(prompt, 8)[0].token_ids, b16.generate_ids(prompt, 8)[0].token_ids
    assert len(b) == 8 and b[0] == a[0]
    ids = torch.tensor([[5, 9, 13]])
    cfg_model = load_model(tiny_checkpoint).to_dtype(torch.bfloat16)
    with torch.no_grad():
        _, _, present = cfg_model(ids, torch.arange(3)[None], causal_mask(1, 3, 0), cfg_model.empty_past(1))
    assert present[0][0].dtype == torch.float32 and cfg_model.inv_freq.dtype == torch.float32
