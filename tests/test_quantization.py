"""Weight-only INT8 / INT4 quantization (calibration/weight_only.py) and its engines.

The independent reference: the quantized graph's stored weights are read back and dequantized
here with numpy from the MatMulNBits layout (packed codes, per-block scales, zero point
2^(bits-1)), checked against the float weights (every weight within one scale step), and put
into our PyTorch model. At accuracy level 0 (float32 arithmetic) the ORT engine equals that model
within 1e-4 x the logits' range (measured 7e-6); at the default level 4 (int8 activations) within
5 % (measured 2-2.5 % on this random tiny model; `bench/bench_quant.py` measures the default
model's perplexity). Speculative decoding on a quantized engine gives that engine's plain greedy tokens.
"""

import dataclasses

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from specrt.calibration.weight_only import WeightOnlySpec, quantize_weight_only
from specrt.engines.build import BuildSpec, build_all
from specrt.engines.ort import build_ort_engine
from specrt.errors import SpecrtError
from specrt.export.checkpoint import load_model
from specrt.runtime.backends import TorchBackend
from specrt.runtime.drafts import make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.speculative import SpeculativeDecoder, make_policy
from specrt.schema.graph_files import read_onnx_manifest

IDS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 10, 11, 40, 41, 42, 5, 6, 7]]
VARIANTS = [("int8", 0), ("int4", 0), ("int8-a8", 4), ("int4-a8", 4)]  # (scheme, ORT accuracy level it implies)


@pytest.fixture(scope="module")
def quantized(tiny_artifacts, tmp_path_factory):
    out = {}
    for scheme, level in VARIANTS:
        d = tmp_path_factory.mktemp(f"{scheme}-{level}")
        spec = WeightOnlySpec(scheme=scheme, block_size=32)
        assert spec.accuracy_level == level
        qdir = quantize_weight_only(tiny_artifacts / "onnx", d / "onnx", spec, progress=False)
        out[scheme, level] = (qdir, Generator.from_engine(build_ort_engine(qdir, d / "engine")))
    return out


def logits(gen, ids=IDS):
    return gen.session.forward(gen.session.new_cache(1, 32), ids).logits[0]


def dequantized_weights(onnx_path) -> dict:
    """{torch parameter name: (dequantized weight (out, in) float64, scales (out, blocks))}."""
    model = onnx.load(str(onnx_path))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        a = {x.name: x.i for x in node.attribute}
        K, N, bits, block = a["K"], a["N"], a["bits"], a["block_size"]
        assert len(node.input) < 4 or not node.input[3], "symmetric: no zero-point input"
        packed, scales = inits[node.input[1]], inits[node.input[2]].reshape(N, -1).astype(np.float64)
        codes = np.stack([packed & 0x0F, packed >> 4], -1).reshape(N, -1) if bits == 4 else packed.reshape(N, -1)
        w = (codes[:, :K].astype(np.float64) - 2 ** (bits - 1)) * np.repeat(scales, block, axis=1)[:, :K]
        name = (
            "lm_head.weight"
            if "lm_head" in node.name
            else node.name.strip("/").removeprefix("model/").rsplit("/", 1)[0].replace("/", ".") + ".weight"
        )
        out[name] = (w, np.repeat(np.abs(scales), block, axis=1)[:, :K])
    return out


@pytest.mark.parametrize("scheme, level", VARIANTS)
def test_engine_computes_with_the_stored_weights(quantized, tiny_checkpoint, scheme, level):
    qdir, gen = quantized[scheme, level]
    model = load_model(tiny_checkpoint)
    fp32 = logits(Generator(TorchBackend(model)))
    params = dict(model.named_parameters())
    weights = dequantized_weights(qdir / "model.onnx")
    assert len(weights) == 2 * 7 + 1  # every projection of both layers and the LM head
    errors = []
    with torch.no_grad():
        for name, (w, step) in weights.items():
            errors.append(np.abs(params[name].double().numpy() - w) / step)
            params[name].copy_(torch.from_numpy(w).float())
    errors = np.concatenate([e.ravel() for e in errors])
    assert errors.max() <= 1.0 + 1e-6 and errors.mean() < 0.3  # round to nearest, the top code clamped
    ref = logits(Generator(TorchBackend(model)))
    got = logits(gen)
    span = float(fp32.max() - fp32.min())
    assert np.abs(got - ref).max() <= (1e-4 if level == 0 else 0.05) * span
    assert np.abs(got - fp32).max() > 1e-3  # quantization really changed the model


