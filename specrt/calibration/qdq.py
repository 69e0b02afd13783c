"""Explicit quantization for TensorRT: the step graph with QuantizeLinear/DequantizeLinear pairs.

TensorRT 11 and TensorRT-RTX build strongly typed networks only: a layer runs in int8 or fp8
where the graph says so with Q/DQ nodes, never by a builder flag. Here every projection of the
decoder layers gets them on both of its inputs:

    x -> Q -> DQ --\\
                    MatMul          TensorRT fuses the DQs into a low-precision GEMM
    W_q -> DQ -----/

  qdq-int8   weights int8, symmetric, one scale per output channel; activations int8, one
             static scale per tensor (its largest |x| over the calibration feeds / 127)
  qdq-fp8    the same in FP8 E4M3 (largest |x| / 448): GEMMs on Ada and later (SM 8.9+)
  qdq-int4   weights only: int4, symmetric (TensorRT's DQ takes no zero point), one scale per
             block of 32 inputs (blocked DequantizeLinear, opset 21); activations stay float, no
             calibration. TensorRT keeps the weights in 4 bits and dequantizes them into the GEMM.

Each projection's input is first divided per channel by SmoothQuant's factors (a Mul), and its
weight rows multiplied by them: a few channels of an LLM's activations are far larger than the
rest, and one int8 scale per tensor that fits them leaves the others a handful of levels
(unsmoothed int8 took the default model from perplexity 5.09 to 14.4).

The activation scales come from the calibration set's feeds (`data.step_feeds`: prefill, decode
and verification shapes of the target's own text), which the manifest records with the recipe.
The output head stays float32 (its logits decide every accepted token; `kept_in_float32`), as do
attention's own products (activation by activation). The graph is converted to opset 21 (FP8
Q/DQ needs 19 or later).

ONNX Runtime runs these graphs on the CPU too (the tests check them there, and against TensorRT-RTX
building them), but slowly: they are meant for TensorRT; for the CPU use the MatMulNBits recipes.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from specrt.calibration import QDQ_SCHEMES
from specrt.calibration.blocks import float_source, replace_nodes, weight_matmuls, write_quantized
from specrt.calibration.data import CalibrationSet, activations, step_feeds
from specrt.errors import SpecrtError
from specrt.schema.graph_files import ONNX_FILE

# scheme -> (type, largest code, SmoothQuant alpha). The alphas are the best of 0.5/0.65/0.8/0.9
# on the default model (perplexity on the benchmark prompts, ORT on the CPU): int8 at 0.8 gave
# 5.67 (0.5: 7.15, 0.9: 5.79; unsmoothed 14.4; float32 5.09); fp8 keeps the outlier channels in
# its exponent and barely needs it (0.5: 5.36, 0.8: 5.62, unsmoothed 5.33).
SCHEMES = {"qdq-int8": ("int8", 127.0, 0.8), "qdq-fp8": ("fp8", 448.0, 0.5)}  # with activations (calibrated)
WEIGHT_ONLY = "qdq-int4"  # symmetric int4 blocks of 32 along the input axis, activations float
assert set(QDQ_SCHEMES) == {*SCHEMES, WEIGHT_ONLY}
OPSET = 21
INT4_BLOCK = 32
QDQ_VERSION = 3  # bumped whenever the recipe writes another graph


def quantize_weight(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes (K, N) int8 or float8_e4m3fn, scales (N,) float32) of a MatMul weight w (K, N),
    symmetric per output channel."""
    import ml_dtypes

    top = SCHEMES[f"qdq-{kind}"][1]
    amax = np.abs(w).max(0)
    scale = np.where(amax > 0, amax / top, 1.0).astype(np.float32)
    x = w / scale
    if kind == "int8":
        return np.clip(np.rint(x), -127, 127).astype(np.int8), scale
    return np.clip(x, -top, top).astype(ml_dtypes.float8_e4m3fn), scale


