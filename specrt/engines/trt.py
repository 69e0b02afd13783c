"""TensorRT engines (TensorRT 10/11 and TensorRT-RTX share this one build path).

    ONNX step graph -> strongly typed network -> optimization profiles (profiles.py) ->
    serialized engine + manifest.json, written atomically

Precision comes from the network's types and Q/DQ nodes (TensorRT 11 and TensorRT-RTX have no
FP16/INT8 builder flags), so the network is always built strongly typed. The manifest records the
flavour and version of TensorRT, the compute capabilities targeted, the ONNX files' hashes, the
profiles and the I/O; `read_trt_manifest` refuses an engine whose manifest does not match the
ONNX, the installed TensorRT or the engine file itself. Running an engine needs a GPU (runtime/backends/trt.py).

tensorrt / tensorrt_rtx are imported inside functions: `import specrt` works without them.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import time
from pathlib import Path

from specrt.artifacts import (
    atomic_dir,
    check_files,
    file_sha256,
    package_versions,
    read_manifest,
    require_same_checkpoint,
    write_manifest,
)
from specrt.engines.profiles import EngineShapes, ProfileSpec, Range
from specrt.errors import ArtifactError, ManifestMismatchError, SpecrtError
from specrt.schema.graph_files import ONNX_FILE, read_onnx_manifest
from specrt.schema.model_files import model_dir_for

TRT_KIND = "trt-engine"
ENGINE_FILE = "model.engine"
FLAVOURS = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}  # flavour -> module
TRT_GRAPHS = ("standard", "portable")  # the step graph flavours TensorRT's parser takes


class UnparsedGraph(ArtifactError):
    """TensorRT's ONNX parser refused a graph (build-engines then builds from the portable one)."""


def available_flavours() -> list[str]:
    return [f for f, mod in FLAVOURS.items() if importlib.util.find_spec(mod) is not None]


def load_tensorrt(flavour: str = "auto"):
    """(flavour, module). 'auto' takes full TensorRT when installed, else TensorRT-RTX."""
    if flavour == "auto":
        found = available_flavours()
        if not found:
            raise SpecrtError(
                "neither tensorrt nor tensorrt_rtx is installed; `pip install tensorrt-rtx` (builds on any machine) "
                "or tensorrt (needs an NVIDIA host)."
            )
        flavour = found[0]
    if flavour not in FLAVOURS:
        raise SpecrtError(f"unknown TensorRT flavour {flavour!r}; choose one of {', '.join(FLAVOURS)} or auto.")
    try:
        return flavour, importlib.import_module(FLAVOURS[flavour])
    except ImportError as e:
        raise SpecrtError(f"{flavour} is not importable ({e}); install it with `pip install {flavour}`.") from None


@dataclasses.dataclass(frozen=True)
class TrtBuildSpec:
    flavour: str = "auto"  # tensorrt | tensorrt-rtx | auto
    shapes: EngineShapes = EngineShapes()
    workspace_mib: int = 4096
    # TensorRT-RTX only: target GPUs, e.g. ("SM89", "SM120"); empty = the library's default
    compute_capabilities: tuple[str, ...] = ()
    timing_cache: Path | None = None  # reused and updated across builds (full TensorRT; a no-op in TensorRT-RTX)
    # TF32 tensor cores for float32 GEMMs: faster on Ampere and later, but ~1e-3 relative off float32,
    # which TensorRT turns on by default; off here, so engines match the float32 reference the
    # runtime's exactness checks compare against (speculative output equal to plain output)
    tf32: bool = False


def _progress_monitor(trt, enabled: bool):
    """An IProgressMonitor that drives tqdm bars, built after the TensorRT module is imported."""
    if not enabled or not hasattr(trt, "IProgressMonitor"):
        return None
    from tqdm import tqdm

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.bars = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None:  # top-level phases only; nested ones would flood a log
                self.bars[phase_name] = tqdm(total=num_steps, desc=f"TensorRT: {phase_name}")

        def step_complete(self, phase_name, step):
            if phase_name in self.bars:
                self.bars[phase_name].update(1)
            return True  # False would cancel the build

        def phase_finish(self, phase_name):
            bar = self.bars.pop(phase_name, None)
            if bar is not None:
                bar.close()

    return Monitor()


def _parse_onnx(trt, builder, logger, onnx_path: Path):
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise UnparsedGraph(f"TensorRT could not parse {onnx_path}: {errors}. Re-export it with `specrt export`.")
    return network, parser


