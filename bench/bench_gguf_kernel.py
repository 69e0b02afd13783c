"""The GGUF-block kernel (specrt/engines/kernels) against ONNX Runtime's MatMulNBits, per block type.

Each product runs on ONNX Runtime as a one-node graph, so both pay the same call overhead:
specrt.GgufMatMul reads the blocks as stored (mapped from a file), MatMulNBits (accuracy level 4:
int8 activations, what the gguf-a8 engines run) its own 4- or 8-bit layout of the same shape
(4 bits for the 4- and 5-bit types, 8 for Q6_K and Q8_0, as today's engines rewrite them). Rows
1..16, interleaved (one call of each in turn), repeated, medians; the table says ms, GB/s of each
kernel's own bytes, and each row count's cost over one row's.

    .venv/bin/python bench/bench_gguf_kernel.py [--threads 2] [--repeats 30]

Writes bench/results/gguf-kernel-<date>.json (date, versions, CPU, commit).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from gguf import GGMLQuantizationType as T
from gguf import quants
from onnx import TensorProto, helper, numpy_helper

from specrt.artifacts import cpu_model
from specrt.engines import kernels

from harness import envelope, write_results

# (type, N, K, where): the real models' products
SHAPES = [
    (T.Q4_K, 8960, 1536, "Qwen2.5-Coder-1.5B gate/up"),
    (T.Q4_K, 1536, 1536, "1.5B q/o"),
    (T.Q6_K, 1536, 8960, "1.5B down (Q6_K layers)"),
    (T.Q8_0, 4864, 896, "0.5B gate/up"),
    (T.Q5_0, 896, 4864, "0.5B down"),
    (T.Q4_1, 1536, 576, "SmolLM2-135M gate/up"),
    (T.Q4_0, 1536, 576, "Q4_0, the same shape"),
]
ROWS = (1, 2, 3, 5, 9, 16)


def blocks(t, n, k, rng):
    """n rows of random blocks with finite half scales (every other bit pattern is valid)."""
    size, nbytes = quants.GGML_QUANT_SIZES[t]
    b = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    for off in {T.Q4_1: (0, 2), T.Q4_K: (0, 2), T.Q6_K: (nbytes - 2,)}.get(t, (0,)):
        h = (rng.uniform(0.2, 2.0, b.shape[:2]) * 0.01).astype(np.float16)
        b[:, :, off : off + 2] = h.view(np.uint8).reshape(*b.shape[:2], 2)
    return b.reshape(n, -1)


def session(node, inputs, inits, threads):
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "g", inputs, [out], initializer=inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1), helper.make_opsetid("specrt", 1)]
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    kernels.register(so, threads)
    model = helper.make_model(graph, opset_imports=opsets)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def ours(path, t, n, k, threads):
    node = helper.make_node("GgufMatMul", ["x"], ["y"], domain="specrt", file=str(path), offset=0,
                            ggml_type=int(t), n=n, k=k)  # fmt: skip
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])
    return session(node, [x], [], threads)


def matmulnbits(t, n, k, threads, rng):
    bits = 8 if t in (T.Q6_K, T.Q8_0) else 4
    nb = k // 32
    packed = rng.integers(0, 256, (n, nb, 32 * bits // 8), dtype=np.uint8)
    scales = (rng.uniform(0.2, 2.0, n * nb) * 0.01).astype(np.float32)
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "S")]
    node = helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=32, accuracy_level=4)  # fmt: skip
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])
    return session(node, [x], inits, threads), packed.nbytes + scales.nbytes


def timed(sess, x):
    t0 = time.perf_counter()
    sess.run(None, {"x": x})
    return time.perf_counter() - t0


def read_bandwidth(repeats: int = 5) -> float:
    """GB/s of one thread summing 512 MiB (numpy): the memory's read rate, roughly."""
    a = np.ones(128 << 20, np.float32)
    best = min(timed_sum(a) for _ in range(repeats))
    return a.nbytes / best / 1e9


def timed_sum(a):
    t0 = time.perf_counter()
    a.sum()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    if not kernels.has_ort_ops():
        raise SystemExit(f"the kernel library's ONNX Runtime operators are not built: {kernels.why_not()}")
    rng = np.random.default_rng(0)
    rows_out = []
    print(f"{kernels.isa()} path, {args.threads} threads, {cpu_model()}")
    print(f"{'type':5} {'N x K':>11}  {'rows':>4}  {'specrt ms':>9} {'GB/s':>5} {'x1 row':>6}  "
          f"{'MatMulNBits ms':>14} {'GB/s':>5} {'x1 row':>6}  {'ratio':>5}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for t, n, k, where in SHAPES:
            w = blocks(t, n, k, rng)
            path = Path(tmp) / f"{t.name}.bin"
            path.write_bytes(w.tobytes())
            mine = ours(path, t, n, k, args.threads)
            theirs, their_bytes = matmulnbits(t, n, k, args.threads, rng)
            base = {}
            for m in ROWS:
                x = rng.standard_normal((m, k)).astype(np.float32)
                a, b = [], []
                for _ in range(3):
                    timed(mine, x), timed(theirs, x)
                for _ in range(args.repeats):  # interleaved
                    a.append(timed(mine, x))
                    b.append(timed(theirs, x))
                ma, mb = statistics.median(a), statistics.median(b)
                base.setdefault("a", ma), base.setdefault("b", mb)
                row = {
                    "type": t.name, "n": n, "k": k, "where": where, "rows": m,
                    "specrt_ms": round(ma * 1e3, 4), "specrt_gbs": round(w.nbytes / ma / 1e9, 2),
                    "specrt_vs_one_row": round(ma / base["a"], 3),
                    "matmulnbits_ms": round(mb * 1e3, 4), "matmulnbits_gbs": round(their_bytes / mb / 1e9, 2),
                    "matmulnbits_vs_one_row": round(mb / base["b"], 3), "matmulnbits_over_specrt": round(mb / ma, 3),
                }  # fmt: skip
                rows_out.append(row)
                print(
                    f"{t.name:5} {n:>5}x{k:<5}  {m:>4}  {row['specrt_ms']:>9.3f} {row['specrt_gbs']:>5.1f} "
                    f"{row['specrt_vs_one_row']:>6.2f}  {row['matmulnbits_ms']:>14.3f} "
                    f"{row['matmulnbits_gbs']:>5.1f} {row['matmulnbits_vs_one_row']:>6.2f}  "
                    f"{row['matmulnbits_over_specrt']:>5.2f}"
                )
    bandwidth = read_bandwidth()
    print(f"read bandwidth (numpy, one thread): {bandwidth:.1f} GB/s")
    out = {
        **envelope("onnxruntime", "numpy", "gguf"),
        "isa": kernels.isa(),
        "threads": args.threads,
        "repeats": args.repeats,
        "read_bandwidth_gbs_one_thread": round(bandwidth, 1),
        "rows": rows_out,
    }
    write_results(f"gguf-kernel-{datetime.date.today()}", out)


if __name__ == "__main__":
    main()
