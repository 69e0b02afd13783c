"""Where each artifact lives in an artifact directory: the one definition of the layout.

    <root>/onnx/                          the step graph (model.onnx, model.onnx.data, manifest.json)
    <root>/onnx-<scheme>/                 a quantized step graph (build-engines --quantize)
    <root>/onnx-fused[-<scheme>]/         the fused step graph, float32 or 4-bit (ONNX Runtime's engines)
    <root>/engines/ort-<provider>/        an ONNX Runtime engine of onnx-fused/ (or of onnx/: --graph portable)
    <root>/engines/ort-<provider>-<scheme>/  ... of onnx-fused-<scheme>/ or onnx-<scheme>/
    <root>/engines/trt-<flavour>/         a TensorRT / TensorRT-RTX engine
    <root>/engines/timing.cache           TensorRT's timing cache, reused across builds
    <root>/model/                         the tokenizer, chat template and config a run reads (schema/model_files.py):
                                          a copied folder runs without the checkpoint
    <root>/gguf/<file>.gguf               the GGUF a gguf-k engine reads in place: a hard link to the model's file

build-engines writes here; generate, serve, bench, inspect and the benchmark scripts read from
here through `ArtifactLayout`, so a new artifact kind (a draft head, say) is added in one place.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from specrt.artifacts import MANIFEST

TRT_FLAVOURS = ("tensorrt", "tensorrt-rtx")  # in the order a reader prefers them


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A directory's layout: `root` (str or Path) and the paths under it."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))


@dataclasses.dataclass(frozen=True)
class ArtifactLayout(_Layout):
    @property
    def onnx(self) -> Path:
        return self.root / "onnx"

    def quant_onnx(self, scheme: str) -> Path:
        return self.root / f"onnx-{scheme}"

    def fused_onnx(self, scheme: str = "none") -> Path:
        """The fused step graph (export/fused_graph.py), float32 or of a 4-bit scheme."""
        return self.root / ("onnx-fused" if scheme == "none" else f"onnx-fused-{scheme}")

    @property
    def standard_onnx(self) -> Path:
        """The standard step graph (export/standard_graph.py), what TensorRT builds from."""
        return self.root / "onnx-standard"

    def source_onnx(self, scheme: str = "none", flavour: str = "portable") -> Path:
        """The step graph an engine of this scheme and graph flavour is built from."""
        if flavour == "fused":
            return self.fused_onnx(scheme)
        if flavour == "standard":
            return self.standard_onnx
        return self.onnx if scheme == "none" else self.quant_onnx(scheme)

    @property
    def engines(self) -> Path:
        return self.root / "engines"

    def ort_engine(self, provider: str = "cpu", scheme: str = "none") -> Path:
        return self.engines / (f"ort-{provider}" if scheme == "none" else f"ort-{provider}-{scheme}")

    def trt_engine(self, flavour: str, scheme: str = "none") -> Path:
        return self.engines / (f"trt-{flavour}" if scheme == "none" else f"trt-{flavour}-{scheme}")

    @property
    def timing_cache(self) -> Path:
        return self.engines / "timing.cache"

    def built_trt_engine(self, scheme: str = "none") -> Path | None:
        """The TensorRT engine of a scheme present here (full TensorRT preferred), or None."""
        return next((d for d in (self.trt_engine(f, scheme) for f in TRT_FLAVOURS) if d.is_dir()), None)

    @property
    def model_files(self) -> Path:
        """The checkpoint's run-time files (tokenizer, chat template, config) the engines read."""
        return self.root / "model"

    @property
    def gguf_dir(self) -> Path:
        """Where a gguf-k engine's GGUF is linked, so that a copied folder carries its weights."""
        return self.root / "gguf"

    @property
    def calibration(self) -> Path:
        """The calibration set (`specrt calibrate`) and the answers it was made from."""
        return self.root / "calibration"

    def artifact_dirs(self) -> list[Path]:
        """Every artifact directory present (those holding a manifest), graphs before engines."""
        candidates = [self.onnx, *sorted(self.root.glob("onnx-*")), *sorted(self.engines.glob("*"))]
        return [p for p in candidates if (p / MANIFEST).is_file()]


@dataclasses.dataclass(frozen=True)
class HeadLayout(_Layout):
    """A draft head's directory (`specrt train-draft --out`, read by `--draft-dir`):

    <root>/head/                    trained weights (head.safetensors, head.json) and training.json;
                                    a distilled draft model: its checkpoint (config.json, model.safetensors,
                                    tokenizer) and training.json
    <root>/checkpoint.pt            the training checkpoint (resumes an interrupted run)
    <root>/onnx/                    the head's step graph (head.onnx, its data, draft_to_target.npy);
                                    a draft model's: its step graph (model.onnx), as build-engines writes it
    <root>/engines/ort-<provider>/  its ONNX Runtime engine
    <root>/engines/trt-<flavour>/   its TensorRT / TensorRT-RTX engine (draft profile)
    """

    @property
    def weights(self) -> Path:
        return self.root / "head"

    @property
    def report(self) -> Path:
        return self.weights / "training.json"

    @property
    def onnx(self) -> Path:
        return self.root / "onnx"

    def ort_engine(self, provider: str = "cpu") -> Path:
        return self.root / "engines" / f"ort-{provider}"

    def trt_engine(self, flavour: str) -> Path:
        return self.root / "engines" / f"trt-{flavour}"

    def artifact_dirs(self) -> list[Path]:
        candidates = [self.onnx, *sorted((self.root / "engines").glob("*"))]
        return [p for p in candidates if (p / MANIFEST).is_file()]


@dataclasses.dataclass(frozen=True)
class TrainingDataLayout(_Layout):
    """Training data for draft heads (shared by every head of one target):

    <root>/prompts.jsonl    the prompt set (seeded, reproducible)
    <root>/answers.jsonl    the target's answers
    <root>/runs.jsonl       the runs that made them: command, commit, date, answers and tokens added, rate
    <root>/features/        the target's features over prompt + answer (training/features.py)
    """

    @property
    def prompts(self) -> Path:
        return self.root / "prompts.jsonl"

    @property
    def answers(self) -> Path:
        return self.root / "answers.jsonl"

    @property
    def runs(self) -> Path:
        return self.root / "runs.jsonl"

    @property
    def features(self) -> Path:
        return self.root / "features"
