"""The kernel's epilogue (specrt/engines/kernels/gguf_epilogue.cpp): a product's bias and SwiGLU
applied before its output leaves. SwiGLU against float64 on the kernel's own product, every SIMD
path bitwise the scalar reference (tails included), a row's bits independent of the rows beside
it and of the threads, and the ONNX Runtime operator's `bias` and `epilogue` attributes (a wrong
one refused by name).

Skipped where the library is not built (as tests/test_kernels.py; SPECRT_REQUIRE_KERNELS=1 fails)."""

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from specrt.engines import kernels

if kernels.library() is None:
    if os.environ.get("SPECRT_REQUIRE_KERNELS") == "1":
        pytest.fail(f"SPECRT_REQUIRE_KERNELS=1 but the kernel library is not available: {kernels.why_not()}")
    pytest.skip(f"the kernel library is not available: {kernels.why_not()}", allow_module_level=True)

from test_kernels import SIMD, _graph, _session, random_blocks  # noqa: E402

TYPES = (T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_1)


def _case(t, n=92, k=512, m=9, seed=30, scale=8.0):
    """Weights, x and a bias; n = 2 x 46: each half ends in a tail of 14 (AVX-512) or 6 (AVX2)
    lanes. x scaled so that the gate reaches far past e^t's clamp both ways."""
    rng = np.random.default_rng(seed)
    w = random_blocks(t, n, k, seed=seed)
    x = rng.standard_normal((m, k)) * scale
    x[0] *= 20  # one row far out
    return w, x.astype(np.float32), rng.standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_bias_and_swiglu_against_float64(t):
    n, k = 92, 512
    w, x, b = _case(t)
    plain = kernels.matmul(int(t), w, n, k, x)
    biased = kernels.matmul(int(t), w, n, k, x, bias=b)
    assert np.array_equal(biased, plain + b)  # one float add a value
    out = kernels.matmul(int(t), w, n, k, x, bias=b, epilogue="swiglu")
    assert out.shape == (x.shape[0], n // 2)
    g, u = biased[:, : n // 2].astype(np.float64), biased[:, n // 2 :].astype(np.float64)
    with np.errstate(over="ignore"):
        exact = g / (1 + np.exp(-g)) * u
    assert np.abs(g).max() > 100, "the case should reach e^t's clamp"
    err = np.abs(out - exact)  # a gate below -88 gives g u / (1 + e^88) for ~0: within 1e-25 here
    assert (err <= 2e-6 * np.abs(exact) + 1e-25).all(), (err / np.maximum(np.abs(exact), 1e-25)).max()


@pytest.mark.skipif(not SIMD, reason="this CPU has neither AVX2 nor AVX-512 VNNI: the reference is all it runs")
@pytest.mark.parametrize("path", SIMD)
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_each_simd_paths_swiglu_is_the_scalar_reference_bit_for_bit(t, path):
    w, x, b = _case(t, seed=31)
    try:
        assert kernels.force_isa(path) == path
        simd = kernels.matmul(int(t), w, 92, 512, x, bias=b, epilogue="swiglu")
        assert kernels.force_isa("scalar") == "scalar"
        scalar = kernels.matmul(int(t), w, 92, 512, x, bias=b, epilogue="swiglu")
    finally:
        kernels.force_isa(None)
    assert np.array_equal(simd, scalar), f"the {path} path's SwiGLU differs from the scalar reference"


@pytest.mark.parametrize("t", (T.Q4_K, T.Q5_0), ids=lambda t: t.name)
def test_a_rows_swiglu_does_not_depend_on_the_rows_beside_it_or_the_threads(t):
    n, k = 160, 512
    w, x, b = _case(t, n=n, k=k, m=24, seed=32)
    whole = kernels.matmul(int(t), w, n, k, x, threads=2, bias=b, epilogue="swiglu")
    for rows in (slice(0, 1), slice(3, 8), slice(5, 21)):  # 8+ rows: the epilogue's rows split over threads
        for threads in (1, 2, 3):
            part = kernels.matmul(int(t), w, n, k, x[rows], threads=threads, bias=b, epilogue="swiglu")
            assert np.array_equal(part, whole[rows]), (rows, threads)


def test_an_epilogue_it_does_not_take_is_refused():
    w, x, b = _case(T.Q8_0, n=6, k=64, m=1)
    with pytest.raises(ValueError, match="epilogue 'gelu'"):
        kernels.matmul(int(T.Q8_0), w, 6, 64, x, epilogue="gelu")
    with pytest.raises(ValueError, match="holds 5 values, not n = 6"):
        kernels.matmul(int(T.Q8_0), w, 6, 64, x, bias=b[:5])


@pytest.mark.skipif(not kernels.has_ort_ops(), reason="built without ONNX Runtime's headers")
def test_the_operators_bias_and_epilogue(tmp_path):
    t, n, k = T.Q4_K, 92, 512
    w, x, b = _case(t, m=3, seed=33)
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"\x00" * 64 + w.tobytes())
    y = _session(_graph(path, 64, t, n, k, bias=b.tolist(), epilogue="swiglu")).run(None, {"x": x})[0]
    assert np.array_equal(y, kernels.matmul(int(t), w, n, k, x, bias=b, epilogue="swiglu"))
    y = _session(_graph(path, 64, t, n, k, bias=b.tolist())).run(None, {"x": x})[0]
    assert np.array_equal(y, kernels.matmul(int(t), w, n, k, x, bias=b))
    for more, message in (({"bias": b[:7].tolist()}, "bias holds 7 values, not n 92"),
                          ({"epilogue": "gelu"}, "epilogue 'gelu' is not one it takes")):  # fmt: skip
        with pytest.raises(Exception, match=message):
            _session(_graph(path, 64, t, n, k, **more)).run(None, {"x": x})