def _allow_decomposed_attention(trt, network) -> None:
    """Let TensorRT run each attention layer (the standard graph's Attention) as its parts when
    it has no dedicated kernel for it: TensorRT-RTX 1.7 has none for float32 attention and
    refuses to build one otherwise ("Attention operation was not supported by a dedicated
    kernel"); with float16 inputs it builds its own."""
    if not hasattr(trt.LayerType, "ATTENTION_INPUT"):  # a TensorRT without the attention layer
        return
    classes = {
        trt.LayerType.ATTENTION_INPUT: trt.IAttentionInputLayer,
        trt.LayerType.ATTENTION_OUTPUT: trt.IAttentionOutputLayer,
    }
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type in classes:
            layer.__class__ = classes[layer.type]  # the bindings hand out the base class
            layer.attention.decomposable = True


def build_trt_engine(
    onnx_dir: str | Path,
    out_dir: str | Path,
    spec: TrtBuildSpec = TrtBuildSpec(),
    progress: bool = True,
    fallback_from: str | None = None,
) -> Path:
    """Build a TensorRT engine of the step graph with the verify and prefill profiles; returns
    out_dir. fallback_from: the graph flavour TensorRT refused before this one (the manifest says)."""
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    onnx_manifest = read_onnx_manifest(onnx_dir)
    graph_flavour = onnx_manifest.get("graph_flavour", "portable")
    if graph_flavour not in TRT_GRAPHS:
        raise SpecrtError(
            f"{onnx_dir} holds the {graph_flavour} step graph (ONNX Runtime's own operators); TensorRT builds from "
            "the standard or the portable one: give its onnx-standard/ or onnx/ directory (build-engines does)"
        )
    cfg = onnx_manifest["config"]
    profiles = spec.shapes.profiles()  # validated before TensorRT is touched
    shapes = [
        (p.name, p.shapes(cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"])) for p in profiles
    ]
    built = build_serialized(onnx_dir / ONNX_FILE, shapes, spec, progress)
    with atomic_dir(out_dir) as tmp:
        (tmp / ENGINE_FILE).write_bytes(memoryview(built.serialized))
        write_manifest(
            tmp,
            TRT_KIND,
            {
                **built.facts,
                "onnx": {"path": str(onnx_dir.resolve()), "files": onnx_manifest["files"]},
                "checkpoint": onnx_manifest["checkpoint"],
                # its tokenizer and chat template, relative to the engine (None: the checkpoint's)
                "model_dir": model_dir_for(out_dir, onnx_dir.parent, onnx_manifest["checkpoint"]["hash"]),
                "config": cfg,
                "hidden_layers": onnx_manifest["hidden_layers"],
                "graph_flavour": graph_flavour,
                "quantization": onnx_manifest.get("quantization"),  # what it computes (specrt inspect)
                "fallback_from": fallback_from,
                "profiles": [dataclasses.asdict(p) for p in profiles],
                "files": {ENGINE_FILE: file_sha256(tmp / ENGINE_FILE)},
            },
        )
    built.save_timing_cache()
    return out_dir


@dataclasses.dataclass
class Built:
    """A serialized engine and the facts every TensorRT manifest records about its build."""

    serialized: object
    facts: dict
    timing_cache: object
    timing_cache_path: Path | None

    def save_timing_cache(self) -> None:
        if self.timing_cache is not None:
            self.timing_cache_path.parent.mkdir(parents=True, exist_ok=True)
            self.timing_cache_path.write_bytes(memoryview(self.timing_cache.serialize()))


def build_serialized(onnx_file: Path, shapes: list[tuple[str, dict]], spec: TrtBuildSpec, progress: bool) -> Built:
    """Parse `onnx_file` into a strongly typed network and build it with one optimization profile
    per (name, {input: (min, opt, max) shape}); the one build path of every TensorRT engine."""
    flavour, trt = load_tensorrt(spec.flavour)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network, _parser = _parse_onnx(trt, builder, logger, onnx_file)
    _allow_decomposed_attention(trt, network)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, spec.workspace_mib << 20)
    if spec.tf32:
        config.set_flag(trt.BuilderFlag.TF32)
    else:
        config.clear_flag(trt.BuilderFlag.TF32)
    targets = []
    if spec.compute_capabilities:
        if flavour != "tensorrt-rtx":
            raise SpecrtError(
                "compute capabilities are chosen per build only with TensorRT-RTX; full TensorRT builds for the GPU "
                "it runs on."
            )
        config.num_compute_capabilities = len(spec.compute_capabilities)
        for i, cc in enumerate(spec.compute_capabilities):
            if not hasattr(trt.ComputeCapability, cc):
                known = [n for n in dir(trt.ComputeCapability) if n.startswith("SM") or n == "CURRENT"]
                raise SpecrtError(f"unknown compute capability {cc!r}; this TensorRT-RTX knows {', '.join(known)}.")
            config.set_compute_capability(getattr(trt.ComputeCapability, cc), i)
        targets = [_current_sm() if cc == "CURRENT" else cc for cc in spec.compute_capabilities]
    timing_cache = None
    if spec.timing_cache is not None and flavour == "tensorrt":
        blob = spec.timing_cache.read_bytes() if spec.timing_cache.is_file() else b""
        timing_cache = config.create_timing_cache(blob)
        config.set_timing_cache(timing_cache, ignore_mismatch=False)
    monitor = _progress_monitor(trt, progress)
    if monitor is not None:
        config.progress_monitor = monitor
    for name, profile in shapes:
        prof = builder.create_optimization_profile()
        for tensor, (mn, opt, mx) in profile.items():
            prof.set_shape(tensor, mn, opt, mx)
        if config.add_optimization_profile(prof) < 0:
            raise SpecrtError(f"TensorRT rejected the {name} profile {profile}; check the engine shapes.")
    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ArtifactError(f"TensorRT failed to build an engine from {onnx_file} (see the log above).")
    facts = {
        "flavour": flavour,
        "tensorrt_version": trt.__version__,
        "compute_capabilities": targets or ["library default"],
        "build_gpu": _build_gpu() if flavour == "tensorrt" else None,  # full TensorRT builds for this GPU only
        "inputs": [_io(network.get_input(i)) for i in range(network.num_inputs)],
        "outputs": [_io(network.get_output(i)) for i in range(network.num_outputs)],
        "workspace_mib": spec.workspace_mib,
        "max_context": spec.shapes.max_context,  # the profiles' past length is this, rounded up (CACHE_ALIGN)
        "tf32": bool(config.get_flag(trt.BuilderFlag.TF32)),  # as the builder had it, not as asked
        "build_seconds": round(time.perf_counter() - t0, 2),
        "versions": package_versions("onnx"),
    }
    return Built(serialized, facts, timing_cache, spec.timing_cache)


def _build_gpu() -> dict | None:
    """{name, sm} of the GPU this process builds on (torch's view), or None without one."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
        return {"name": torch.cuda.get_device_name(), "sm": f"SM{major}{minor}"}
    except ImportError:
        return None


def _current_sm() -> str:
    gpu = _build_gpu()
    if gpu is None:
        raise SpecrtError(
            "compute capability CURRENT means the GPU of this machine, and none is visible; name one instead, e.g. "
            "SM89."
        )
    return gpu["sm"]


def _io(t) -> dict:
    return {"name": t.name, "dtype": str(t.dtype).split(".")[-1].lower(), "shape": list(t.shape)}


HOW_TO_BUILD = "specrt build-engines --model CHECKPOINT --out DIR --tensorrt"
MANIFEST_FIELDS = {
    "flavour": str,
    "tensorrt_version": str,
    "onnx": dict,
    "profiles": list,
    "inputs": list,
    "outputs": list,
    "compute_capabilities": list,
}


def read_trt_manifest(
    engine_dir: str | Path,
    onnx_files: dict | None = None,
    checkpoint_hash_expected: str | None = None,
    verify: str = "auto",
) -> dict:
    """The engine's manifest, checked against the ONNX it should come from, the checkpoint, the
    installed TensorRT and the engine file's hash (verify: "auto" reads the engine in full only
    when it changed since its last check, "full" always)."""
    from specrt.schema.config import config_from_manifest

    engine_dir = Path(engine_dir)
    how = HOW_TO_BUILD
    m = read_manifest(engine_dir, TRT_KIND, how, MANIFEST_FIELDS)
    config_from_manifest(m, engine_dir, how)
    require_same_checkpoint(m, checkpoint_hash_expected, f"engine {engine_dir}", f"Rebuild it with: {how}")
    if onnx_files is not None and m["onnx"].get("files") != onnx_files:
        raise ManifestMismatchError(
            f"engine {engine_dir} was built from another export of the ONNX step graph; rebuild it with: {how}"
        )
    flavour = m["flavour"]
    if flavour not in FLAVOURS or flavour not in available_flavours():
        raise ManifestMismatchError(
            f"engine {engine_dir} was built with {flavour}, which is not installed here; install it or rebuild with: "
            f"{how}"
        )
    installed = load_tensorrt(flavour)[1].__version__
    if installed != m["tensorrt_version"]:
        raise ManifestMismatchError(
            f"engine {engine_dir} was built with {flavour} {m['tensorrt_version']}, but {installed} is installed; "
            f"engines do not move across versions. Rebuild it with: {how}"
        )
    check_files(engine_dir, m, (ENGINE_FILE,), how, verify)
    return m


def select_profile(manifest: dict, batch: int, q_len: int, past_len: int) -> int:
    """Index of the first profile that holds the step (verify comes first)."""
    for i, p in enumerate(manifest["profiles"]):
        spec = ProfileSpec(p["name"], *(Range(**p[k]) for k in ("batch", "q_len", "past_len")))
        if spec.holds(batch, q_len, past_len):
            return i
    raise SpecrtError(
        f"no profile of this engine holds batch {batch}, Q {q_len}, past {past_len}; rebuild with larger engine shapes."
    )


# TensorRT-RTX's support matrix (1.0-1.5): Turing 7.5, Ampere 8.6, Ada 8.9, Blackwell 12.x; no 8.0
# (A100) and no 9.0 (Hopper: H100/H200), which need full TensorRT or the PyTorch-CUDA backend.
# Engines built without explicit compute capabilities are portable across 8.6, 8.9 and 12.x;
# Turing runs only engines that target 7.5 explicitly.
RTX_SUPPORTED_SMS = (75, 86, 89)
RTX_DEFAULT_SMS = (86, 89)
RTX_DEFAULT_MIN_SM = 120


def sm_name(capability: tuple[int, int]) -> str:
    return f"SM{capability[0]}{capability[1]}"


def check_engine_gpu(
    manifest: dict, capability: tuple[int, int], gpu_name: str, engine_dir: str | Path = "engine"
) -> None:
    """Refuse an engine that was not built for this GPU (clear error instead of a TensorRT failure)."""
    sm = capability[0] * 10 + capability[1]
    here = f"this GPU ({gpu_name}) is {sm_name(capability)}"
    if manifest["flavour"] == "tensorrt":
        built = manifest.get("build_gpu")
        if built and built["sm"] != sm_name(capability):
            raise ManifestMismatchError(
                f"engine {engine_dir} was built by TensorRT on {built['name']} ({built['sm']}), but {here}; TensorRT "
                "engines "
                "only run on the GPU architecture they were built on. Rebuild it on this machine: specrt "
                "build-engines --tensorrt tensorrt"
            )
        return
    if sm not in RTX_SUPPORTED_SMS and sm < RTX_DEFAULT_MIN_SM:
        raise ManifestMismatchError(
            f"engine {engine_dir} is a TensorRT-RTX engine, but {here}, which TensorRT-RTX does not support (its "
            "support matrix: SM75, SM86, SM89, SM120+). On this GPU use full TensorRT (--tensorrt tensorrt, on an "
            "NVIDIA host) or the PyTorch-CUDA backend (--backend torch --device cuda)."
        )
    targets = manifest.get("compute_capabilities") or ["library default"]
    if targets == ["library default"]:
        ok = sm in RTX_DEFAULT_SMS or sm >= RTX_DEFAULT_MIN_SM
        built_for = "SM86, SM89 and SM120+ (the TensorRT-RTX default)"
    else:
        ok = sm_name(capability) in targets
        built_for = ", ".join(targets)
    if not ok:
        raise ManifestMismatchError(
            f"engine {engine_dir} was built by TensorRT-RTX for {built_for}, but {here}. Rebuild it with "
            f"--compute-capability {sm_name(capability)} if TensorRT-RTX supports that GPU, or use full TensorRT "
            f"(--tensorrt tensorrt) or the PyTorch-CUDA backend (--backend torch --device cuda) on it."
        )


def engine_max_context(manifest: dict) -> int:
    """Longest context (prompt + output) the engine's profiles serve: the runtime binds the whole
    cache, which holds the context plus one verification step (as built; older manifests: from
    the verify profile)."""
    if "max_context" in manifest:
        return int(manifest["max_context"])
    verify = manifest["profiles"][0]
    return int(verify["past_len"]["max"] - verify["q_len"]["max"])
