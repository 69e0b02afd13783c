"""Explicit Q/DQ graphs for TensorRT (qdq-int8, qdq-fp8) on the tiny model: the weight codes, the
graph (valid ONNX at opset 21 that ONNX Runtime runs, close to float32), its manifest, and a
TensorRT-RTX build whose network holds the Q/DQ layers."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from specrt.calibration import QDQ_SCHEMES
from specrt.calibration.qdq import OPSET, quantize_weight, quantize_weight_int4, smoothing
from specrt.engines.build import BuildSpec, build_all
from specrt.engines.trt import available_flavours
from specrt.layout import ArtifactLayout
from specrt.runtime.generator import Generator

from conftest import TINY_HF
from test_calibrated import _calibration_set


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_weight_codes(kind):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 12)) * rng.uniform(0.01, 3, (1, 12))).astype(np.float32)
    codes, scale = quantize_weight(w, kind)
    assert codes.shape == w.shape and scale.shape == (12,)
    back = codes.astype(np.float32) * scale
    if kind == "int8":
        assert codes.dtype == np.int8 and np.abs(codes.astype(int)).max() == 127  # each column's largest
        assert np.all(np.abs(back - w) <= scale / 2 + 1e-7)
    else:  # E4M3: 3 mantissa bits, so within 1/16 relative where the value is normal (>= 2^-6)
        normal = np.abs(w / scale) >= 2**-6
        assert np.all(np.abs(back - w)[normal] <= np.abs(w)[normal] / 16 + 1e-7)
        assert np.abs(back).max(0) == pytest.approx(np.abs(w).max(0), rel=1e-6)


def test_smoothing_meets_in_the_middle():
    rng = np.random.default_rng(1)
    amax = rng.uniform(0.1, 50, 16)  # a few large activation channels
    ws = [rng.standard_normal((16, 8)), rng.standard_normal((16, 5))]
    s = smoothing(amax, ws, alpha=0.5)
    wmax = np.max([np.abs(w).max(1) for w in ws], axis=0)
    # alpha 0.5: every channel's activation range and weight range become equal
    assert np.allclose(amax / s, s * wmax)
    assert np.allclose(smoothing(amax, ws, alpha=1.0) * 1, amax)  # alpha 1: the activations fully flattened
    assert np.array_equal(smoothing(np.zeros(16), ws, 0.5), np.ones(16))  # a channel never seen: left alone


def _int8_dot_products() -> bool:
    """Whether this CPU has 8-bit dot products with 32-bit sums (VNNI, AMX), or is not x86."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return any(f in flags.split() for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


