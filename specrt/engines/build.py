"""`build-engines`: checkpoint -> ONNX step graph -> engines, reusing what is up to date.

Where each artifact goes is `specrt.layout.ArtifactLayout`: onnx/, engines/ort-<provider>/,
engines/trt-<flavour>/ and, with --quantize, onnx-<scheme>/ and engines/ort-<provider>-<scheme>/.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Iterator

from specrt.calibration import GGUF_SCHEMES, HALF_SCHEMES, KERNEL_SCHEMES, QDQ_SCHEMES, TRT_SCHEMES
from specrt.engines.memory import require_memory
from specrt.engines.trt import TrtBuildSpec
from specrt.errors import SpecrtError
from specrt.layout import ArtifactLayout


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    checkpoint: Path | None  # None: only engines, from the graphs --out holds (_engines_from_graphs)
    out: Path
    provider: str = "cpu"
    force: bool = False
    opset: int = 17
    tensorrt: str = "auto"  # auto: build when a TensorRT flavour is installed; "off"; or a flavour
    trt: TrtBuildSpec = TrtBuildSpec()
    quantize: str = (
        "none"  # none, gguf or a calibration.weight_only scheme: also build that quantized graph and its ORT engine
    )
    quant_block_size: int = 32
    # the ORT engines' step graph: "fused" (export/fused_graph.py: ORT's fused operators, the
    # cache written in place) where a recipe writes one (FUSED_SCHEMES, FUSED_WEIGHT_ONLY), else "portable"
    graph: str = "fused"
    gguf: Path | None = None  # --quantize gguf: the GGUF file (default: the one the checkpoint was converted from)
    # --quantize gptq: the calibration set (calibration.data.CalibrationSet), or a function that
    # makes it from the float ORT engine just built (the CLI's, which runs the target)
    calibration: Path | None = None
    make_calibration: Callable[[Path], Path] | None = None


# schemes whose fused graph is written from the checkpoint or GGUF (gguf-k: from the GGUF alone)
FUSED_SCHEMES = ("none", *GGUF_SCHEMES, *KERNEL_SCHEMES)
FROM_GGUF = (*GGUF_SCHEMES, *KERNEL_SCHEMES)  # schemes that compute from a GGUF file's blocks
# schemes quantized from the float32 fused graph (its MatMuls become MatMulNBits, as on the portable one)
FUSED_WEIGHT_ONLY = ("int4", "int8", "int4-a8", "int8-a8")


def _records(manifest: dict | None, wanted: dict) -> bool:
    """The manifest (or a part of it) exists and records every wanted field at its value."""
    return manifest is not None and all(manifest.get(k) == v for k, v in wanted.items())


def _manifest_if_valid(read, *args) -> dict | None:
    """The artifact's manifest when `read` accepts it (present, current, matching), else None."""
    try:
        return read(*args)
    except SpecrtError:
        return None


def build_all(spec: BuildSpec) -> Iterator[str]:
    """Build what is missing or stale; yields one line per artifact saying what happened.

    One build at a time writes to `spec.out` (a second is refused); it starts by removing the
    temporary directories a build that was killed left behind (up to an engine's size each)."""
    from specrt.artifacts import clean_stale_temporaries, exclusive_lock
    from specrt.export.checkpoint import load_config

    if spec.checkpoint is None:  # a copied folder: its engines made again here from its graphs
        with exclusive_lock(spec.out, "specrt build-engines"):
            clean_stale_temporaries(spec.out)
            yield from _engines_from_graphs(spec)
        return
    _check_context(load_config(spec.checkpoint), spec.checkpoint)  # before anything is written
    if spec.quantize in KERNEL_SCHEMES:
        from specrt.engines import kernels

        if not kernels.has_ort_ops():  # the fallback: the same blocks on MatMulNBits
            yield (
                f"{spec.quantize:<9} specrt's kernel library is not available ({kernels.why_not()}): building "
                "gguf-a8 (MatMulNBits) instead"
            )
            spec = dataclasses.replace(spec, quantize="gguf-a8")
    if spec.quantize in GGUF_SCHEMES:  # the file's block types, before the float export's minutes
        from specrt.calibration.gguf_blocks import require_block_types
        from specrt.export.gguf import open_gguf

        gguf = _gguf_file(spec)
        require_block_types(open_gguf(gguf), gguf)
    with exclusive_lock(spec.out, "specrt build-engines"):
        for stale in clean_stale_temporaries(spec.out):
            yield f"cleaned   {stale}: left by an interrupted build"
        try:
            yield from _build_all(spec)
        except MemoryError:  # an allocation refused (the kernel's kill is what require_memory heads off)
            from specrt.engines.memory import out_of_memory

            raise out_of_memory(spec.checkpoint) from None


