"""`build-engines`: checkpoint -> ONNX step graph -> engines, reusing what is up to date.

Layout of an artifact directory:
    <out>/onnx/                 model.onnx, model.onnx.data, manifest.json
    <out>/engines/ort-<prov>/   model.opt.onnx, model.opt.onnx.data, manifest.json
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from pathlib import Path
from typing import Iterator

from specrt.errors import SpecrtError


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    checkpoint: Path
    out: Path
    provider: str = "cpu"
    force: bool = False
    opset: int = 17


def onnx_dir(out: Path) -> Path:
    return Path(out) / "onnx"


def ort_engine_dir(out: Path, provider: str = "cpu") -> Path:
    return Path(out) / "engines" / f"ort-{provider}"


def _up_to_date(read, *args) -> bool:
    try:
        read(*args)
        return True
    except SpecrtError:
        return False


def build_all(spec: BuildSpec) -> Iterator[str]:
    """Build what is missing or stale; yields one line per artifact saying what happened."""
    from specrt.engines.ort import OrtOptions, build_ort_engine, read_engine_manifest
    from specrt.export.checkpoint import checkpoint_hash
    from specrt.export.step_graph import export_step_graph, read_onnx_manifest

    ckpt_hash = checkpoint_hash(spec.checkpoint)
    odir = onnx_dir(spec.out)
    if not spec.force and _up_to_date(read_onnx_manifest, odir, ckpt_hash):
        yield f"onnx      {odir}: up to date (checkpoint {ckpt_hash[:19]}…)"
        exported = False
    else:
        t0 = time.perf_counter()
        export_step_graph(spec.checkpoint, odir, opset=spec.opset)
        yield f"onnx      {odir}: exported in {time.perf_counter() - t0:.1f} s"
        exported = True

    edir = ort_engine_dir(spec.out, spec.provider)
    onnx_files = read_onnx_manifest(odir)["files"]
    fresh = not spec.force and not exported and _up_to_date(read_engine_manifest, edir, ckpt_hash)
    if fresh and read_engine_manifest(edir)["onnx"]["files"] == onnx_files:
        yield f"ort       {edir}: up to date"
    else:
        t0 = time.perf_counter()
        build_ort_engine(odir, edir, OrtOptions(provider=spec.provider))
        yield f"ort       {edir}: built for {read_engine_manifest(edir)['provider']} in {time.perf_counter() - t0:.1f} s"

    for lib in ("tensorrt", "tensorrt_rtx"):
        if importlib.util.find_spec(lib) is None:
            yield f"{lib:<9} skipped: the {lib} Python package is not installed"
        else:
            yield f"{lib:<9} skipped: TensorRT engine builds are not implemented in this version of specrt"
