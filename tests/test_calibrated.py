"""The fitted int4 recipes (HQQ, GPTQ) and their calibration data, on the tiny model.

HQQ's engine must compute exactly HQQ's weights (checked against the float engine of a checkpoint
holding those weights), GPTQ must use its calibration data (its output error on it is below round
to nearest's) and refuse another model's, and the calibration feeds must be the activations of
real generation steps (a step over a tail with the prefill's KV gives the logits of one prefill
of the whole sequence)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from specrt.calibration.calibrated import awq_scales, gptq_blocks, hqq_blocks, q8_blocks, rtn_blocks
from specrt.calibration.data import TAILS, CalibrationSet, step_feeds
from specrt.engines.build import BuildSpec, build_all
from specrt.errors import SpecrtError
from specrt.export.checkpoint import checkpoint_hash, load_model
from specrt.layout import ArtifactLayout
from specrt.runtime.generator import Generator

from conftest import TINY_HF, save_checkpoint


def _calibration_set(ckpt, n=12, seed=0) -> CalibrationSet:
    rng = np.random.default_rng(seed)
    seqs = tuple(tuple(rng.integers(3, TINY_HF["vocab_size"], int(rng.integers(20, 60))).tolist()) for _ in range(n))
    return CalibrationSet(checkpoint_hash(ckpt), {"test": "random tokens"}, seqs)


@pytest.fixture(scope="module")
def built(tiny_checkpoint, tmp_path_factory):
    """build-engines output of the tiny model with the hqq and gptq graphs and engines."""
    out = tmp_path_factory.mktemp("calibrated") / "art"
    cal_file = out.parent / "set.json"
    _calibration_set(tiny_checkpoint).save(cal_file)
    for scheme in ("hqq", "gptq", "awq", "int4"):
        spec = BuildSpec(checkpoint=tiny_checkpoint, out=out, quantize=scheme, calibration=cal_file, tensorrt="off")
        list(build_all(spec))
    return out, cal_file


def _prefill_logits(engine, prompts):
    gen = Generator.from_engine(engine)
    return gen.session.prefill(gen.session.new_cache(len(prompts), 96), prompts).logits


def test_hqq_blocks_are_hqqs_weights():
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, HQQWeightOnlyQuantizer

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 24)) * rng.uniform(0.05, 2, (1, 24))).astype(np.float32)
    w[3, 5] = 9.0  # an outlier
    b = hqq_blocks(w)
    q, scale, zero = HQQWeightOnlyQuantizer(HQQWeightOnlyQuantConfig(block_size=32)).quantize_internal(
        torch.from_numpy(w.T.copy()), bits=4, group_size=32, round_zero=False
    )
    hqq = ((q.float() - zero.repeat_interleave(32, 1)) * scale.repeat_interleave(32, 1)).numpy()
    assert b.layout == "Q4_1" and b.q.min() >= 0 and b.q.max() <= 15
    assert np.abs(b.dequantize() - hqq).max() <= 1e-6 * np.abs(w).max()  # the same weights, float rounding apart
    # the fit is better than min-max rounding of the same blocks (its lp objective, p < 1, and l1)
    blocks = w.T.reshape(24, 2, 32)
    lo, hi = blocks.min(-1, keepdims=True), blocks.max(-1, keepdims=True)
    rtn = (np.round((blocks - lo) / (hi - lo) * 15) * (hi - lo) / 15 + lo).reshape(24, 64)
    assert np.abs(b.dequantize() - w.T).mean() < np.abs(rtn - w.T).mean()


def _minmax_rtn(w: np.ndarray) -> np.ndarray:
    """Round to nearest on each block of 32 rows of w (K, N), min-max with a float offset: what
    GPTQ does to each block when nothing is fed back."""
    g = w.reshape(-1, 32, w.shape[1])
    lo, hi = g.min(1, keepdims=True), g.max(1, keepdims=True)
    scale = (hi - lo) / 15
    return (lo + scale * np.clip(np.round((g - lo) / scale), 0, 15)).reshape(w.shape)


def test_the_head_recipe_finds_a_gguf_q8_0_head_again():
    import gguf

    rng = np.random.default_rng(5)
    w = rng.standard_normal((8, 96)).astype(np.float32)  # (N, K), as GGUF stores it
    qtype = gguf.GGMLQuantizationType.Q8_0
    on_grid = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(8, 96)
    b = q8_blocks(on_grid.T.copy())
    assert np.abs(b.dequantize() - on_grid).max() <= 1e-6 * np.abs(on_grid).max()


def test_gptq_without_correlated_inputs_is_round_to_nearest():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((96, 10))
    b = gptq_blocks(w, np.diag(rng.uniform(0.5, 2, 96)))  # a diagonal Hessian: no error to push on
    assert b.layout == "Q4_1" and b.q.min() >= 0 and b.q.max() <= 15
    assert np.abs(b.dequantize().T - _minmax_rtn(w)).max() <= 1e-6


def test_a_block_on_a_4bit_grid_is_found_again():
    rng = np.random.default_rng(4)
    d, m = rng.uniform(0.01, 0.1, (1, 2, 1, 8)), rng.uniform(-1, 0, (1, 2, 1, 8))
    codes = rng.integers(0, 16, (1, 2, 32, 8))
    codes[..., 0, :], codes[..., 1, :] = 0, 15  # min-max made the grid: both ends occur
    w = (d * codes + m).reshape(64, 8).astype(np.float32)
    x = rng.standard_normal((500, 64)) @ (rng.standard_normal((64, 64)) * 0.3 + np.eye(64))
    for b in (gptq_blocks(w, x.T @ x / 500), hqq_blocks(w)):
        assert np.abs(b.dequantize().T - w).max() <= 1e-5 * np.abs(w).max()


def test_gptq_lowers_the_output_error_on_its_activations():
    rng = np.random.default_rng(3)
    mix = rng.standard_normal((64, 64)) * 0.3 + np.eye(64)
    x = rng.standard_normal((2000, 64)) @ mix  # correlated inputs
    w = rng.standard_normal((64, 24))
    h = x.T @ x / len(x)
    err = {
        "gptq": np.linalg.norm(x @ (gptq_blocks(w, h, percdamp=0.01).dequantize().T - w)),
        "rtn": np.linalg.norm(x @ (_minmax_rtn(w) - w)),
    }
    assert err["gptq"] < 0.8 * err["rtn"], err
    # ONNX Runtime's own GPTQ (1.32) feeds no error back: it gives min-max rounding (see calibrated.py)
    from onnxruntime.quantization.neural_compressor.weight_only import gptq

    def ort_gptq(h):
        return gptq(w.copy(), h.copy(), num_bits=4, group_size=32, scheme="asym", percdamp=0.01)

    assert np.array_equal(ort_gptq(h), ort_gptq(np.eye(64)))  # its result ignores the activations


def test_awq_scales_keep_the_outputs_of_large_activation_channels():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((400, 64))
    x[:, :4] *= 30  # a few channels carry most of the activation (as in LLMs)
    ws = [rng.standard_normal((64, 16)), rng.standard_normal((64, 8))]
    s, alpha, ratio = awq_scales(x, np.abs(x).mean(0), ws)
    assert alpha > 0 and ratio < 0.8  # better than plain rounding on its sample
    w = np.concatenate(ws, axis=1)
    err = np.linalg.norm(x @ w - (x / s) @ rtn_blocks(s[:, None] * w).dequantize().T)
    assert err == pytest.approx(np.sqrt(ratio) * np.linalg.norm(x @ w - x @ rtn_blocks(w).dequantize().T), rel=1e-3)
    assert s[:4].min() > s[4:].max()  # the large channels get the finer steps
    # on weights already on a 4-bit grid, plain rounding is exact and stays chosen
    grid = rtn_blocks(w).dequantize().T
    assert awq_scales(x, np.abs(x).mean(0), [grid])[1] == 0.0


def test_the_hqq_engine_computes_hqqs_weights(built, tiny_checkpoint, tmp_path):
    out, _ = built
    layout = ArtifactLayout(out)
    q = json.loads((layout.quant_onnx("hqq") / "manifest.json").read_text())["quantization"]
    assert q["scheme"] == "hqq" and q["rewritten_matmuls"] == {"Q4_1": 7 * TINY_HF["num_hidden_layers"], "Q8_0": 1}
    assert len(q["kept_in_8bit"]) == 1  # the output head
    engine = json.loads((layout.ort_engine("cpu", "hqq") / "manifest.json").read_text())
    assert engine["batch_invariance"]["relative"] <= 1e-4 and engine["precision"] == "hqq"
    # reference: the float engine of a checkpoint whose weights are HQQ's dequantized weights
    # (the output head's: its 8-bit blocks)
    model = load_model(tiny_checkpoint)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                recipe = q8_blocks if mod.out_features == TINY_HF["vocab_size"] else hqq_blocks
                mod.weight.copy_(torch.from_numpy(recipe(mod.weight.numpy().T.copy()).dequantize()))
    ref_ckpt = save_checkpoint(model, TINY_HF, tmp_path / "hqq-weights")
    list(build_all(BuildSpec(checkpoint=ref_ckpt, out=tmp_path / "ref", tensorrt="off")))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 128, 40).tolist(), rng.integers(3, 128, 9).tolist()]
    ref = _prefill_logits(ArtifactLayout(tmp_path / "ref").ort_engine("cpu"), prompts)
    got = _prefill_logits(layout.ort_engine("cpu", "hqq"), prompts)
    assert np.abs(ref - got).max() <= 1e-4 * np.abs(ref).max()


def test_calibration_feeds_are_real_generation_steps(tiny_artifacts, tiny_checkpoint):
    cal = _calibration_set(tiny_checkpoint, n=3)
    feeds = step_feeds(ArtifactLayout(tiny_artifacts).onnx, cal)
    assert len(feeds) == 6
    assert [f["input_ids"].shape[1] for f in feeds[1::2]] == list(TAILS)  # decode, then verification shapes
    assert [f["past_key_values.0.key"].shape[2] for f in feeds[0::2]] == [0, 0, 0]
    gen = Generator.from_engine(ArtifactLayout(tiny_artifacts).ort_engine("cpu"))
    import onnxruntime as ort

    sess = ort.InferenceSession(str(ArtifactLayout(tiny_artifacts).onnx / "model.onnx"))
    for seq, tail in zip(cal.sequences, feeds[1::2]):
        whole = gen.session.forward(gen.session.new_cache(1, len(seq)), [list(seq)]).logits[0]
        got = sess.run(["logits"], tail)[0][0]
        q = tail["input_ids"].shape[1]
        assert np.abs(got - whole[-q:]).max() <= 1e-4 * np.abs(whole).max()


def test_gptq_fits_its_calibration_data(built, tiny_checkpoint):
    out, cal_file = built
    layout = ArtifactLayout(out)
    q = json.loads((layout.quant_onnx("gptq") / "manifest.json").read_text())["quantization"]
    cal = CalibrationSet.load(cal_file)
    assert q["calibration_sha256"] == cal.sha256 and q["calibration"]["sequences"] == 12
    assert q["rewritten_matmuls"] == {"Q4_1": 7 * TINY_HF["num_hidden_layers"], "Q8_0": 1}
    engine = json.loads((layout.ort_engine("cpu", "gptq") / "manifest.json").read_text())
    assert engine["batch_invariance"]["relative"] <= 1e-4
    # on the calibration sequences GPTQ's logits are closer to float32's than round to nearest's
    prompts = [list(s) for s in cal.sequences[:6]]
    ref = _prefill_logits(layout.ort_engine("cpu"), prompts)
    err = {s: np.abs(_prefill_logits(layout.ort_engine("cpu", s), prompts) - ref).mean() for s in ("gptq", "int4")}
    assert err["gptq"] < err["int4"], err
    # an up-to-date build keeps it; another calibration set makes it again
    spec = BuildSpec(checkpoint=tiny_checkpoint, out=out, quantize="gptq", calibration=cal_file, tensorrt="off")
    assert any("up to date" in line and "onnx-gptq" in line for line in build_all(spec))
    _calibration_set(tiny_checkpoint, seed=1).save(cal_file.with_name("other.json"))
    spec = dataclasses.replace(spec, calibration=cal_file.with_name("other.json"))
    assert any("quantized" in line and "onnx-gptq" in line for line in build_all(spec))


def test_awq_engine_divides_its_inputs_and_fits_its_data(built):
    out, cal_file = built
    layout = ArtifactLayout(out)
    q = json.loads((layout.quant_onnx("awq") / "manifest.json").read_text())["quantization"]
    assert q["rewritten_matmuls"] == {"Q4_1": 7 * TINY_HF["num_hidden_layers"], "Q8_0": 1}
    assert q["calibration_sha256"] == CalibrationSet.load(cal_file).sha256 and q["sample_error_vs_rounding"] <= 1.0
    import onnx

    graph = onnx.load(str(layout.quant_onnx("awq") / "model.onnx"), load_external_data=False).graph
    assert sum(n.op_type == "Mul" and n.name.endswith("awq_scaled/Mul") for n in graph.node) == 4 * 2  # per layer
    engine = json.loads((layout.ort_engine("cpu", "awq") / "manifest.json").read_text())
    assert engine["batch_invariance"]["relative"] <= 1e-4
    prompts = [list(s) for s in CalibrationSet.load(cal_file).sequences[:6]]
    ref = _prefill_logits(layout.ort_engine("cpu"), prompts)
    err = {s: np.abs(_prefill_logits(layout.ort_engine("cpu", s), prompts) - ref).mean() for s in ("awq", "int4")}
    assert err["awq"] < err["int4"], err


def test_calibration_data_of_another_model_is_refused(built, tiny_checkpoint, tmp_path):
    out, _ = built
    other = CalibrationSet("sha256:" + "0" * 64, {"test": "another model"}, ((5, 6, 7),) * 4)
    other.save(tmp_path / "other.json")
    spec = BuildSpec(
        checkpoint=tiny_checkpoint, out=out, quantize="gptq", calibration=tmp_path / "other.json", tensorrt="off"
    )
    with pytest.raises(SpecrtError, match="made by another model"):
        list(build_all(spec))
    (tmp_path / "broken.json").write_text("{")
    spec = dataclasses.replace(spec, calibration=tmp_path / "broken.json")
    with pytest.raises(SpecrtError, match="not a calibration set"):
        list(build_all(spec))