def _weights_in_gguf(checkpoint: Path) -> bool:
    """A .gguf file, or a directory converted from one with its weights left there."""
    from specrt.export.checkpoint import gguf_weights

    return gguf_weights(checkpoint) is not None


def _check_context(cfg, checkpoint) -> None:
    """Refuse, before anything is written, a model whose context cannot hold the steps an
    engine's build measures (and the runtime verifies): its largest verification step after one
    position, with the step floor's padding."""
    from specrt.engines.ort_measure import min_context
    from specrt.engines.profiles import EngineShapes

    if cfg.max_position_embeddings < min_context():
        raise SpecrtError(
            f"{checkpoint}: the model's context length is {cfg.max_position_embeddings} positions "
            f"(max_position_embeddings in its config.json); an engine needs at least {min_context()} (a prefix "
            f"position, a verification step of {EngineShapes.max_verify} and the step floor's padding). "
            "Give the model's real context length in config.json."
        )


def _build_all(spec: BuildSpec) -> Iterator[str]:
    from specrt.export.checkpoint import checkpoint_hash, load_config
    from specrt.export.step_graph import export_step_graph
    from specrt.schema.graph_files import read_onnx_manifest
    from specrt.schema.head_io import default_target_layers

    if spec.graph not in ("fused", "portable"):
        raise SpecrtError(f"graph flavour {spec.graph!r}: choose fused or portable")
    ckpt_hash = checkpoint_hash(spec.checkpoint)
    layers = list(default_target_layers(load_config(spec.checkpoint).num_hidden_layers))
    yield from _model_files(spec, ckpt_hash)
    if _weights_in_gguf(spec.checkpoint) and spec.quantize in FROM_GGUF and spec.graph == "fused":
        # the weights stay in the file: build what the engine of its blocks needs, streamed from it
        yield "onnx      skipped: the weights stay in the GGUF file (its float32 graphs: --quantize none)"
        yield from _build_fused(spec, ckpt_hash, layers, spec.quantize)
        return
    odir = ArtifactLayout(spec.out).onnx
    onnx_manifest = None if spec.force else _manifest_if_valid(read_onnx_manifest, odir, ckpt_hash)
    if onnx_manifest is not None and onnx_manifest["hidden_layers"] != layers:
        yield f"onnx      {odir}: returns the features of layers {onnx_manifest['hidden_layers']}, not {layers}"
        onnx_manifest = None  # an export made before draft heads read several layers
    exported = onnx_manifest is None
    if not exported:
        yield f"onnx      {odir}: up to date (checkpoint {ckpt_hash[:19]}…)"
    else:
        require_memory(spec.checkpoint, "exporting the step graph")
        t0 = time.perf_counter()
        export_step_graph(spec.checkpoint, odir, opset=spec.opset)
        yield f"onnx      {odir}: exported in {time.perf_counter() - t0:.1f} s"
        onnx_manifest = read_onnx_manifest(odir)
    onnx_files = onnx_manifest["files"]

    if spec.graph == "fused":
        yield from _build_fused(spec, ckpt_hash, layers)
    else:
        yield from _build_ort(spec, odir, onnx_files, ckpt_hash, stale=exported)
    yield from _build_tensorrt(spec, odir, onnx_files, ckpt_hash, exported)
    if spec.quantize != "none":
        yield from _build_quantized(spec, odir, onnx_files, ckpt_hash)


def _engines_from_graphs(spec: BuildSpec) -> Iterator[str]:
    """Without a checkpoint: the ORT engine of --quantize's graph in an artifacts folder (copied
    from another machine, or with another onnxruntime), built for this CPU from the graph and the
    run-time files the folder carries. The graphs themselves are CPU-independent."""
    from specrt.artifacts import MANIFEST
    from specrt.schema.graph_files import read_onnx_manifest

    layout = ArtifactLayout(spec.out)
    flavour = "fused" if spec.graph == "fused" and spec.quantize in (*FUSED_SCHEMES, *FUSED_WEIGHT_ONLY) else "portable"
    odir = layout.source_onnx(spec.quantize, flavour)
    if not (odir / MANIFEST).is_file():
        raise SpecrtError(
            f"{odir} holds no step graph, and without --model an engine is built only from the graph an artifacts "
            f"folder carries; give the checkpoint: specrt build-engines --model CHECKPOINT --out {spec.out} "
            f"--quantize {spec.quantize}"
        )
    m = read_onnx_manifest(odir)
    yield from _build_ort(spec, odir, m["files"], m["checkpoint"]["hash"], stale=False, quantize=spec.quantize)
    yield "tensorrt  skipped: without --model only ONNX Runtime engines are built"