def _converted(onnx_dir: Path) -> tuple[dict, object, dict, list]:
    """(the float export's manifest, its graph converted to OPSET, {node index: weight (K, N)} of
    the decoder projections, the output head's node names). Converted first: the converter may
    add nodes, and the node indices are the converted graph's."""
    import onnx
    from onnx import version_converter

    source = float_source(onnx_dir)
    model = version_converter.convert_version(onnx.load(str(onnx_dir / ONNX_FILE)), OPSET)
    vocab = source["config"]["vocab_size"]
    found = weight_matmuls(model)
    weights = {i: w for i, w in found if w.shape[1] != vocab}
    if not weights:
        raise SpecrtError(f"no MatMul with a constant weight in {onnx_dir / ONNX_FILE}; is it a specrt step graph?")
    return source, model, weights, [model.graph.node[i].name for i, w in found if w.shape[1] == vocab]


def smoothing(amax: np.ndarray, weights: list[np.ndarray], alpha: float) -> np.ndarray:
    """SmoothQuant's per-input-channel factors s (K,): x W = (x / s)(s W) moves part of the
    activations' range into the weights, s_j = amax_j^alpha / wmax_j^(1 - alpha), wmax over every
    weight that reads the input. LLM activations have a few channels far larger than the rest,
    which one scale per tensor would crush the others to fit; the weights take them far better."""
    wmax = np.max([np.abs(w).max(1) for w in weights], axis=0)
    s = np.power(np.maximum(amax, 1e-8), alpha) / np.power(np.maximum(wmax, 1e-8), 1 - alpha)
    return np.where((amax > 0) & (wmax > 0), np.clip(s, 1e-4, 1e4), 1.0).astype(np.float64)


def _zero(kind: str, name: str):
    import ml_dtypes
    from onnx import numpy_helper

    dtype = np.int8 if kind == "int8" else ml_dtypes.float8_e4m3fn
    return numpy_helper.from_array(np.zeros((), dtype), name)


