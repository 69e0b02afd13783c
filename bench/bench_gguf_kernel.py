"""The GGUF-block kernel (specrt/engines/kernels) against ONNX Runtime's MatMulNBits and ggml's own
CPU kernels, per block type.

specrt.GgufMatMul and MatMulNBits run on ONNX Runtime as one-node graphs, so both pay the same call
overhead: GgufMatMul reads the blocks as stored (mapped from a file), MatMulNBits (accuracy level
4: int8 activations, what the gguf-a8 engines run) its own 4- or 8-bit layout of the same shape (4
bits for the 4- and 5-bit types, 8 for Q6_K and Q8_0, as today's engines rewrite them). With
--llama-cpp, ggml's product runs on the same blocks (bench/ggml_peer.cpp, compiled here against that
build's ggml): "ggml" from its plain buffer (vec_dot), "ggml-repack" from the interleaved copy
llama-server makes where the type and CPU have one. Rows 1..16, interleaved (one call of each in
turn), repeated, medians; the table says ms, GB/s of each kernel's own bytes (ggml's: the file's),
each row count's cost over one row's, and how far ggml's outputs are from ours (ggml quantizes x
per 256 values for the k-quants, we per 32: the difference is that rounding, not an error).

    .venv/bin/python bench/bench_gguf_kernel.py [--threads 2] [--repeats 30] \
        [--llama-cpp PATH/llama.cpp]   # the folder DESIGN.md's recipe built (build/bin/libggml*.so)

Writes bench/results/gguf-kernel-<date>.json (date, versions, CPU, commit).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
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
ROWS = (1, 2, 3, 4, 5, 9, 16)
# Each kernel is timed hot, as in a decode loop: calls for WARM seconds first (ggml's OpenMP
# threads spin for milliseconds after their last product and would take a core from the next
# kernel; threads that slept wake slowly on this VM), then BLOCK timed calls.
WARM, BLOCK = 0.03, 5
SET, COPIES = 128 << 20, 32


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


def ours(path, t, n, k, threads, offset=0):
    node = helper.make_node("GgufMatMul", ["x"], ["y"], domain="specrt", file=str(path), offset=offset,
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


def copies(nbytes: int) -> int:
    """How many copies of a weight each kernel cycles through: a working set of SET bytes (beyond
    the L3 cache: each product reads its weight from memory, as a decode step does), COPIES at most
    (the smallest products then run from L3: the table says the set's size)."""
    return max(1, min(COPIES, -(-SET // nbytes)))


class Cycle:
    """Calls its functions in turn: each call the next copy of the weight."""

    def __init__(self, fns):
        self.fns, self.i = fns, 0

    def __call__(self, x):
        self.i += 1
        return self.fns[self.i % len(self.fns)](x)


def hot_block(call, x) -> list[float]:
    t_end = time.perf_counter() + WARM
    while time.perf_counter() < t_end:
        call(x)
    out = []
    for _ in range(BLOCK):
        t0 = time.perf_counter()
        call(x)
        out.append(time.perf_counter() - t0)
    return out


def read_bandwidth(threads: int = 1, repeats: int = 5) -> float:
    """GB/s of `threads` threads each summing its slice of 512 MiB (numpy, which lets go of the GIL
    in a reduction): the memory's read rate, roughly (what the one-row products are held to)."""
    a = np.ones(128 << 20, np.float32)
    parts = np.array_split(a, threads)
    with ThreadPoolExecutor(threads) as pool:
        best = min(timed_sums(pool, parts) for _ in range(repeats))
    return a.nbytes / best / 1e9


def timed_sums(pool, parts):
    t0 = time.perf_counter()
    list(pool.map(np.sum, parts))
    return time.perf_counter() - t0


def ggml_peer(llama_cpp: Path, tmp: Path):
    """bench/ggml_peer.cpp compiled against the ggml of a llama.cpp build (ctypes)."""
    include, libs = llama_cpp / "ggml" / "include", llama_cpp / "build" / "bin"
    if not (include / "ggml.h").is_file() or not list(libs.glob("libggml-cpu.so*")):
        raise SystemExit(f"--llama-cpp: {llama_cpp} has no ggml/include/ggml.h and build/bin/libggml-cpu.so; "
                         "build llama.cpp as DESIGN.md says (Peers on this machine)")  # fmt: skip
    out = tmp / "libggml_peer.so"
    source = Path(__file__).with_name("ggml_peer.cpp")
    cmd = ["g++", "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{include}", str(source),
           f"-L{libs}", "-lggml", "-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{libs}", "-o", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"bench/ggml_peer.cpp did not compile against {llama_cpp}:\n{run.stderr[-2000:]}")
    lib = ctypes.CDLL(str(out))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.peer_open.restype = ptr
    lib.peer_open.argtypes = [ctypes.c_int, i64, i64, ptr, ctypes.c_int]
    lib.peer_matmul.argtypes = [ptr, ptr, i64, ptr, ctypes.c_int]
    lib.peer_close.argtypes = [ptr]
    return lib


class Ggml:
    """One weight in ggml (plain or repacked); call(x) -> y."""

    def __init__(self, lib, t, w, n, k, repack, threads):
        self.lib, self.n, self.threads, self.w = lib, n, threads, w
        self.h = lib.peer_open(int(t), n, k, w.ctypes.data, int(repack))

    def __call__(self, x):
        y = np.empty((x.shape[0], self.n), np.float32)
        self.lib.peer_matmul(self.h, x.ctypes.data, x.shape[0], y.ctypes.data, self.threads)
        return y

    def close(self):
        if self.h:
            self.lib.peer_close(self.h)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--llama-cpp", type=Path, default=None, help="a built llama.cpp folder: ggml's kernels beside")
    args = p.parse_args()
    if not kernels.has_ort_ops():
        raise SystemExit(f"the kernel library's ONNX Runtime operators are not built: {kernels.why_not()}")
    rng = np.random.default_rng(0)
    rows_out = []
    print(f"{kernels.isa()} path, {args.threads} threads, {cpu_model()}; ms (GB/s, cost over one row)")
    with tempfile.TemporaryDirectory() as tmp:
        peer = ggml_peer(args.llama_cpp, Path(tmp)) if args.llama_cpp else None
        for t, n, k, where in SHAPES:
            w = blocks(t, n, k, rng)
            c = copies(w.nbytes)
            path = Path(tmp) / f"{t.name}.bin"
            path.write_bytes(w.tobytes() * c)
            mine = [ours(path, t, n, k, args.threads, i * w.nbytes) for i in range(c)]
            theirs = [matmulnbits(t, n, k, args.threads, rng) for _ in range(c)]
            calls = {
                "specrt": (Cycle([lambda x, s=s: s.run(None, {"x": x})[0] for s in mine]), None),
                "matmulnbits": (Cycle([lambda x, s=s: s.run(None, {"x": x})[0] for s, _ in theirs]), theirs[0][1]),
            }
            opened = []
            for name, repack in (("ggml", False), ("ggml-repack", True)) if peer else ():
                gs = [Ggml(peer, t, w, n, k, repack, args.threads) for _ in range(c)]
                opened += gs
                if gs[0].h:  # ggml-repack: only where this type and CPU have an interleaved copy
                    calls[name] = (Cycle(gs), None)
            print(f"{t.name} {n}x{k}: {c} copies of each weight, {c * w.nbytes / 1e6:.0f} MB a kernel cycles through")
            base = {}
            for m in ROWS:
                x = rng.standard_normal((m, k)).astype(np.float32)
                times = {name: [] for name in calls}
                for _ in range(max(1, args.repeats // BLOCK)):  # kernels in turn, a block each
                    for name, (call, _) in calls.items():
                        times[name] += hot_block(call, x)
                ref = calls["specrt"][0](x)
                row = {"type": t.name, "n": n, "k": k, "where": where, "rows": m, "copies": c}
                cells = []
                for name, (call, nbytes) in calls.items():
                    ms = statistics.median(times[name])
                    base.setdefault(name, ms)
                    row[f"{name}_ms"] = round(ms * 1e3, 4)
                    row[f"{name}_gbs"] = round((nbytes or w.nbytes) / ms / 1e9, 2)
                    row[f"{name}_vs_one_row"] = round(ms / base[name], 3)
                    if name.startswith("ggml"):
                        row[f"{name}_rel_diff"] = float(np.abs(call(x) - ref).max() / np.abs(ref).max())
                    cells.append(f"{name} {ms * 1e3:7.3f} ({row[f'{name}_gbs']:5.1f}, {ms / base[name]:4.2f})")
                rows_out.append(row)
                print(f"{t.name:5} {n:>5}x{k:<5} {m:>3} rows  " + "  ".join(cells))
            for g in opened:
                g.close()
    bandwidth, one = read_bandwidth(args.threads), read_bandwidth(1)
    print(f"read bandwidth (numpy): {bandwidth:.1f} GB/s with {args.threads} threads, {one:.1f} with one")
    for row in rows_out:  # what each kernel's own bytes streamed at, against that
        for name in ("specrt", "matmulnbits", "ggml", "ggml-repack"):
            if f"{name}_gbs" in row:
                row[f"{name}_of_read_bandwidth"] = round(row[f"{name}_gbs"] / bandwidth, 3)
    for row in (r for r in rows_out if r["rows"] == 1):
        print(f"{row['type']:5} {row['n']:>5}x{row['k']:<5} one row: specrt at {row['specrt_of_read_bandwidth']:.0%} "
              f"of the read bandwidth")  # fmt: skip
    out = {
        **envelope("onnxruntime", "numpy", "gguf"),
        "isa": kernels.isa(),
        "threads": args.threads,
        "repeats": args.repeats,
        "ggml": str(args.llama_cpp) if args.llama_cpp else None,
        "read_bandwidth_gbs": round(bandwidth, 1),
        "read_bandwidth_gbs_one_thread": round(one, 1),
        "rows": rows_out,
    }
    write_results(f"gguf-kernel-{datetime.date.today()}", out)


if __name__ == "__main__":
    main()