def _model_files(spec: BuildSpec, ckpt_hash: str) -> Iterator[str]:
    """The tokenizer, chat template and config a run reads, copied beside the engines
    (schema/model_files.py): the artifacts folder then runs without the checkpoint."""
    from specrt.schema.model_files import write_model_files

    folder, written = write_model_files(spec.checkpoint, spec.out, ckpt_hash)
    if folder is None:
        yield f"model     skipped: {spec.checkpoint} has no tokenizer.json (runs read the checkpoint)"
    elif written:
        yield f"model     {folder}: the tokenizer, chat template and config a run reads, copied"


def _build_fused(spec: BuildSpec, ckpt_hash: str, layers: list[int], scheme: str = "none") -> Iterator[str]:
    """The fused step graph of a scheme (float32: "none") and its ORT engine, each reused when
    current."""
    from specrt.export.fused_graph import FUSED_VERSION, export_fused_graph
    from specrt.schema.graph_files import read_onnx_manifest

    fdir = ArtifactLayout(spec.out).fused_onnx(scheme)
    current = None if spec.force else _manifest_if_valid(read_onnx_manifest, fdir, ckpt_hash)
    wanted = {"graph_flavour": "fused", "fused_version": FUSED_VERSION, "hidden_layers": layers}
    make = lambda: export_fused_graph(spec.checkpoint, fdir, tuple(layers), spec.opset)  # noqa: E731
    if scheme in KERNEL_SCHEMES:
        from specrt.calibration.gguf_kernel import RECIPE_VERSION, fused_in_place

        gguf = _gguf_in_folder(spec, _gguf_file(spec))
        fields = {"scheme": scheme, "recipe_version": RECIPE_VERSION}
        if not _records((current or {}).get("quantization"), fields) or _gguf_changed(current, gguf):
            current = None
        make = lambda: fused_in_place(spec.checkpoint, fdir, gguf, tuple(layers), spec.opset)  # noqa: E731
    if scheme in GGUF_SCHEMES:
        from specrt.calibration.gguf_blocks import fused_from_gguf

        gguf_fields, gguf = _gguf_source(spec)
        if not _records((current or {}).get("quantization"), gguf_fields):
            current = None
        make = lambda: fused_from_gguf(spec.checkpoint, fdir, gguf, tuple(layers), spec.opset, scheme)  # noqa: E731
    fresh = not _records(current, wanted)
    if fresh:
        streamed = _gguf_file(spec) if scheme in FROM_GGUF and _weights_in_gguf(spec.checkpoint) else None
        require_memory(
            spec.checkpoint, f"writing the fused graph ({'float32' if scheme == 'none' else scheme})", streamed
        )
    label = "fused" if scheme == "none" else scheme
    yield _made_or_kept(label, fdir, fresh, make, "written" if scheme == "none" else "quantized")
    files = read_onnx_manifest(fdir)["files"]
    note = f" (TensorRT takes no MatMulNBits graph: none built for {scheme})" if scheme in GGUF_SCHEMES else ""
    note = f" (specrt's own kernel: no TensorRT engine for {scheme})" if scheme in KERNEL_SCHEMES else note
    yield from _build_ort(spec, fdir, files, ckpt_hash, stale=fresh, quantize=scheme, note=note)


