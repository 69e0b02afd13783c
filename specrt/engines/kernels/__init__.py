"""The project's own kernels for a GGUF file's blocks: one room, C++ inside, Python outside.

    gguf_blocks.h     ggml's block formats, x quantized in blocks (what the kernel files share)
    gguf_matmul.cpp   y = x W^T from W's blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), x quantized to
                      int8 in blocks; threads split the output columns, every row computed in one
                      order whatever the rows and threads (bitwise row-invariant); the C API
    gguf_packed.cpp   every type packed 16 columns at a time (the file's size; Q4_K +2.8 %): one
    packed_simd.inc   dpbusd per 64 multiply-adds of a row, the body compiled for AVX-512 VNNI and
                      AVX2; the scalar reference on the file's own blocks (the same bits)
    gguf_epilogue.cpp what a product's output goes through before it leaves: SwiGLU (one fixed
                      sequence of float operations per lane, every path the reference's bits)
    ort_op.cpp        the ONNX Runtime operators on it (specrt.GgufMatMul, specrt.GgufGather), the
                      GGUF file mapped in place, a product's weight packed once a process
    build.py          `python -m specrt.engines.kernels` (make setup): g++ and ONNX Runtime's
                      C headers (Debian's libonnxruntime-dev) -> _build/libspecrt_kernels.so

    from specrt.engines import kernels
    lib = kernels.library()                   # None where it is not built: kernels.why_not() says why
    y = kernels.matmul(ggml_type, w, n, k, x)    # numpy, through ctypes (tests, benchmarks)
    kernels.register(session_options)         # the ORT operators; False (and one line) without them

Nothing above engines/ knows C++ exists: the graph writers name the operators, the engines load
them, and where the library is missing the engines run ONNX Runtime's MatMulNBits and say so once.
"""

from __future__ import annotations

import ctypes
import functools
import json
import threading
from pathlib import Path

import numpy as np

from specrt.engines.kernels.build import LIBRARY, RECORD, sources_digest

DOMAIN = "specrt"
# ggml's type numbers of the block types the kernels take
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
ISAS = ("scalar", "avx2", "avx512-vnni")
EPILOGUES = {None: 0, "swiglu": 1}  # gguf_matmul.cpp's Epilogue


def why_not() -> str | None:
    """Why the library cannot be used here (None when it can)."""
    try:
        record = json.loads(RECORD.read_text())
    except (OSError, ValueError):
        return "it was not built (make setup, or python -m specrt.engines.kernels)"
    if not record.get("built"):
        return str(record.get("why"))
    if record.get("sources") != sources_digest() or not LIBRARY.is_file():
        return "it is older than its sources (make setup builds it again)"
    return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel library (ctypes), or None (why_not() says why)."""
    if why_not() is not None:
        return None
    lib = ctypes.CDLL(str(LIBRARY))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.specrt_row_bytes.restype = i64
    lib.specrt_row_bytes.argtypes = [ctypes.c_int, i64]
    lib.specrt_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.specrt_matmul_ex.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int, ptr, ctypes.c_int]
    lib.specrt_get_rows.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr]
    lib.specrt_force_isa.argtypes = [ctypes.c_int]
    lib.specrt_set_threads.argtypes = [ctypes.c_int]
    if hasattr(lib, "specrt_set_base_dir"):  # built with the ONNX Runtime operators
        lib.specrt_set_base_dir.argtypes = [ctypes.c_char_p]
    return lib


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"specrt's kernel library is not available: {why_not()}")
    return lib


def has_ort_ops() -> bool:
    try:
        return library() is not None and bool(json.loads(RECORD.read_text()).get("ort_ops"))
    except (OSError, ValueError):
        return False


def isa() -> str:
    """The path this CPU runs: scalar, avx2 or avx512-vnni."""
    return ISAS[_lib().specrt_isa()]


def force_isa(name: str | None) -> str:
    """Run the scalar reference ("scalar") or the CPU's best path (None); returns the one in use."""
    return ISAS[_lib().specrt_force_isa(-1 if name is None else ISAS.index(name))]


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of a row of k weights of a type (0: a type or k the kernels do not take)."""
    return int(_lib().specrt_row_bytes(ggml_type, k))


def matmul(
    ggml_type: int, w: np.ndarray, n: int, k: int, x: np.ndarray, threads: int = 0, bias=None, epilogue=None
) -> np.ndarray:
    """y [m, n] = x [m, k] W^T (+ bias [n]) with W [n, row_bytes] uint8, the file's rows as stored;
    epilogue "swiglu": y [m, n/2] = silu(the first half) * the second half."""
    lib = _lib()
    w = np.ascontiguousarray(w, dtype=np.uint8)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, k)
    if w.size != n * lib.specrt_row_bytes(ggml_type, k) or w.size == 0:
        raise ValueError(f"W holds {w.size} bytes, not {n} rows of {k} weights of ggml type {ggml_type}")
    if epilogue not in EPILOGUES or (epilogue and n % 2):
        raise ValueError(f"epilogue {epilogue!r}: the kernels take {sorted(e for e in EPILOGUES if e)} (an even n)")
    b = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32).reshape(-1)
    if b is not None and b.size != n:
        raise ValueError(f"the bias holds {b.size} values, not n = {n}")
    y = np.empty((x.shape[0], n // 2 if epilogue else n), np.float32)
    bp = None if b is None else b.ctypes.data
    args = (ggml_type, w.ctypes.data, n, k, x.ctypes.data, x.shape[0], y.ctypes.data, threads, bp, EPILOGUES[epilogue])
    lib.specrt_matmul_ex(*args)
    return y


def get_rows(ggml_type: int, w: np.ndarray, n: int, k: int, ids) -> np.ndarray:
    """The rows ids of W, dequantized: [len(ids), k] float32."""
    lib = _lib()
    w = np.ascontiguousarray(w, dtype=np.uint8)
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    out = np.empty((ids.size, k), np.float32)
    if lib.specrt_get_rows(ggml_type, w.ctypes.data, n, k, ids.ctypes.data, ids.size, out.ctypes.data) != 0:
        raise ValueError(f"a row id outside 0..{n - 1}, or a type or k the kernels do not take")
    return out


# held from register(base_dir=...) until the session is created: a node's relative file path starts
# from the folder set for the session being created
SESSION_LOCK = threading.Lock()


def register(session_options, threads: int = 0, base_dir: str | Path | None = None) -> bool:
    """Add the library's ONNX Runtime operators to `session_options` (their columns split over
    `threads`, 0: one per core; nodes' relative file paths start from `base_dir`, set for the
    sessions created next: hold SESSION_LOCK until yours is); False where the library or its
    operators are not built."""
    if not has_ort_ops():
        return False
    lib = _lib()
    lib.specrt_set_threads(threads)
    lib.specrt_set_base_dir(str(Path(base_dir).resolve()).encode() if base_dir is not None else b"")
    session_options.register_custom_ops_library(str(Path(LIBRARY)))
    return True