def quantize_qdq(
    onnx_dir: str | Path,
    out_dir: str | Path,
    scheme: str,
    calibration: CalibrationSet,
    progress: bool = True,
    max_len: int = 512,
    alpha: float | None = None,
) -> Path:
    """The float step graph in `onnx_dir` with Q/DQ on the decoder layers' projections (their
    inputs smoothed with SmoothQuant's `alpha`, default the scheme's), into `out_dir` (written
    atomically)."""
    from onnx import helper, numpy_helper

    if scheme not in SCHEMES:
        raise SpecrtError(f"unknown Q/DQ scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    kind, top, default_alpha = SCHEMES[scheme]
    alpha = default_alpha if alpha is None else alpha
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    t0 = time.perf_counter()
    feeds = step_feeds(onnx_dir, calibration, max_len=max_len)  # refuses a set of another model
    source, model, weights, kept = _converted(onnx_dir)
    inputs = sorted({model.graph.node[i].input[0] for i in weights})
    amax = {}  # per input channel: the largest |x| over every position of every feed
    for values in activations(model, feeds, inputs, f"{scheme}: activation ranges", progress):
        for name, x in values.items():
            m = np.abs(x.reshape(-1, x.shape[-1])).max(0)
            amax[name] = np.maximum(amax.get(name, 0.0), m)
    smooth = {
        a: smoothing(amax[a], [w for i, w in weights.items() if model.graph.node[i].input[0] == a], alpha)
        for a in inputs
    }

    graph = model.graph
    inits, nodes, done = [], [], {}
    for i, node in enumerate(graph.node):
        if i not in weights:
            nodes.append(node)
            continue
        a, base = node.input[0], f"qdq.{i}"
        if a not in done:  # one smoothing and Q/DQ per activation: q, k and v share theirs
            s = smooth[a]
            scale = numpy_helper.from_array(
                np.array(max((amax[a] / s).max(), 1e-8) / top, np.float32), f"{base}.x_scale"
            )
            zero = _zero(kind, f"{base}.x_zero")
            inits += [scale, zero, numpy_helper.from_array((1 / s).astype(np.float32), f"{base}.x_smooth")]
            nodes += [
                helper.make_node("Mul", [a, f"{base}.x_smooth"], [f"{base}.xs"], name=f"{base}/Smooth"),
                helper.make_node(
                    "QuantizeLinear", [f"{base}.xs", scale.name, zero.name], [f"{base}.xq"], name=f"{base}/Q"
                ),
                helper.make_node(
                    "DequantizeLinear", [f"{base}.xq", scale.name, zero.name], [f"{base}.x"], name=f"{base}/DQ"
                ),
            ]
            done[a] = f"{base}.x"
        codes, wscale = quantize_weight(smooth[a][:, None] * weights[i], kind)  # x W = (x / s)(s W)
        inits += [numpy_helper.from_array(codes, f"{base}.wq"), numpy_helper.from_array(wscale, f"{base}.w_scale")]
        nodes.append(
            helper.make_node(
                "DequantizeLinear", [f"{base}.wq", f"{base}.w_scale"], [f"{base}.w"], axis=1, name=f"{base}/WDQ"
            )
        )
        nodes.append(helper.make_node("MatMul", [done[a], f"{base}.w"], list(node.output), name=node.name))
    replace_nodes(graph, nodes, inits)
    quantization = {
        "scheme": scheme,
        "recipe_version": QDQ_VERSION,
        "method": f"explicit Q/DQ for TensorRT: {kind} weights per output channel, {kind} activations per tensor "
        "(static, largest |x| over the calibration feeds)",
        "bits": 8,
        "opset": OPSET,
        "smoothing": {"method": "SmoothQuant, per input channel", "alpha": alpha},
        "quantized_matmuls": len(weights),
        "kept_in_float32": kept,
        **calibration.manifest_fields(feeds, max_len),
    }
    source = {**source, "opset": OPSET}
    return write_quantized(model, source, onnx_dir, out_dir, quantization, t0, "ml_dtypes")


def quantize_weight_int4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes (K, N) int4, scales (K / 32, N) float32) of a MatMul weight w (K, N): symmetric,
    one scale per block of 32 along the input axis (the largest |w| of the block / 7)."""
    import ml_dtypes

    K, N = w.shape
    g = w.reshape(K // INT4_BLOCK, INT4_BLOCK, N)
    amax = np.abs(g).max(1)
    scale = np.where(amax > 0, amax / 7, 1.0).astype(np.float32)
    codes = np.clip(np.rint(g / scale[:, None, :]), -8, 7).reshape(K, N)
    return codes.astype(ml_dtypes.int4), scale


def quantize_qdq_int4(onnx_dir: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """The float step graph in `onnx_dir` with every decoder projection's weight as int4 blocks
    behind a DequantizeLinear (weight-only, for TensorRT), into `out_dir` (written atomically)."""
    from onnx import helper, numpy_helper

    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    t0 = time.perf_counter()
    source, model, weights, kept = _converted(onnx_dir)
    graph, nodes, inits = model.graph, [], []
    for i, node in enumerate(graph.node):
        if i in weights:
            base = f"qdq.{i}"
            codes, scale = quantize_weight_int4(weights[i])
            inits += [numpy_helper.from_array(codes, f"{base}.wq"), numpy_helper.from_array(scale, f"{base}.w_scale")]
            nodes.append(
                helper.make_node(
                    "DequantizeLinear",
                    [f"{base}.wq", f"{base}.w_scale"],
                    [f"{base}.w"],
                    axis=0,
                    block_size=INT4_BLOCK,
                    name=f"{base}/WDQ",
                )
            )
            node.input[1] = f"{base}.w"
        nodes.append(node)
    replace_nodes(graph, nodes, inits)
    quantization = {
        "scheme": WEIGHT_ONLY,
        "recipe_version": QDQ_VERSION,
        "method": "explicit DQ for TensorRT: int4 weights, symmetric, blocks of 32 inputs; activations float32",
        "bits": 4,
        "block_size": INT4_BLOCK,
        "opset": OPSET,
        "quantized_matmuls": len(weights),
        "kept_in_float32": kept,
    }
    return write_quantized(model, {**source, "opset": OPSET}, onnx_dir, out_dir, quantization, t0, "ml_dtypes")
