"""What generate, serve, Ray replicas and benchmarks run, opened from one description.

    gen, runner = open_runner(RunnerSpec(artifacts=Path("artifacts/SmolLM2-135M-Instruct"), draft="suffix"))

`RunnerSpec` says which engine (an artifact directory's, or one directory), which backend (ONNX
Runtime, TensorRT, the PyTorch model), which precision (`quantize`, `split`) and which draft with
its options; `open_runner` checks the options together (a draft option the chosen draft would
leave unused is refused, before any engine loads), opens the generator and, with a draft, the
speculative decoder over it. Every problem is a SpecrtError naming the fix; a combination of
options that cannot go together is a UsageError (the CLI shows its usage with it).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Callable

from specrt.calibration import TRT_SCHEMES
from specrt.errors import SpecrtError, UsageError
from specrt.layout import TRT_FLAVOURS, ArtifactLayout
from specrt.runtime.drafts import DRAFT_METHODS, make_proposer
from specrt.runtime.generator import Generator
from specrt.runtime.speculative import SpeculativeDecoder, make_policy

DRAFT_OPTIONS = ("draft_dir", "draft_tree", "num_draft", "max_draft")  # RunnerSpec's fields for a draft


@dataclasses.dataclass(frozen=True)
class RunnerSpec:
    """Which engine, backend and draft to run (the CLI's engine options, one field each)."""

    artifacts: Path | None = None
    engine: Path | None = None
    checkpoint: Path | None = None
    backend: str = "ort"  # ort, trt or torch
    provider: str = "cpu"
    quantize: str = "none"
    split: bool = False  # --quantize gguf: one row's one-position steps on the 4-bit engine, the rest on float32
    exact: str = "bitwise"  # or "near-ties": one-position steps as they are (runtime/session.py)
    threads: int = 0  # ORT intra-op threads (0: one per physical core)
    spin: bool = False  # ORT's threads wait for work spinning (a machine of its own: engines/ort.py OrtOptions)
    device: str | None = None
    cuda_graphs: bool = False
    draft: str = "none"
    num_draft: str | int = "auto"
    max_draft: int = 16
    verify_artifacts: bool = False  # hash the engine's files in full (`verify`: "full"), else when they changed
    draft_dir: Path | None = None
    draft_tree: str = "chain"  # or "TOP_K,DEPTH" (EAGLE-2 dynamic trees)
    # the draft options the user set (the CLI's parameter sources); empty: those off their defaults
    given: tuple[str, ...] = ()

    @property
    def verify(self) -> str:
        """How the engine's files are checked on load (specrt.artifacts.check_files)."""
        return "full" if self.verify_artifacts else "auto"


def open_runner(spec: RunnerSpec, generator: Generator | None = None) -> tuple[Generator, object]:
    """(generator, runner): the generator on the chosen backend and engine, and the runner: the
    generator itself, or a SpeculativeDecoder over it with the chosen draft (its
    `exactness_warning` says when its output is not exactly the target's). `generator`: one
    already open for this spec (a benchmark comparing drafts loads the engine once)."""
    check_options(spec)
    gen = generator or open_generator(spec)
    if spec.draft == "none":
        return gen, gen
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the decoder's exactness_warning says it once, plainly
        runner = SpeculativeDecoder(
            gen, make_proposer(spec.draft, **draft_options(spec, gen)), make_policy(spec.num_draft, spec.max_draft)
        )
    return gen, runner


def check_options(spec: RunnerSpec) -> None:
    """The UsageErrors of options that do not go together, before any engine loads."""
    if spec.split and (spec.quantize == "none" or spec.backend != "ort" or spec.engine is not None):
        raise UsageError(
            "--split runs two ORT engines of --artifacts: give it with --quantize gguf (the 4-bit engine decodes, "
            "float32 verifies)"
        )
    quantize, backend = spec.quantize, spec.backend
    if quantize != "none" and backend == "torch" or quantize not in ("none", *TRT_SCHEMES) and backend == "trt":
        raise UsageError(
            f"--quantize {quantize} runs an ORT engine (MatMulNBits); use it with --backend ort (TensorRT takes the "
            f"Q/DQ and 16-bit schemes: {', '.join(TRT_SCHEMES)})"
        )
    _check_draft_options(spec)


def _check_draft_options(spec: RunnerSpec) -> None:
    """A draft option that the chosen draft (or plain decoding) would silently leave unused is
    refused."""
    draft = spec.draft
    if draft == "none":
        defaults = RunnerSpec()
        given = spec.given or [n for n in DRAFT_OPTIONS if getattr(spec, n) != getattr(defaults, n)]
        if given:
            flags = ", ".join(f"--{n.replace('_', '-')}" for n in given)
            raise UsageError(
                f"{flags}: for speculative decoding, so give --draft too (e.g. --draft suffix, or --draft eagle3 "
                "with a head's --draft-dir), or leave it out for plain decoding"
            )
        return
    entry = DRAFT_METHODS.get(draft)
    if entry is None:  # make_proposer names the choices
        return
    if spec.draft_tree != "chain" and not entry.takes_tree:
        trees = ", ".join(n for n, m in DRAFT_METHODS.items() if m.takes_tree)
        own = f" ({entry.what} draft their own tree of choices)" if entry.own_tree else ""
        raise UsageError(f"--draft-tree is for --draft {trees}, not --draft {draft}{own}")
    weights = ", ".join(n for n, m in DRAFT_METHODS.items() if m.needs_draft_dir)
    if entry.head_optional and spec.draft_tree != "chain" and spec.draft_dir is None:
        raise UsageError(f"--draft-tree with --draft {draft} shapes the head's drafts: give its --draft-dir too")
    if not (entry.needs_draft_dir or entry.head_optional) and spec.draft_dir is not None:
        raise UsageError(f"--draft-dir is for a draft with weights (--draft {weights}), not --draft {draft}")
    if entry.needs_draft_dir and spec.draft_dir is None:
        raise UsageError(
            f"--draft {draft} needs --draft-dir DIR: a head from `make drafts` (e.g. "
            "drafts/SmolLM2-135M-Instruct/medusa) or `specrt train-draft`"
        )
    if spec.draft_tree != "chain":
        parse_tree(spec.draft_tree)


def parse_tree(value: str) -> tuple[int, int]:
    """--draft-tree TOP_K,DEPTH."""
    try:
        top_k, depth = (int(v) for v in value.split(","))
    except ValueError:
        raise UsageError(f"--draft-tree {value!r}: give 'chain' or TOP_K,DEPTH, e.g. 4,6") from None
    return top_k, depth


def draft_options(spec: RunnerSpec, gen: Generator) -> dict:
    """make_proposer's options for the draft: heads need their directory and the target."""
    if spec.draft_dir is None:
        return {}
    options = {"draft_dir": spec.draft_dir, "target": gen.session.caps}
    if spec.draft_tree != "chain":
        options["tree"] = parse_tree(spec.draft_tree)
    return options


def open_generator(spec: RunnerSpec) -> Generator:
    """The generator on the chosen backend (BACKENDS: the ORT engine, a TensorRT engine, the PyTorch model)."""
    if spec.backend not in BACKENDS:
        raise UsageError(f"--backend {spec.backend!r}: choose one of {', '.join(BACKENDS)}")
    return BACKENDS[spec.backend].open(spec)


def _open_torch(spec: RunnerSpec) -> Generator:
    if spec.checkpoint is None:
        raise UsageError("--backend torch needs --model CHECKPOINT")
    return Generator.from_checkpoint(
        spec.checkpoint, device=spec.device or "cpu", cuda_graphs=spec.cuda_graphs, exact=spec.exact
    )


def _open_trt(spec: RunnerSpec) -> Generator:
    engine = spec.engine or _trt_engine(spec)
    return Generator.from_trt_engine(
        engine,
        spec.checkpoint,
        device=spec.device or "cuda",
        cuda_graphs=spec.cuda_graphs,
        verify=spec.verify,
        exact=spec.exact,
    )


def _open_ort(spec: RunnerSpec) -> Generator:
    from specrt.engines.ort import OrtOptions

    engine = spec.engine
    if engine is None:
        if spec.artifacts is None:
            raise UsageError(
                "give --artifacts DIR (from build-engines) or --engine DIR, or --backend torch --model CHECKPOINT"
            )
        engine = ArtifactLayout(spec.artifacts).ort_engine(spec.provider, spec.quantize)
        engine = _kernel_fallback(spec, engine)
        if spec.quantize != "none" and not engine.is_dir():
            raise SpecrtError(
                f"{engine} does not exist; build it with: specrt build-engines --model CHECKPOINT --out "
                f"{spec.artifacts} --quantize {spec.quantize}"
            )
    multi = ArtifactLayout(spec.artifacts).ort_engine(spec.provider) if spec.split else None
    options = OrtOptions(provider=spec.provider, intra_op_threads=spec.threads, allow_spinning=spec.spin)
    return Generator.from_engine(
        engine, spec.checkpoint, options=options, verify=spec.verify, multi_engine=multi, exact=spec.exact
    )


def _kernel_fallback(spec: RunnerSpec, engine: Path) -> Path:
    """--quantize gguf-k where specrt's kernel library is not available: the gguf-a8 engine its
    build made instead (engines/build.py), said in one line."""
    from specrt.calibration import KERNEL_SCHEMES

    if spec.quantize not in KERNEL_SCHEMES or engine.is_dir():
        return engine
    from specrt.engines import kernels

    other = ArtifactLayout(spec.artifacts).ort_engine(spec.provider, "gguf-a8")
    if kernels.has_ort_ops() or not other.is_dir():
        return engine
    import sys

    why = kernels.why_not() or "built without ONNX Runtime's headers"
    print(
        f"--quantize {spec.quantize}: specrt's kernel library is not available ({why}); running gguf-a8",
        file=sys.stderr,
    )
    return other


@dataclasses.dataclass(frozen=True)
class Backend:
    """A registry entry: how `--backend NAME` opens its generator from a RunnerSpec, and what it
    is, for --help. A backend is its StepBackend (runtime/backends/), the Target loader that makes
    one from files (runtime/target.py) and this entry (docs/architecture.md, "Adding an engine
    backend")."""

    open: Callable[[RunnerSpec], Generator]
    about: str


BACKENDS: dict[str, Backend] = {
    "ort": Backend(_open_ort, "the ONNX Runtime engine"),
    "trt": Backend(_open_trt, "the TensorRT engine (NVIDIA GPU)"),
    "torch": Backend(_open_torch, "the PyTorch model"),
}


def _trt_engine(spec: RunnerSpec) -> Path:
    if spec.artifacts is None:
        raise UsageError("--backend trt needs --artifacts DIR (from build-engines) or --engine DIR")
    layout = ArtifactLayout(spec.artifacts)
    engine = layout.built_trt_engine(spec.quantize)
    if engine is None:
        built = " or ".join(str(layout.trt_engine(f, spec.quantize)) for f in TRT_FLAVOURS)
        how = "" if spec.quantize == "none" else f" --quantize {spec.quantize}"
        raise SpecrtError(
            f"{spec.artifacts} has no TensorRT engine ({built}); build one with: "
            f"specrt build-engines --model CHECKPOINT --out {spec.artifacts} --tensorrt auto{how}"
        )
    return engine


def described(gen: Generator, spec: RunnerSpec) -> str:
    """What runs, for a log line: the backend and the draft."""
    return f"{gen.backend.description}{', ' + spec.draft + ' draft' if spec.draft != 'none' else ''}"