def _build_quantized(spec: BuildSpec, odir: Path, onnx_files: dict, ckpt_hash: str) -> Iterator[str]:
    from specrt.schema.graph_files import read_onnx_manifest

    if spec.graph == "fused" and spec.quantize in FUSED_SCHEMES:
        yield from _build_fused(
            spec, ckpt_hash, read_onnx_manifest(odir, verify="none")["hidden_layers"], spec.quantize
        )
        return

    qdir = ArtifactLayout(spec.out).quant_onnx(spec.quantize)
    if spec.graph == "fused" and spec.quantize in FUSED_WEIGHT_ONLY:  # from the float32 fused graph
        odir, qdir = ArtifactLayout(spec.out).fused_onnx(), ArtifactLayout(spec.out).fused_onnx(spec.quantize)
        onnx_files = read_onnx_manifest(odir)["files"]
    current = None if spec.force else _manifest_if_valid(read_onnx_manifest, qdir, ckpt_hash)
    wanted, make = _quantizer(spec, odir, qdir)
    fresh = (
        current is None
        or current.get("source_onnx", {}).get("files") != onnx_files
        or not _records(current["quantization"], wanted)
    )
    yield _made_or_kept(spec.quantize, qdir, fresh, make, "quantized")
    qfiles = read_onnx_manifest(qdir)["files"]
    if spec.quantize in TRT_SCHEMES:  # for TensorRT; the ORT engine lets the CPU check it
        from specrt.calibration.half import NO_ORT

        if spec.quantize in NO_ORT:
            yield f"ort       skipped: ONNX Runtime's CPU provider has no kernels for {spec.quantize}"
        else:
            yield from _build_ort(spec, qdir, qfiles, ckpt_hash, stale=fresh, quantize=spec.quantize)
        yield from _build_tensorrt(spec, qdir, qfiles, ckpt_hash, fresh, scheme=spec.quantize)
        return
    yield from _build_ort(
        spec,
        qdir,
        qfiles,
        ckpt_hash,
        stale=fresh,
        quantize=spec.quantize,
        note=f" (TensorRT takes no MatMulNBits graph: none built for {spec.quantize})",
    )


def _standard_graph(spec: BuildSpec, ckpt_hash: str):
    """Write the standard step graph (export/standard_graph.py) unless current; yields its
    line, returns whether it was written."""
    from specrt.export.standard_graph import STANDARD_VERSION, export_standard_graph
    from specrt.schema.graph_files import read_onnx_manifest

    sdir = ArtifactLayout(spec.out).standard_onnx
    layers = read_onnx_manifest(ArtifactLayout(spec.out).onnx, verify="none")["hidden_layers"]
    current = None if spec.force else _manifest_if_valid(read_onnx_manifest, sdir, ckpt_hash)
    wanted = {"graph_flavour": "standard", "standard_version": STANDARD_VERSION, "hidden_layers": layers}
    fresh = not _records(current, wanted)
    make = lambda: export_standard_graph(spec.checkpoint, sdir, tuple(layers))  # noqa: E731
    yield _made_or_kept("standard", sdir, fresh, make, "written")
    return fresh


def _made_or_kept(label: str, path: Path, fresh: bool, make, verb: str) -> str:
    """Make the artifact at `path` when it is not current (`fresh`); the line that says so."""
    if not fresh:
        return f"{label:<9} {path}: up to date"
    t0 = time.perf_counter()
    make()
    return f"{label:<9} {path}: {verb} in {time.perf_counter() - t0:.1f} s"


def _quantizer(spec: BuildSpec, odir: Path, qdir: Path):
    """(the quantization fields an up-to-date graph has, a function that makes it)."""
    if spec.quantize in GGUF_SCHEMES:
        from specrt.calibration.gguf_blocks import quantize_from_gguf

        wanted, gguf = _gguf_source(spec)
        return wanted, lambda: quantize_from_gguf(odir, qdir, gguf, scheme=spec.quantize)

    if spec.quantize == "hqq":
        from specrt.calibration.calibrated import RECIPE_VERSION, quantize_hqq

        return {"scheme": "hqq", "recipe_version": RECIPE_VERSION}, lambda: quantize_hqq(odir, qdir)
    if spec.quantize in ("gptq", "awq"):
        from specrt.calibration import calibrated

        cal = _calibration(spec, odir)
        wanted = {
            "scheme": spec.quantize,
            "recipe_version": calibrated.RECIPE_VERSION,
            "calibration_sha256": cal.sha256,
        }
        recipe = calibrated.quantize_gptq if spec.quantize == "gptq" else calibrated.quantize_awq
        return wanted, lambda: recipe(odir, qdir, cal)
    if spec.quantize == "qdq-int4":  # weight-only: no calibration
        from specrt.calibration.qdq import QDQ_VERSION, quantize_qdq_int4

        return {"scheme": spec.quantize, "recipe_version": QDQ_VERSION}, lambda: quantize_qdq_int4(odir, qdir)
    if spec.quantize in HALF_SCHEMES:
        from specrt.calibration.half import HALF_VERSION, export_half

        wanted = {"scheme": spec.quantize, "recipe_version": HALF_VERSION}
        return wanted, lambda: export_half(spec.checkpoint, odir, qdir, spec.quantize)
    if spec.quantize in QDQ_SCHEMES:
        from specrt.calibration.qdq import QDQ_VERSION, quantize_qdq

        cal = _calibration(spec, odir)
        wanted = {"scheme": spec.quantize, "recipe_version": QDQ_VERSION, "calibration_sha256": cal.sha256}
        return wanted, lambda: quantize_qdq(odir, qdir, spec.quantize, cal)

    from specrt.calibration.weight_only import WeightOnlySpec, quantize_weight_only

    wspec = WeightOnlySpec(scheme=spec.quantize, block_size=spec.quant_block_size)
    wspec.validate()
    return {**dataclasses.asdict(wspec), "accuracy_level": wspec.accuracy_level}, lambda: quantize_weight_only(
        odir, qdir, wspec
    )


