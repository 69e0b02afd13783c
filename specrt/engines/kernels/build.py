"""Build the kernel library: `python -m specrt.engines.kernels` (run by `make setup`).

    specrt/engines/kernels/_build/libspecrt_kernels.so   the kernels (C API for ctypes) and, where
                                                         ONNX Runtime's C headers were found, the
                                                         operators ONNX Runtime loads
    specrt/engines/kernels/_build/build.json             what was built from which sources

The system compiler (g++) builds it, for every x86-64 CPU (the SIMD paths are chosen at run time).
ONNX Runtime's headers ship in no wheel; they come from Debian's `libonnxruntime-dev` package
(a newer release's, fetched without installing it; the C API is versioned and append-only, so a
library built against older headers loads in a newer onnxruntime), or from $SPECRT_ORT_INCLUDE.
Nothing here fails a set-up: a library that cannot be built is one line, and the engines run ONNX
Runtime's own MatMulNBits instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD = HERE / "_build"
LIBRARY = BUILD / "libspecrt_kernels.so"
RECORD = BUILD / "build.json"
SOURCES = (
    "gguf_blocks.h",
    "gguf_matmul.cpp",
    "gguf_packed.cpp",
    "gguf_quantize.cpp",
    "gguf_epilogue.cpp",
    "packed_simd.inc",
    "ort_op.cpp",
)
HEADERS = BUILD / "ort-include"
# the Debian release whose libonnxruntime-dev carries the C API headers (1.21.0 in trixie)
DEBIAN_SOURCE = "deb http://deb.debian.org/debian trixie main"
# -ffp-contract=off: no fused multiply-add the source does not write (every path keeps the reference's bits)
FLAGS = [
    "-O3",
    "-std=c++17",
    "-ffp-contract=off",
    "-fPIC",
    "-shared",
    "-pthread",
    "-Wall",
    "-Wno-psabi",
    "-Wno-maybe-uninitialized",
]


def sources_digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode() + (HERE / name).read_bytes())
    return h.hexdigest()[:16]


def ort_headers() -> Path | None:
    """The folder with onnxruntime_c_api.h and onnxruntime_lite_custom_op.h: $SPECRT_ORT_INCLUDE,
    an earlier fetch, or Debian's package fetched now (85 KB); None where none can be had."""
    wanted = ("onnxruntime_c_api.h", "onnxruntime_cxx_api.h", "onnxruntime_lite_custom_op.h")
    for folder in (os.environ.get("SPECRT_ORT_INCLUDE"), HEADERS):
        if folder and all((Path(folder) / f).is_file() for f in wanted):
            return Path(folder)
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "lists" / "partial").mkdir(parents=True)
        (t / "cache" / "archives" / "partial").mkdir(parents=True)
        (t / "sources.list").write_text(DEBIAN_SOURCE + "\n")
        opts = ["-o", f"Dir::Etc::sourcelist={t / 'sources.list'}", "-o", "Dir::Etc::sourceparts=-"]
        opts += ["-o", f"Dir::State::Lists={t / 'lists'}", "-o", f"Dir::Cache={t / 'cache'}", "-q"]
        try:
            for cmd in (["apt-get", *opts, "update"], ["apt-get", *opts, "download", "libonnxruntime-dev"]):
                subprocess.run(cmd, cwd=t, check=True, capture_output=True, timeout=300)
            deb = next(t.glob("libonnxruntime-dev_*.deb"))
            subprocess.run(["dpkg-deb", "-x", str(deb), str(t / "x")], check=True, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError, StopIteration):
            return None
        found = next((p.parent for p in (t / "x").rglob("onnxruntime_c_api.h")), None)
        if found is None or not all((found / f).is_file() for f in wanted):
            return None
        shutil.rmtree(HEADERS, ignore_errors=True)
        HEADERS.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(found, HEADERS)
    return HEADERS


def build(quiet: bool = False) -> dict:
    """Compile the library (unless it is current); returns what build.json records: the sources'
    digest, whether the ONNX Runtime operators are in it, and why not."""
    digest = sources_digest()
    try:
        record = json.loads(RECORD.read_text())
    except (OSError, ValueError):
        record = {}
    if record.get("sources") == digest and LIBRARY.is_file() and record.get("ort_ops"):
        return record
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return _record({"sources": digest, "built": False, "why": "no C++ compiler (apt-get install g++)"})
    headers = ort_headers()
    files = [str(HERE / n) for n in SOURCES if n.endswith(".cpp") and n != "ort_op.cpp"]
    defines = []
    if headers is not None:
        files.append(str(HERE / "ort_op.cpp"))
        defines = [f"-I{headers}"]
    BUILD.mkdir(parents=True, exist_ok=True)
    tmp = LIBRARY.with_name(f".{LIBRARY.name}.{os.getpid()}.tmp")
    cmd = [compiler, *FLAGS, *defines, *files, "-o", str(tmp)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        tmp.unlink(missing_ok=True)
        lines = run.stderr.strip().splitlines()
        first = next((line for line in lines if "error" in line), lines[-1] if lines else str(run.returncode))
        why = f"the compiler failed: {first.strip()}"
        return _record({"sources": digest, "built": False, "why": why})
    os.replace(tmp, LIBRARY)
    why = None if headers is not None else "ONNX Runtime's C headers could not be fetched (Debian's libonnxruntime-dev)"
    return _record({"sources": digest, "built": True, "ort_ops": headers is not None, "why": why, "compiler": compiler})


def _record(record: dict) -> dict:
    BUILD.mkdir(parents=True, exist_ok=True)
    tmp = RECORD.with_name(f".{RECORD.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, RECORD)
    return record


def main() -> int:
    record = build()
    if not record.get("built"):
        print(f"specrt kernels: not built ({record['why']}); the engines run ONNX Runtime's MatMulNBits instead")
    elif not record.get("ort_ops"):
        print(f"specrt kernels: built without ONNX Runtime's operators ({record['why']}); the engines run MatMulNBits")
    else:
        print(f"specrt kernels: {LIBRARY}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