@pytest.fixture(scope="module")
def built(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("qdq") / "art"
    cal = out.parent / "set.json"
    _calibration_set(tiny_checkpoint).save(cal)
    lines = []
    for scheme in QDQ_SCHEMES:
        spec = BuildSpec(checkpoint=tiny_checkpoint, out=out, quantize=scheme, calibration=cal, tensorrt="auto")
        lines += list(build_all(spec))
    return out, lines


CALIBRATED = ("qdq-int8", "qdq-fp8")


@pytest.mark.parametrize("scheme", CALIBRATED)
def test_qdq_graph_runs_close_to_float(built, scheme):
    out, _ = built
    layout = ArtifactLayout(out)
    qdir = layout.quant_onnx(scheme)
    q = json.loads((qdir / "manifest.json").read_text())["quantization"]
    assert q["quantized_matmuls"] == 7 * TINY_HF["num_hidden_layers"] and len(q["kept_in_float32"]) == 1
    assert q["calibration"]["sequences"] == 12 and q["opset"] == OPSET
    model = onnx.load(str(qdir / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    # per layer: 4 distinct projection inputs (one Q each), 7 weights (one DQ each) + 4 activation DQs
    assert ops.count("QuantizeLinear") == 4 * TINY_HF["num_hidden_layers"]
    assert ops.count("DequantizeLinear") == 11 * TINY_HF["num_hidden_layers"]
    # each projection's DQ holds its own weight, smoothed (rows times the factors s its input is
    # divided by): codes x scales within a step of s W
    from onnx import numpy_helper

    from specrt.calibration.blocks import weight_matmuls

    source = onnx.load(str(layout.onnx / "model.onnx"))
    floats = {n.output[0]: w for (i, w), n in ((x, source.graph.node[x[0]]) for x in weight_matmuls(source))}
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    produced = {o: n for n in model.graph.node for o in n.output}
    checked = 0
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.output[0] in floats and node.input[1] in produced:
            dq = produced[node.input[1]]
            codes, scale = inits[dq.input[0]].astype(np.float32), inits[dq.input[1]]
            x_dq = produced[node.input[0]]
            smooth = produced[produced[x_dq.input[0]].input[0]]  # DQ <- Q <- Mul(x, 1 / s)
            assert smooth.op_type == "Mul"
            sw = floats[node.output[0]] / inits[smooth.input[1]][:, None]
            step = scale if scheme == "qdq-int8" else np.abs(sw).max(0) / 16
            assert np.all(np.abs(codes * scale - sw) <= step + 1e-6 * np.abs(sw).max())
            checked += 1
    assert checked == 7 * TINY_HF["num_hidden_layers"]
    ids = np.random.default_rng(1).integers(3, 128, 120).tolist()
    logits = {}
    for name, engine in (("float", layout.ort_engine("cpu")), (scheme, layout.ort_engine("cpu", scheme))):
        gen = Generator.from_engine(engine)
        logits[name] = gen.session.forward(gen.session.new_cache(1, 128), [ids]).logits[0]  # every position
    a, b = logits["float"], logits[scheme]
    # of the logits' range, and top-1 agreement over 120 positions. The tiny random model is
    # sensitive: int8 weights alone (per channel, in a float graph) move its logits by 7 % of
    # their range and flip 6 % of its top-1; E4M3 weights alone (3 mantissa bits) 28 % and 18 %
    # ORT runs the int8 graph with its integer kernels: on an x86 CPU without VNNI (AVX2 only) an
    # 8-bit dot product goes through 16-bit intermediate sums, which can saturate; measured there
    # (an AMD EPYC) 28 % of the range and 82 % top-1, under 25 % on Xeons with VNNI/AMX
    # (TensorRT, the graph's target, sums in 32 bits)
    int8_bound = 0.25 if _int8_dot_products() else 0.32
    bound, agree = (int8_bound, 0.8) if scheme == "qdq-int8" else (0.45, 0.65)
    assert np.abs(a - b).max() <= bound * np.abs(a).max()
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= agree, (a.argmax(-1) == b.argmax(-1)).mean()


@pytest.mark.skipif("tensorrt-rtx" not in available_flavours(), reason="tensorrt-rtx is not installed")
@pytest.mark.parametrize("scheme", QDQ_SCHEMES)
def test_qdq_graph_builds_with_tensorrt_rtx(built, scheme):
    import tensorrt_rtx as trt

    out, lines = built
    edir = ArtifactLayout(out).trt_engine("tensorrt-rtx", scheme)
    assert (edir / "model.engine").is_file() and any(str(edir) in line and "built" in line for line in lines)
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(ArtifactLayout(out).quant_onnx(scheme) / "model.onnx"))
    types = [network.get_layer(i).type for i in range(network.num_layers)]
    layers = TINY_HF["num_hidden_layers"]
    quantize, dequantize = (0, 7 * layers) if scheme == "qdq-int4" else (4 * layers, 11 * layers)
    assert types.count(trt.LayerType.QUANTIZE) == quantize
    assert types.count(trt.LayerType.DEQUANTIZE) == dequantize


def test_int4_weight_codes():
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((96, 10)) * rng.uniform(0.01, 3, (1, 10))).astype(np.float32)
    codes, scale = quantize_weight_int4(w)
    assert scale.shape == (3, 10) and codes.astype(int).min() >= -8 and codes.astype(int).max() <= 7
    back = codes.astype(np.float32) * np.repeat(scale, 32, axis=0)
    assert np.all(np.abs(back - w) <= np.repeat(scale, 32, axis=0) / 2 + 1e-6)


def test_int4_weight_only_graph(built):
    out, _ = built
    layout = ArtifactLayout(out)
    q = json.loads((layout.quant_onnx("qdq-int4") / "manifest.json").read_text())["quantization"]
    assert q["quantized_matmuls"] == 7 * TINY_HF["num_hidden_layers"] and "calibration" not in q
    model = onnx.load(str(layout.quant_onnx("qdq-int4") / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QuantizeLinear") == 0 and ops.count("DequantizeLinear") == 7 * TINY_HF["num_hidden_layers"]
    # the graph computes exactly its int4 weights: against the float graph holding codes x scales,
    # both run by ONNX Runtime unoptimized (optimized, ORT fuses DQ + MatMul into its own 4-bit
    # kernel with int8 activations: 5 % off on this model; TensorRT runs the graph as written)
    import onnxruntime as ort
    from onnx import numpy_helper

    from specrt.calibration.blocks import weight_matmuls
    from specrt.schema.step_io import StepIO, attention_mask

    ref = onnx.load(str(layout.onnx / "model.onnx"))
    inits = {i.name: i for i in ref.graph.initializer}
    for i, w in weight_matmuls(ref):
        if w.shape[1] != TINY_HF["vocab_size"]:
            codes, scale = quantize_weight_int4(w)
            name = ref.graph.node[i].input[1]
            inits[name].CopyFrom(numpy_helper.from_array(codes.astype(np.float32) * np.repeat(scale, 32, 0), name))
    n, io = 60, StepIO(TINY_HF["num_hidden_layers"])
    feed = {
        "input_ids": np.random.default_rng(1).integers(3, 128, n)[None],
        "position_ids": np.arange(n)[None],
        "attention_mask": attention_mask(np.array([0]), 0, n),
        "logits_index": np.arange(n)[None],
    }
    head_dim = TINY_HF["hidden_size"] // TINY_HF["num_attention_heads"]
    feed.update({k: np.zeros((1, TINY_HF["num_key_value_heads"], 0, head_dim), np.float32) for k in io.past_names})
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    a = ort.InferenceSession(ref.SerializeToString(), plain).run(["logits"], feed)[0]
    b = ort.InferenceSession(str(layout.quant_onnx("qdq-int4") / "model.onnx"), plain).run(["logits"], feed)[0]
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