def _gguf_in_folder(spec: BuildSpec, gguf: Path) -> Path:
    """The GGUF inside the artifacts folder, as a hard link (no second copy on disk), so that a
    copied folder carries the weights its gguf-k engine reads in place; the file itself where no
    link can be made (another file system)."""
    import os

    target = ArtifactLayout(spec.out).gguf_dir / gguf.name
    if target.is_file() and os.path.samefile(target, gguf):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.link.tmp")
    try:
        tmp.unlink(missing_ok=True)
        os.link(gguf, tmp)
        os.replace(tmp, target)
    except OSError:
        return gguf
    return target


def _gguf_changed(manifest: dict | None, gguf: Path) -> bool:
    """A gguf-k graph written from another file or another content of it."""
    from specrt.schema.checkpoint_files import file_digest

    recorded = ((manifest or {}).get("quantization") or {}).get("gguf") or {}
    return recorded.get("sha256") != file_digest(gguf)


def _gguf_file(spec: BuildSpec) -> Path:
    """The GGUF file --quantize gguf computes from: --gguf, or the one the checkpoint is or reads its
    weights from, or the one it records it was converted from."""
    from specrt.export.checkpoint import gguf_weights
    from specrt.export.gguf import gguf_origin

    gguf = spec.gguf or gguf_weights(spec.checkpoint) or gguf_origin(spec.checkpoint)
    if gguf is None:
        raise SpecrtError(
            f"--quantize {spec.quantize} computes from the GGUF file's own blocks, and {spec.checkpoint} records no "
            "GGUF file "
            "it was converted from (or the file moved or changed); give it with --gguf FILE"
        )
    if not Path(gguf).is_file():
        raise SpecrtError(f"--gguf {gguf}: no such file")
    return Path(gguf)


def _gguf_source(spec: BuildSpec) -> tuple[dict, Path]:
    """(the quantization fields a current gguf graph records, the GGUF file) of --quantize gguf."""
    from specrt.calibration.gguf_blocks import RECIPE_VERSION
    from specrt.schema.checkpoint_files import file_digest

    gguf = _gguf_file(spec)
    return {
        "scheme": spec.quantize,
        "recipe_version": RECIPE_VERSION,
        "gguf": {"file": Path(gguf).name, "sha256": file_digest(gguf)},
    }, Path(gguf)


def _calibration(spec: BuildSpec, odir: Path):
    """The calibration set a recipe fits to: --calibration, else the one `make_calibration`
    makes (or reuses) with the float engine; refused when another model made it."""
    from specrt.calibration.data import CalibrationSet
    from specrt.schema.graph_files import read_onnx_manifest

    path = spec.calibration
    if path is None and spec.make_calibration is not None:
        path = spec.make_calibration(ArtifactLayout(spec.out).ort_engine(spec.provider))
    if path is None:
        raise SpecrtError(
            f"--quantize {spec.quantize} fits to calibration data: make a set with `specrt calibrate` and give it "
            "with --calibration FILE"
        )
    cal = CalibrationSet.load(path)
    cal.require_target(read_onnx_manifest(odir)["checkpoint"]["hash"], str(spec.checkpoint))
    return cal


