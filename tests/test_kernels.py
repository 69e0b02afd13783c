"""The kernel library (specrt/engines/kernels): every block type against a float64 product of
the dequantized blocks (gguf's own numpy dequantization, an independent reader), the SIMD path
bitwise the scalar reference, every row's bits independent of the rows beside it and of the
thread count, the embedding's rows, and the ONNX Runtime operator on a file's bytes in place.

Skipped where the library is not built (make setup builds it; `make test` sets
SPECRT_REQUIRE_KERNELS=1, which turns the skip into a failure)."""

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from specrt.engines import kernels

if kernels.library() is None:
    if os.environ.get("SPECRT_REQUIRE_KERNELS") == "1":
        pytest.fail(f"SPECRT_REQUIRE_KERNELS=1 but the kernel library is not available: {kernels.why_not()}")
    pytest.skip(f"the kernel library is not available: {kernels.why_not()}", allow_module_level=True)

SIMD = [i for i in kernels.ISAS[1:] if kernels.ISAS.index(i) <= kernels.ISAS.index(kernels.isa())]
ALL = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K)
HALVES = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(t, n, k, seed=0):
    """n rows of k weights of type t: random bytes (every bit pattern is a valid block) with
    finite half-precision scales of a real model's size."""
    rng = np.random.default_rng(seed)
    size, nbytes = quants.GGML_QUANT_SIZES[t]
    blocks = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    for off in HALVES[t]:
        scales = (rng.uniform(0.2, 2.0, blocks.shape[:2]) * 0.01).astype(np.float16)
        blocks[:, :, off : off + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(n, -1)


def dequantized(t, w, n, k):
    return quants.dequantize(w, t).astype(np.float64).reshape(n, k)


def quantized_x(t, x, block=32):
    """x as the kernel quantizes it (d = max|x| / 127 per block of `block` values, 32 for every
    type; codes rint(x / d)), in float64: the product's exact reference."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, block)
    d = np.abs(xb).max(axis=2, keepdims=True) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv), -127, 127)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("t", ALL, ids=[t.name for t in ALL])
def test_each_block_type_against_float64(t):
    n, k = 48, 512
    w = random_blocks(t, n, k)
    x = np.random.default_rng(1).standard_normal((5, k)).astype(np.float32)
    y = kernels.matmul(int(t), w, n, k, x)
    wf = dequantized(t, w, n, k)
    exact = quantized_x(t, x) @ wf.T  # what the kernel computes, in float64
    scale = np.abs(exact).max()
    assert np.abs(y - exact).max() <= 2e-6 * scale, np.abs(y - exact).max() / scale
    plain = x.astype(np.float64) @ wf.T  # and what int8 activations cost against float x
    assert np.abs(y - plain).max() <= 2e-2 * np.abs(plain).max()


@pytest.mark.skipif(not SIMD, reason="this CPU has neither AVX2 nor AVX-512 VNNI: the reference is all it runs")
@pytest.mark.parametrize("path", SIMD)
@pytest.mark.parametrize("t", ALL, ids=[t.name for t in ALL])
def test_each_simd_path_is_the_scalar_reference_bit_for_bit(t, path):
    n, k = 40, 768 if t in (T.Q4_K, T.Q6_K) else 736  # 23 blocks of 32: a lone last block
    w, x = random_blocks(t, n, k, seed=2), np.random.default_rng(3).standard_normal((17, k)).astype(np.float32)
    try:
        assert kernels.force_isa(path) == path
        simd = kernels.matmul(int(t), w, n, k, x)
        assert kernels.force_isa("scalar") == "scalar"
        scalar = kernels.matmul(int(t), w, n, k, x)
    finally:
        kernels.force_isa(None)
    assert np.array_equal(simd, scalar), f"the {path} path differs from the scalar reference"


@pytest.mark.parametrize("path", ["scalar", *SIMD])
@pytest.mark.parametrize("t", ALL, ids=[t.name for t in ALL])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads(t, path):
    n, k = 200, 512
    w, x = random_blocks(t, n, k, seed=4), np.random.default_rng(5).standard_normal((40, k)).astype(np.float32)
    try:
        kernels.force_isa(path)
        whole = kernels.matmul(int(t), w, n, k, x, threads=2)
        for rows in (slice(0, 1), slice(3, 5), slice(7, 16), slice(16, 33), slice(0, 40)):
            for threads in (1, 2, 3):
                part = kernels.matmul(int(t), w, n, k, x[rows], threads=threads)
                assert np.array_equal(part, whole[rows]), (rows, threads)
    finally:
        kernels.force_isa(None)


@pytest.mark.parametrize("t", ALL, ids=[t.name for t in ALL])
def test_the_embeddings_rows_are_the_dequantized_blocks(t):
    n, k = 30, 512
    w = random_blocks(t, n, k, seed=6)
    ids = [0, 29, 7, 7]
    rows = kernels.get_rows(int(t), w, n, k, ids)
    np.testing.assert_allclose(rows, dequantized(t, w, n, k)[ids], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="outside"):
        kernels.get_rows(int(t), w, n, k, [30])


def test_a_weight_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="not 4 rows of 512 weights"):
        kernels.matmul(int(T.Q4_K), np.zeros(100, np.uint8), 4, 512, np.zeros((1, 512), np.float32))
    assert kernels.row_bytes(int(T.Q4_K), 100) == 0  # a k-quant needs k in blocks of 256


def _graph(path, offset, t, n, k, op="GgufMatMul", **more):
    import onnx
    from onnx import TensorProto, helper

    attrs = dict(file=str(path), offset=offset, ggml_type=int(t), n=n, k=k, **more)
    if op == "GgufMatMul":
        node = helper.make_node(op, ["x"], ["y"], domain=kernels.DOMAIN, **attrs)
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])]
    else:
        node = helper.make_node(op, ["x"], ["y"], domain=kernels.DOMAIN, **attrs)
        inputs = [helper.make_tensor_value_info("x", TensorProto.INT64, ["m"])]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "g", inputs, [out])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(kernels.DOMAIN, 1)]
    return onnx.helper.make_model(graph, opset_imports=opsets).SerializeToString()


def _session(model_bytes):
    import onnxruntime as ort

    so = ort.SessionOptions()
    assert kernels.register(so, threads=2)
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


@pytest.mark.skipif(not kernels.has_ort_ops(), reason="built without ONNX Runtime's headers")
@pytest.mark.parametrize("t", (T.Q4_K, T.Q6_K, T.Q8_0), ids=lambda t: t.name)
def test_the_onnx_runtime_operator_reads_the_files_bytes_in_place(t, tmp_path):
    n, k = 64, 512
    w = random_blocks(t, n, k, seed=7)
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"\x00" * 96 + w.tobytes() + b"\x01" * 32)  # the tensor at an offset, as in a GGUF
    x = np.random.default_rng(8).standard_normal((3, k)).astype(np.float32)
    y = _session(_graph(path, 96, t, n, k)).run(None, {"x": x})[0]
    assert np.array_equal(y, kernels.matmul(int(t), w, n, k, x))
    ids = np.array([5, 0, 63], np.int64)
    rows = _session(_graph(path, 96, t, n, k, op="GgufGather")).run(None, {"x": ids})[0]
    assert np.array_equal(rows, kernels.get_rows(int(t), w, n, k, ids))


@pytest.mark.skipif(not kernels.has_ort_ops(), reason="built without ONNX Runtime's headers")
@pytest.mark.parametrize("t", (T.Q4_K, T.Q5_0), ids=lambda t: t.name)
def test_one_operator_for_tensors_side_by_side_in_any_column_order(t, tmp_path):
    # a layer's q, k, v as one product: the parts' columns side by side, permuted by `order`,
    # each column the bits of its own tensor's product
    k, ns = 512, (48, 16, 24)
    ws = [random_blocks(t, n, k, seed=20 + i) for i, n in enumerate(ns)]
    path, offsets, data = tmp_path / "weights.gguf", [], b"\x00" * 64
    for w in ws:
        offsets.append(len(data))
        data += w.tobytes() + b"\x02" * 32
    path.write_bytes(data)
    order = np.random.default_rng(9).permutation(sum(ns))
    x = np.random.default_rng(10).standard_normal((5, k)).astype(np.float32)
    model = _graph(path, offsets[0], t, sum(ns), k, parts_offset=offsets, parts_n=list(ns), order=order.tolist())
    y = _session(model).run(None, {"x": x})[0]
    side = np.concatenate([kernels.matmul(int(t), w, n, k, x) for w, n in zip(ws, ns)], axis=-1)
    assert np.array_equal(y, side[:, order])
    with pytest.raises(Exception, match="do not agree with n"):
        _session(_graph(path, offsets[0], t, sum(ns) + 1, k, parts_offset=offsets, parts_n=list(ns))).run(
            None, {"x": x}
        )
    outside = [*order[:-1].tolist(), sum(ns)]  # a row past the tensors: refused at load, not read
    with pytest.raises(Exception, match="parts_offset, parts_n and order do not agree with n"):
        _session(_graph(path, offsets[0], t, sum(ns), k, parts_offset=offsets, parts_n=list(ns), order=outside)).run(
            None, {"x": x}
        )


@pytest.mark.skipif(not kernels.has_ort_ops(), reason="built without ONNX Runtime's headers")
def test_the_operator_names_a_file_that_is_gone_or_short(tmp_path):
    w = random_blocks(T.Q8_0, 8, 64)
    short = tmp_path / "short.gguf"
    short.write_bytes(w.tobytes()[:-1])
    x = np.zeros((1, 64), np.float32)
    for path, message in ((tmp_path / "gone.gguf", "cannot open the GGUF file"), (short, "is shorter than")):
        with pytest.raises(Exception, match=message) as e:
            _session(_graph(path, 0, T.Q8_0, 8, 64)).run(None, {"x": x})
        assert str(path) in str(e.value)


def test_without_the_library_register_says_no(monkeypatch):
    monkeypatch.setattr(kernels, "has_ort_ops", lambda: False)
    assert kernels.register(object()) is False


@pytest.mark.parametrize("t", (T.Q4_K, T.Q6_K), ids=lambda t: t.name)
def test_an_outlier_channel_costs_only_its_own_32_values(t):
    """Real activations carry a few channels far larger than the rest (Qwen2.5's do): x is
    quantized with a scale per 32 values, so an outlier coarsens its 32 neighbours, not the 256 of
    a k-quant block (a scale per 256 cost the 1.5B +4.2 % perplexity)."""
    n, k = 64, 1024
    w = random_blocks(t, n, k, seed=9)
    x = np.random.default_rng(10).standard_normal((6, k)).astype(np.float32)
    x[:, 5::256] = 40.0  # one outlier channel per 256
    wf = dequantized(t, w, n, k)
    plain = x.astype(np.float64) @ wf.T
    err = np.abs(kernels.matmul(int(t), w, n, k, x) - plain).mean()
    per_256 = np.abs(quantized_x(t, x, block=256) @ wf.T - plain).mean()
    assert err < 0.5 * per_256, (err, per_256)