def test_manifest_and_refusals(quantized, tiny_artifacts, tmp_path):
    qdir = quantized["int4", 0][0]
    m = read_onnx_manifest(qdir)
    assert (
        m["quantization"]["scheme"] == "int4"
        and m["quantization"]["bits"] == 4
        and m["quantization"]["quantized_matmuls"] == 2 * 7 + 1
    )
    assert m["source_onnx"]["files"] == read_onnx_manifest(tiny_artifacts / "onnx")["files"]
    with pytest.raises(SpecrtError, match="already quantized"):
        quantize_weight_only(qdir, tmp_path / "twice", progress=False)
    with pytest.raises(SpecrtError, match="unknown quantization 'int3'"):
        quantize_weight_only(tiny_artifacts / "onnx", tmp_path / "x", WeightOnlySpec(scheme="int3"), progress=False)
    with pytest.raises(SpecrtError, match="block_size must be"):
        quantize_weight_only(tiny_artifacts / "onnx", tmp_path / "x", WeightOnlySpec(block_size=48), progress=False)
    assert not (tmp_path / "x").exists() and not (tmp_path / "twice").exists()


@pytest.mark.parametrize("scheme", ["int8", "int4"])  # the exact (float32-activation) schemes
def test_speculative_on_quantized_engine_equals_its_plain_greedy(quantized, scheme):
    gen = quantized[scheme, 0][1]
    prompts = [IDS[0], [20, 21, 22, 20, 21, 22, 20]]
    plain = [r.token_ids for r in gen.generate_ids(prompts, 40)]
    spec = [
        r.token_ids
        for r in SpeculativeDecoder(gen, make_proposer("suffix"), make_policy("auto")).generate_ids(prompts, 40)
    ]
    assert spec == plain


def test_batch_invariance_is_measured_and_warned_about(quantized, tiny_artifacts):
    """Every ORT engine records how much logits move between one- and multi-position steps;
    float32 and weight-only engines are at rounding level. A speculative decoder on an engine
    above the limit says that its output may differ from plain output (on the default model the
    -a8 engines are above it: test_default_model_int8_activations_are_not_batch_invariant)."""
    import warnings

    from specrt.engines.ort import BATCH_VARIANCE_LIMIT

    fp32 = Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")
    assert fp32.backend.caps.batch_invariance["relative"] < 1e-5
    for (scheme, level), (_, gen) in quantized.items():
        assert gen.backend.caps.batch_invariance["positions"] == 17
        if level == 0:
            assert gen.backend.caps.batch_invariance["relative"] < 1e-5, scheme
    gen = quantized["int4", 0][1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpeculativeDecoder(gen, make_proposer("suffix"))  # no warning
    measured = gen.backend.caps
    # the traced graph is not bitwise even with the step floor: its padded steps' bound is what counts
    assert not all(measured.batch_invariance["bitwise"].values())
    large = {"relative": 10 * BATCH_VARIANCE_LIMIT, "padded_relative": 10 * BATCH_VARIANCE_LIMIT}
    gen.backend.caps = dataclasses.replace(measured, batch_invariance={**measured.batch_invariance, **large})
    try:
        with pytest.warns(UserWarning, match="speculative output may differ from plain output"):
            SpeculativeDecoder(gen, make_proposer("suffix"))
    finally:
        gen.backend.caps = measured


@pytest.mark.real_model
def test_default_model_int8_activations_are_not_batch_invariant(real_artifacts, tmp_path):
    """On the default model ORT's int8-activation kernels for one position and for several
    differ (measured ~2 % of the logits' range): the build measures it and the decoder warns."""
    from specrt.engines.ort import BATCH_VARIANCE_LIMIT

    qdir = quantize_weight_only(
        real_artifacts / "onnx", tmp_path / "onnx", WeightOnlySpec(scheme="int8-a8"), progress=False
    )
    gen = Generator.from_engine(build_ort_engine(qdir, tmp_path / "engine"))
    assert gen.backend.caps.batch_invariance["relative"] > BATCH_VARIANCE_LIMIT
    with pytest.warns(UserWarning, match="speculative output may differ"):
        SpeculativeDecoder(gen, make_proposer("suffix"))
    exact = quantize_weight_only(
        real_artifacts / "onnx", tmp_path / "onnx4", WeightOnlySpec(scheme="int4"), progress=False
    )
    assert (
        Generator.from_engine(build_ort_engine(exact, tmp_path / "engine4")).backend.caps.batch_invariance["relative"]
        < BATCH_VARIANCE_LIMIT
    )


def test_build_engines_quantize_builds_and_reuses(tiny_checkpoint, tmp_path):
    out = tmp_path / "art"
    lines = list(build_all(BuildSpec(checkpoint=tiny_checkpoint, out=out, tensorrt="off", quantize="int4")))
    assert (
        any("onnx-fused-int4: quantized" in line for line in lines)
        and (out / "engines" / "ort-cpu-int4" / "manifest.json").is_file()
    )
    again = list(build_all(BuildSpec(checkpoint=tiny_checkpoint, out=out, tensorrt="off", quantize="int4")))
    # onnx, onnx-fused, its engine, onnx-fused-int4 (quantized from the fused graph), its engine
    assert sum("up to date" in line for line in again) == 5
    other = list(
        build_all(BuildSpec(checkpoint=tiny_checkpoint, out=out, tensorrt="off", quantize="int4", quant_block_size=64))
    )
    assert any("onnx-fused-int4: quantized" in line for line in other)  # another block size is another graph
    assert read_onnx_manifest(out / "onnx-fused-int4")["quantization"]["block_size"] == 64
