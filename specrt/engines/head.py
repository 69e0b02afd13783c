"""Engines of draft heads: ONNX Runtime (the head's graph optimized once, cached with a manifest)
and TensorRT / TensorRT-RTX (a "draft" and a "catch-up" profile; running it needs a GPU).

Like the target's engine (engines/ort.py): ORT's level-ALL optimizations saved to disk, the
manifest carrying the head's facts (method, layers, draft vocabulary, the target it was trained
against) and the sha256 of its own files, including a copy of the draft-to-target map, so the
engine directory is all the runtime needs. onnxruntime is imported inside functions.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from specrt.artifacts import (
    ArtifactError,
    atomic_dir,
    check_files,
    cpu_model,
    file_sha256,
    package_versions,
    read_manifest,
    write_manifest,
)
from specrt.engines.ort import OrtOptions, check_built_here, graph_session, open_optimized
from specrt.engines.profiles import EngineShapes, ProfileSpec, Range, triple
from specrt.engines.trt import TrtBuildSpec, build_serialized
from specrt.errors import ManifestMismatchError
from specrt.schema.head_io import (
    D2T_FILE,
    HEAD_FILE,
    check_head_parity,
    head_family,
    read_draft_to_target,
    read_head_manifest,
)

HEAD_ENGINE_KIND = "ort-draft-head"
OPT_FILE, OPT_DATA = "head.opt.onnx", "head.opt.onnx.data"
HOW_TO_BUILD = "specrt build-draft --draft-dir DIR --model CHECKPOINT"
MANIFEST_FIELDS = {"head": dict, "target": dict, "provider": str, "host_cpu": str, "versions": dict}


def build_head_engine(onnx_dir: str | Path, out_dir: str | Path, options: OrtOptions = OrtOptions()) -> Path:
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    m = read_head_manifest(onnx_dir, verify="full")
    with atomic_dir(out_dir) as tmp:
        t0 = time.perf_counter()
        fix = f"re-export the head with: {HOW_TO_BUILD}"
        session, active = graph_session(onnx_dir / HEAD_FILE, options, fix, save_as=(tmp / OPT_FILE, OPT_DATA))
        del session
        shutil.copyfile(onnx_dir / D2T_FILE, tmp / D2T_FILE)
        write_manifest(
            tmp,
            HEAD_ENGINE_KIND,
            {
                "onnx": {"path": str(onnx_dir.resolve()), "files": m["files"]},
                **{k: m[k] for k in ("checkpoint", "config", "head", "target", "training", "ort_parity")},
                "provider": active,
                "host_cpu": cpu_model(),
                "build_seconds": round(time.perf_counter() - t0, 2),
                "files": {n: file_sha256(tmp / n) for n in (OPT_FILE, OPT_DATA, D2T_FILE)},
                "versions": package_versions("onnxruntime"),
            },
        )
    return out_dir


def load_head_engine(engine_dir: str | Path, options: OrtOptions | None = None, verify: str = "auto"):
    """(session, manifest, draft_to_target) of a built head engine, its manifest and files checked."""
    engine_dir = Path(engine_dir)
    m = read_manifest(engine_dir, HEAD_ENGINE_KIND, HOW_TO_BUILD, MANIFEST_FIELDS)
    check_built_here(m, f"head engine {engine_dir}", HOW_TO_BUILD)
    check_files(engine_dir, m, (OPT_FILE, OPT_DATA, D2T_FILE), HOW_TO_BUILD, verify)
    check_head_parity(m, engine_dir)
    session, _ = open_optimized(engine_dir, OPT_FILE, m, options, HOW_TO_BUILD)
    return session, m, read_draft_to_target(engine_dir, m)


class HeadSession:
    """A head engine's step as the proposers call it: `run(feeds)` with feeds by input name, the
    outputs in the graph's order. This one runs the ONNX Runtime engine; a head's TensorRT engine
    (built beside it where TensorRT is installed) needs a GPU to run and would be a sibling with
    the same `run`, so no proposer calls an engine's own API."""

    def __init__(self, engine_dir: str | Path, options: OrtOptions | None = None, verify: str = "auto"):
        self._session, self.manifest, self.draft_to_target = load_head_engine(engine_dir, options, verify)
        self.outputs = [o.name for o in self._session.get_outputs()]

    def run(self, feeds: dict) -> list:
        return self._session.run(None, feeds)


def open_head(draft_dir: str | Path, threads: int = 0, verify: str = "auto") -> HeadSession:
    """The engine a trained head drafts with, from its `train-draft` directory (the CPU's ORT
    engine; where a GPU runs TensorRT heads, this is where their session would be chosen)."""
    from specrt.layout import HeadLayout

    if not Path(draft_dir).is_dir():
        raise ArtifactError(
            f"--draft-dir {draft_dir} {'is a file' if Path(draft_dir).exists() else 'does not exist'}: give the "
            "directory of a trained draft (what specrt train-draft --out, specrt import-mtp --out or make drafts wrote)"
        )
    return HeadSession(HeadLayout(draft_dir).ort_engine("cpu"), OrtOptions(intra_op_threads=threads), verify)