def _build_ort(
    spec: BuildSpec, odir: Path, onnx_files: dict, ckpt_hash: str, stale: bool, quantize: str = "none", note: str = ""
) -> Iterator[str]:
    """The ORT engine of the graph in `odir`: reused when its manifest is valid and built from
    `onnx_files` (and the graph was not just re-made: `stale`), else built."""
    from specrt.engines.ort import OrtOptions, build_ort_engine, kernels_changed, read_engine_manifest

    edir = ArtifactLayout(spec.out).ort_engine(spec.provider, quantize)
    current = None if spec.force or stale else _manifest_if_valid(read_engine_manifest, edir, ckpt_hash)
    # an engine built before its step costs, its bitwise check, its one-position steps or its step
    # cuts were measured, or that holds a copy of its graph, is rebuilt (ORT's optimization and
    # the probes: seconds to minutes)
    shapes = (current or {}).get("batch_invariance", {}).get("bitwise", {})
    measured = current is not None and "step_ms" in current and "unpadded" in shapes and "graph_dir" in current
    measured = measured and ("step_cuts" in current or current.get("graph_flavour") != "fused")
    # an engine that reads its tokenizer from the checkpoint while the artifacts carry it
    model_files = ArtifactLayout(spec.out).model_files
    measured = measured and (current.get("model_dir") is not None or not model_files.is_dir())
    # an engine measured on another build of the kernel library (gguf-k)
    measured = measured and not kernels_changed(current)
    if measured and current["onnx"]["files"] == onnx_files:
        yield f"ort       {edir}: up to date"
    else:
        t0 = time.perf_counter()
        build_ort_engine(odir, edir, OrtOptions(provider=spec.provider))
        provider = read_engine_manifest(edir)["provider"]
        yield f"ort       {edir}: built for {provider} in {time.perf_counter() - t0:.1f} s{note}"


def _build_tensorrt(
    spec: BuildSpec, odir: Path, onnx_files: dict, ckpt_hash: str, exported: bool, scheme: str = "none"
) -> Iterator[str]:
    from specrt.engines.trt import FLAVOURS, UnparsedGraph, available_flavours, build_trt_engine, read_trt_manifest
    from specrt.schema.graph_files import read_onnx_manifest

    if spec.tensorrt == "off":
        yield "tensorrt  skipped: --tensorrt off"
        return
    installed = available_flavours()
    wanted = installed[:1] if spec.tensorrt == "auto" else [spec.tensorrt]
    if not wanted:
        names = " nor ".join(FLAVOURS)
        yield f"tensorrt  skipped: neither {names} is installed (pip install tensorrt-rtx; tensorrt on an NVIDIA host)"
        return
    flavour = wanted[0]
    if flavour not in installed:
        raise SpecrtError(f"--tensorrt {flavour} was asked for, but it is not installed; pip install {flavour}")
    edir = ArtifactLayout(spec.out).trt_engine(flavour, scheme)
    portable_dir, portable_files = odir, onnx_files
    current = None
    if scheme == "none" and spec.graph == "fused":  # the standard graph, when TensorRT takes it
        written = yield from _standard_graph(spec, ckpt_hash)
        odir = ArtifactLayout(spec.out).standard_onnx
        onnx_files = read_onnx_manifest(odir)["files"]
        if not (spec.force or exported or written):  # an engine built from the portable graph after a refusal
            current = _manifest_if_valid(read_trt_manifest, edir, portable_files, ckpt_hash)
            current = current if _records(current, {"fallback_from": "standard"}) else None
        exported = exported or written
    if current is None and not (spec.force or exported):
        current = _manifest_if_valid(read_trt_manifest, edir, onnx_files, ckpt_hash)
    # an engine built before its manifest recorded tf32 (TensorRT's default: on) is rebuilt
    wanted = {"profiles": [dataclasses.asdict(p) for p in spec.trt.shapes.profiles()], "tf32": spec.trt.tf32}
    if _records(current, wanted):
        yield f"{flavour:<9} {edir}: up to date"
        return
    t0 = time.perf_counter()
    try:
        build_trt_engine(odir, edir, dataclasses.replace(spec.trt, flavour=flavour))
    except UnparsedGraph as e:
        if odir == portable_dir:
            raise
        yield f"{flavour:<9} {odir}: this TensorRT cannot parse it ({e}); building from the portable graph"
        odir = portable_dir
        build_trt_engine(odir, edir, dataclasses.replace(spec.trt, flavour=flavour), fallback_from="standard")
    size = (edir / "model.engine").stat().st_size / 2**20
    took = time.perf_counter() - t0
    yield f"{flavour:<9} {edir}: built in {took:.1f} s ({size:.0f} MiB; running it needs an NVIDIA GPU)"
