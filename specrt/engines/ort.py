"""ONNX Runtime engines: the step graph, its measurements and the provider it runs on.

`build_ort_engine` opens the exported step graph with ORT's graph optimizations (level ALL),
measures it (batch invariance, step costs) and writes a manifest (ONNX hash, checkpoint hash,
provider, ORT version, CPU). The engine references its graph rather than holding an optimized
copy (`graph_dir`, relative to the engine): ORT optimizes it again at every load, which took 2.07
s against 2.01 s for opening the saved copy on the 1.5B model's gguf-a8 graph, and the copy was
another 1.58 GB on disk. `load_ort_session` checks that manifest and the graph's files (in full
when they changed since their last check, or when asked) and opens a session on the graph.
Engines built before (an optimized copy, `model.opt.onnx`, listed in their `files`) still load
as they are. ORT silently
falls back to CPU when a GPU provider cannot load, so the provider that really runs is read back
from the session and reported, and asking for a GPU provider that did not load is an error.

onnxruntime is imported inside functions: `import specrt` works without it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from specrt.artifacts import (
    atomic_dir,
    check_files,
    cpu_model,
    package_versions,
    read_manifest,
    require_same_checkpoint,
    verify_files,
    write_manifest,
)
from specrt.engines.ort_measure import batch_invariance, step_costs, step_cuts
from specrt.errors import ArtifactError, ManifestMismatchError, SpecrtError
from specrt.schema.graph_files import ONNX_FILE, read_onnx_manifest
from specrt.schema.model_files import model_dir_for

ENGINE_KIND = "ort-engine"
OPT_FILE = "model.opt.onnx"
OPT_DATA = "model.opt.onnx.data"

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}


@dataclasses.dataclass(frozen=True)
class OrtOptions:
    provider: str = "cpu"  # key of PROVIDERS
    intra_op_threads: int = 0  # 0: ORT's default (one per physical core)
    # Spinning threads wait for work at full speed; on a machine shared with other busy processes
    # they slow everything down badly (with one core busy elsewhere, a 2-thread decode step went
    # from 74 ms to ~1.9 s here), so they are off unless asked for.
    allow_spinning: bool = False


def _ort():
    try:
        import onnxruntime as ort
    except ImportError as e:  # pragma: no cover - onnxruntime is a core dependency
        raise SpecrtError("onnxruntime is not installed; run `make setup` or `pip install onnxruntime`.") from e
    return ort


def _session_options(opts: OrtOptions, graph_opt_level):
    ort = _ort()
    so = ort.SessionOptions()
    so.graph_optimization_level = graph_opt_level
    if opts.intra_op_threads:
        so.intra_op_num_threads = opts.intra_op_threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if opts.allow_spinning else "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "1" if opts.allow_spinning else "0")
    return so


def _provider_list(provider: str) -> list[str]:
    if provider not in PROVIDERS:
        raise SpecrtError(f"unknown ONNX Runtime provider {provider!r}; choose one of {', '.join(PROVIDERS)}.")
    ort = _ort()
    want = PROVIDERS[provider]
    available = ort.get_available_providers()
    if want not in available:
        raise SpecrtError(
            f"ONNX Runtime provider {want} is not available in this onnxruntime build (available: "
            f"{', '.join(available)}). For cuda/tensorrt install onnxruntime-gpu (`pip install specrt[gpu]`)."
        )
    return [want, "CPUExecutionProvider"] if want != "CPUExecutionProvider" else [want]


def _check_provider_loaded(session, provider: str) -> str:
    """The provider that really runs; an error if ORT fell back from a requested GPU provider."""
    active = session.get_providers()
    want = PROVIDERS[provider]
    if active[0] != want:
        raise SpecrtError(
            f"ONNX Runtime was asked for {want} but runs {active[0]} (it falls back silently when a "
            "provider's libraries cannot load). Check the CUDA/cuDNN/TensorRT libraries, or use --provider cpu."
        )
    return active[0]


BATCH_VARIANCE_LIMIT = 1e-4  # relative; float32 engines measure ~1e-6


def graph_session(onnx_file: Path, options: OrtOptions, fix: str, save_as: tuple[Path, str] | None = None):
    """(session, active provider) on `onnx_file`, optimized by ORT (level ALL) as it loads: a
    step graph an engine references; with `save_as` (opt_file, opt_data) ORT also saves the
    optimized graph as opt_file, tensors over 1 KiB in opt_data beside it (a draft head's engine).
    `fix` ends the error when ORT cannot load the graph."""
    ort = _ort()
    providers = _provider_list(options.provider)
    so = _session_options(options, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    kernel_graph = _needs_kernels(onnx_file, options, so)
    if save_as is not None:
        opt_file, opt_data = save_as
        so.optimized_model_filepath = str(opt_file)
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", opt_data)
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    # ORT warns that a level-ALL graph may hold CPU-specific kernels; the manifest records the
    # host CPU and loading refuses the engine on another one, so the warning is not repeated
    so.log_severity_level = 3
    try:
        if kernel_graph:  # its nodes' GGUF paths start from the graph's folder (engines/kernels)
            from specrt.engines import kernels

            with kernels.SESSION_LOCK:
                kernels.register(so, options.intra_op_threads, onnx_file.parent)
                session = ort.InferenceSession(str(onnx_file), so, providers=providers)
        else:
            session = ort.InferenceSession(str(onnx_file), so, providers=providers)
    except Exception as e:  # ORT raises its own Fail/InvalidGraph types
        raise ArtifactError(f"ONNX Runtime could not load {onnx_file} ({e}); {fix}") from None
    return session, _check_provider_loaded(session, options.provider)


def _needs_kernels(onnx_file: Path, options: OrtOptions, so) -> bool:
    """Whether the graph's products run on specrt's kernel library (--quantize gguf-k): then the
    library must be here and the GGUF file it reads in place the one the graph was written from
    (a stat when unchanged, the full hash when the file changed)."""
    from specrt.calibration import KERNEL_SCHEMES

    try:
        q = read_onnx_manifest(onnx_file.parent, verify="none").get("quantization") or {}
    except SpecrtError:
        return False
    if q.get("scheme") not in KERNEL_SCHEMES:
        return False
    from specrt.engines import kernels
    from specrt.schema.checkpoint_files import file_digest

    if not kernels.has_ort_ops():
        raise ArtifactError(
            f"{onnx_file.parent} computes on specrt's kernel library, which is not available here "
            f"({kernels.why_not()}); build it with `python -m specrt.engines.kernels` (make setup does), or build "
            "and run the gguf-a8 engine instead"
        )
    gguf = (onnx_file.parent / q["gguf"]["relative"]).resolve()
    if not gguf.is_file():
        raise ArtifactError(
            f"{onnx_file.parent} reads its weights in place from the GGUF file {gguf}, which is gone; put it back "
            "(or copy it with the artifacts folder, at the same place relative to it), or rebuild the engine"
        )
    if file_digest(gguf) != q["gguf"]["sha256"]:
        raise ArtifactError(
            f"{gguf} changed since {onnx_file.parent} was written from it (its sha256 is not the one the graph's "
            f"manifest records), and the engine reads its weights from it in place: put the original file back, or "
            "rebuild the engine (specrt build-engines --quantize gguf-k)"
        )
    return True


def check_built_here(m: dict, what: str, how: str) -> None:
    """Refuse an optimized graph that another onnxruntime made, that names an unknown provider, or
    (CPU) that was optimized on another CPU; `what` names it, `how` rebuilds it."""
    built_with = m["versions"].get("onnxruntime")
    installed = package_versions("onnxruntime")["onnxruntime"]
    if built_with != installed:
        raise ManifestMismatchError(
            f"{what} was built with onnxruntime {built_with}, but {installed} is installed; its optimized graph "
            f"and measurements (bitwise step shapes, step costs) hold for the version that made them. Rebuild it "
            f"with: {how}"
        )
    if kernels_changed(m):
        recorded = (m.get("kernels") or {}).get("sources")
        raise ManifestMismatchError(
            f"{what} was measured (bitwise step shapes, step costs) on another build of specrt's kernel library "
            f"({recorded or 'before engines recorded it'}; this one is built from sources {_kernel_sources()}); "
            f"rebuild it with: {how}"
        )
    if m["provider"] not in PROVIDERS.values():
        raise ArtifactError(f"{what} names an unknown provider {m['provider']!r}; rebuild it with: {how}")
    if m["provider"] == PROVIDERS["cpu"] and m.get("host_cpu") != cpu_model():
        raise ManifestMismatchError(
            f"{what} was optimized on a {m.get('host_cpu')!r} CPU, this is {cpu_model()!r}; ORT's CPU kernels, "
            f"and so which step shapes give the same bits, depend on the CPU. Rebuild it here with: {how}"
        )


def _kernel_scheme(m: dict) -> bool:
    from specrt.calibration import KERNEL_SCHEMES

    return (m.get("quantization") or {}).get("scheme") in KERNEL_SCHEMES


def kernels_changed(m: dict) -> bool:
    """Whether an engine's products run on the kernel library (gguf-k) and it was measured on
    another build of it than the one built here (or before engines recorded the build)."""
    return _kernel_scheme(m) and (m.get("kernels") or {}).get("sources") != _kernel_sources()


def _kernel_sources() -> str:
    from specrt.engines.kernels.build import sources_digest

    return sources_digest()


def engine_options(engine_dir: Path, m: dict, options: OrtOptions | None, how_for: str) -> OrtOptions:
    """`options` (default: the engine's provider), refused unless for the provider the engine was
    built for (`options` may only change threads and spinning); `how_for` (with {provider})
    builds one for another provider."""
    provider = next(k for k, v in PROVIDERS.items() if v == m["provider"])
    options = options or OrtOptions(provider=provider)
    if PROVIDERS[options.provider] != m["provider"]:
        raise ManifestMismatchError(
            f"engine {engine_dir} was built for {m['provider']}, not {PROVIDERS[options.provider]}; "
            f"build one for it with: {how_for.format(provider=options.provider)}"
        )
    return options


def open_optimized(
    engine_dir: Path, opt_file: str, m: dict, options: OrtOptions | None, how: str, how_for: str | None = None
):
    """(session, active provider) on an engine's saved optimized graph, run as saved, on the
    provider it was optimized for (`options` may only change threads and spinning). `how`
    rebuilds it; `how_for` (with {provider}) builds one for another provider, where that exists."""
    ort = _ort()
    options = engine_options(engine_dir, m, options, how_for or how)
    so = _session_options(options, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    try:
        session = ort.InferenceSession(str(engine_dir / opt_file), so, providers=_provider_list(options.provider))
    except Exception as e:
        raise ArtifactError(
            f"ONNX Runtime could not load engine {engine_dir / opt_file} ({e}); rebuild it with: {how}"
        ) from None
    return session, _check_provider_loaded(session, options.provider)


def build_ort_engine(onnx_dir: str | Path, out_dir: str | Path, options: OrtOptions = OrtOptions()) -> Path:
    """The engine of the step graph in `onnx_dir` for `options.provider`: its manifest in
    `out_dir`, which references the graph."""
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    onnx_manifest = read_onnx_manifest(onnx_dir)
    graph_dir = os.path.relpath(onnx_dir.resolve(), out_dir.resolve())  # moves with the artifacts
    with atomic_dir(out_dir) as tmp:
        t0 = time.perf_counter()
        session, active = graph_session(onnx_dir / ONNX_FILE, options, "re-export it with `specrt export`.")
        flavour = onnx_manifest.get("graph_flavour", "portable")
        # the fused graph's steps agree bitwise but where a kernel changes with the step's end;
        # the traced graph's never do (its attention reduces over the whole buffer): no cuts help
        cuts = step_cuts(session, onnx_manifest["config"], flavour) if flavour == "fused" else None
        kept = tuple(cuts["cuts"]) if cuts else ()
        invariance = batch_invariance(session, onnx_manifest["config"], flavour, cuts=kept)
        costs = step_costs(session, onnx_manifest["config"], flavour)
        del session
        write_manifest(
            tmp,
            ENGINE_KIND,
            {
                "onnx": {"path": str(onnx_dir.resolve()), "files": onnx_manifest["files"]},
                "graph_dir": graph_dir,  # the graph it runs, relative to the engine
                # its tokenizer and chat template, relative to the engine (None: the checkpoint's)
                "model_dir": model_dir_for(out_dir, onnx_dir.parent, onnx_manifest["checkpoint"]["hash"]),
                "checkpoint": onnx_manifest["checkpoint"],
                "config": onnx_manifest["config"],
                "hidden_layers": onnx_manifest["hidden_layers"],
                "graph_flavour": flavour,
                # what draft heads trained on this target must have been trained against
                "precision": precision_of(onnx_manifest.get("quantization", {}).get("scheme")),
                "quantization": onnx_manifest.get("quantization"),  # what it computes (specrt inspect)
                "provider": active,
                "host_cpu": cpu_model(),
                "graph_optimization_level": "ORT_ENABLE_ALL",
                "step_cuts": cuts,  # positions no step may span (schema/step_cuts.py)
                "batch_invariance": invariance,  # measured with its steps split at the cuts
                "step_ms": costs,  # by positions, batch 1: the cost model's priors
                # the kernel library its products ran on when measured (gguf-k): another is rebuilt
                "kernels": {"sources": _kernel_sources()} if _kernel_scheme(onnx_manifest) else None,
                "build_seconds": round(time.perf_counter() - t0, 2),
                "files": {},  # its graph's are the graph's manifest's (onnx.files)
                "versions": package_versions("onnxruntime"),
            },
        )
    return out_dir


def engine_graph(engine_dir: str | Path, m: dict) -> tuple[Path, str, bool]:
    """(directory, file, optimized) of the graph an engine runs: the step graph it references,
    optimized as it loads, or the optimized copy an engine built before holds."""
    engine_dir = Path(engine_dir)
    if "graph_dir" in m:
        return (engine_dir / m["graph_dir"]).resolve(), ONNX_FILE, False
    return engine_dir, OPT_FILE, True


def check_engine_files(engine_dir: Path, m: dict, verify: str) -> None:
    """The engine's graph files against their hashes (verify as in read_engine_manifest)."""
    graph_dir, _, copy = engine_graph(engine_dir, m)
    if copy:
        check_files(engine_dir, m, (OPT_FILE, OPT_DATA), HOW_TO_BUILD, verify)
    elif not graph_dir.is_dir():
        raise ArtifactError(
            f"engine {engine_dir} runs the step graph in {graph_dir}, which is gone; rebuild it with: {HOW_TO_BUILD}"
        )
    elif verify != "none":
        verify_files(graph_dir, m["onnx"]["files"], HOW_TO_BUILD, full=verify == "full")


def precision_of(scheme: str | None) -> str:
    """The numbers an engine of a quantization scheme computes: "gguf" computes the float
    checkpoint from the blocks it was dequantized from (equal within float rounding), so its
    hidden states are float32's and a draft head trained on either runs on both."""
    return "float32" if scheme in (None, "none", "gguf") else scheme


HOW_TO_BUILD = "specrt build-engines --model CHECKPOINT --out DIR"
MANIFEST_FIELDS = {"onnx": dict, "provider": str, "host_cpu": str, "versions": dict}


def read_engine_manifest(
    engine_dir: str | Path, checkpoint_hash_expected: str | None = None, verify: str = "auto"
) -> dict:
    """The engine's manifest, checked against the checkpoint, the installed onnxruntime, this CPU
    and its own files (verify: "auto" reads a file in full only when it changed since its last
    check, "full" always, "none" never: for callers that only read the manifest)."""
    from specrt.schema.config import config_from_manifest

    m = read_manifest(engine_dir, ENGINE_KIND, HOW_TO_BUILD, MANIFEST_FIELDS)
    config_from_manifest(m, engine_dir, HOW_TO_BUILD)
    require_same_checkpoint(m, checkpoint_hash_expected, f"engine {engine_dir}", f"Rebuild it with: {HOW_TO_BUILD}")
    check_built_here(m, f"engine {engine_dir}", rebuild_command(engine_dir, m))
    check_engine_files(engine_dir, m, verify)
    return m


def rebuild_command(engine_dir: str | Path, m: dict) -> str:
    """The one command that builds an engine again on this machine from the graph beside it (no
    checkpoint needed: build-engines without --model), for an engine that names its graph."""
    graph = m.get("graph_dir")
    if not isinstance(graph, str):
        return HOW_TO_BUILD
    root = (Path(engine_dir) / graph).resolve().parent
    scheme = (m.get("quantization") or {}).get("scheme") or "none"
    provider = next((k for k, v in PROVIDERS.items() if v == m.get("provider")), "cpu")
    command = f"specrt build-engines --out {root}"
    command += f" --quantize {scheme}" if scheme != "none" else ""
    command += " --graph portable" if m.get("graph_flavour") != "fused" else ""
    return command + (f" --provider {provider}" if provider != "cpu" else "")


def load_ort_session(
    engine_dir: str | Path,
    options: OrtOptions | None = None,
    checkpoint_hash_expected: str | None = None,
    verify: str = "auto",
):
    """(session, manifest, active provider) for a built engine, after checking its manifest and
    files (`verify`, as in read_engine_manifest)."""
    engine_dir = Path(engine_dir)
    m = read_engine_manifest(engine_dir, checkpoint_hash_expected, verify)
    how = "specrt build-engines"
    graph_dir, name, copy = engine_graph(engine_dir, m)
    if copy:  # optimized at build time: run it as saved
        session, active = open_optimized(engine_dir, OPT_FILE, m, options, how, how + " --provider {provider}")
    else:
        options = engine_options(engine_dir, m, options, how + " --provider {provider}")
        session, active = graph_session(graph_dir / name, options, f"rebuild it with: {how}")
    return session, m, active