def head_method(draft_dir: str | Path) -> str | None:
    """The method of the head whose engine is in a `train-draft` directory (None where there is no
    readable engine: opening it then says what is wrong)."""
    from specrt.layout import HeadLayout

    try:
        m = read_manifest(HeadLayout(draft_dir).ort_engine("cpu"), HEAD_ENGINE_KIND, HOW_TO_BUILD, MANIFEST_FIELDS)
    except (ArtifactError, OSError):  # the proposer's own open reports them
        return None
    return m["head"].get("method")


HEAD_TRT_KIND = "trt-draft-head"
HEAD_ENGINE_FILE = "head.engine"


def head_profiles(manifest: dict, shapes: EngineShapes) -> list[tuple[str, dict]]:
    """The head's TensorRT profiles: "draft" (Q 1..max_verify: a chain token, a tree depth's
    frontier, or the positions one verification committed) and "catch-up" (Q up to max_prefill:
    the prompt, fed in chunks); the past holds the context plus one tree's draft entries.
    A head without a cache (Medusa: one feature per row) has one "draft" profile over the
    batch. Every input's shape comes from the dimensions its family's graph declares
    (families/base.py HeadGraph.dims)."""
    shapes.profiles()  # validates the numbers
    cfg, graph = manifest["config"], head_family(manifest["head"]["method"])
    fixed = {
        "batch": Range(1, 1, shapes.max_batch),
        "hidden": cfg["hidden_size"],
        "features": manifest["head"]["feature_width"],
        "kv_heads": cfg["num_key_value_heads"],
        "head_dim": cfg["head_dim"],
    }

    def profile(**dims) -> dict:
        dims |= fixed
        return {n: triple(*(dims[d] for d in names)) for n, names in zip(graph.inputs, graph.dims)}

    if not graph.cached:
        return [("draft", profile())]
    past = Range(0, shapes.max_context // 2, shapes.max_context + shapes.max_verify)
    out = []
    for name, q in (
        ("draft", Range(1, min(4, shapes.max_verify), shapes.max_verify)),
        ("catch-up", Range(1, shapes.max_prefill // 2 or 1, shapes.max_prefill)),
    ):
        ProfileSpec(name, fixed["batch"], q, past).validate()
        out.append((name, profile(q=q, past=past, kv=q + past)))
    return out


def build_head_trt_engine(
    onnx_dir: str | Path, out_dir: str | Path, spec: TrtBuildSpec = TrtBuildSpec(), progress: bool = True
) -> Path:
    """A TensorRT / TensorRT-RTX engine of the head (profiles: head_profiles); running it needs a
    GPU, building it does not with TensorRT-RTX."""
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    m = read_head_manifest(onnx_dir)
    profiles = head_profiles(m, spec.shapes)
    built = build_serialized(onnx_dir / HEAD_FILE, profiles, spec, progress)
    with atomic_dir(out_dir) as tmp:
        (tmp / HEAD_ENGINE_FILE).write_bytes(memoryview(built.serialized))
        shutil.copyfile(onnx_dir / D2T_FILE, tmp / D2T_FILE)
        write_manifest(
            tmp,
            HEAD_TRT_KIND,
            {
                **built.facts,
                "onnx": {"path": str(onnx_dir.resolve()), "files": m["files"]},
                **{k: m[k] for k in ("checkpoint", "config", "head", "target", "training")},
                "profiles": [{"name": n, "shapes": {k: list(v) for k, v in s.items()}} for n, s in profiles],
                "files": {n: file_sha256(tmp / n) for n in (HEAD_ENGINE_FILE, D2T_FILE)},
            },
        )
    built.save_timing_cache()
    return out_dir


def read_head_trt_manifest(engine_dir: str | Path, verify: str = "auto") -> dict:
    """The head's TensorRT engine manifest, its TensorRT version and files checked."""
    from specrt.engines.trt import load_tensorrt

    how = "specrt build-draft --draft-dir DIR --model CHECKPOINT --tensorrt auto"
    m = read_manifest(engine_dir, HEAD_TRT_KIND, how, {"head": dict, "target": dict, "flavour": str})
    installed = load_tensorrt(m["flavour"])[1].__version__
    if installed != m.get("tensorrt_version"):
        raise ManifestMismatchError(
            f"head engine {engine_dir} was built with {m['flavour']} {m.get('tensorrt_version')}, {installed} is "
            f"installed; rebuild it with: {how}"
        )
    check_files(engine_dir, m, (HEAD_ENGINE_FILE, D2T_FILE), how, verify)
    return m
