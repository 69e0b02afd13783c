"""`specrt train-draft` as a function: data, training, export, engine, each step resumable.

    report = train_draft(TrainDraftSpec(method="eagle3", checkpoint=CKPT, out=DIR, artifacts=ART))

1. prompts    a seeded prompt set from text on this machine (training/prompts.py), the
              benchmark's prompts held out; written to <data>/prompts.jsonl
2. answers    the target's greedy answers, batched (training/data.py), and on the way its
              hidden states over prompt + answer, every layer any head reads (training/features.py);
              each run that adds answers appends its command, commit and rate to <data>/runs.jsonl
3. features   of answers that were not recorded (made by an earlier version): one prefill each
4. training   the family's trainer (training/families.py names it: training/eagle.py,
              medusa.py, draft_model.py), checkpointed, stopped at max_minutes
5. export     <out>/head -> <out>/onnx (ORT parity checked) -> <out>/engines/ort-cpu

The data directory is shared by every head of one target (make drafts trains EAGLE-3 then
EAGLE-1 on the same answers); it records which prompts and target produced it and refuses to
mix. Running again resumes each step where it stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import shutil
import time
from pathlib import Path

from specrt.artifacts import atomic_write_text, exclusive_lock, read_json_object
from specrt.engines.head import build_head_engine
from specrt.engines.trt import available_flavours
from specrt.errors import SpecrtError
from specrt.export.checkpoint import load_model
from specrt.export.draft_head import save_head
from specrt.export.head_graph import export_head
from specrt.layout import HeadLayout, TrainingDataLayout
from specrt.runtime.generator import Generator
from specrt.training.data import generate_answers
from specrt.training.draft_model import save_draft_checkpoint
from specrt.training.eagle import TrainingData
from specrt.training.families import TRAINED_FAMILIES, TrainedFamily, TrainOptions
from specrt.training.features import FeatureStore, StaleFeatures, cache_features, feature_width
from specrt.training.prompts import PROMPT_SET_VERSION, build_prompt_set, write_prompt_set

DATA_MANIFEST = "data.json"


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What makes a training corpus (`specrt make-data`, the first steps of train-draft)."""

    checkpoint: Path
    data: Path  # the data directory (TrainingDataLayout)
    artifacts: Path | None = None
    quantize: str = "none"
    prompts: int = 2000
    seed: int = 0
    max_new_tokens: int = 192
    gen_batch: int = 16
    hold_out: tuple[str, ...] = ()
    progress: bool = True
    option: str = "--data"  # the option that named the directory, for its errors


@dataclasses.dataclass(frozen=True)
class TrainDraftSpec:
    method: str
    checkpoint: Path
    out: Path
    data: Path | None = None  # default: <out>/data
    artifacts: Path | None = None  # the target's ORT engine makes the data (faster); default: PyTorch
    quantize: str = "none"  # which of the artifacts' ORT engines: the head is trained against its features
    prompts: int = 2000
    seed: int = 0
    max_new_tokens: int = 192
    gen_batch: int = 16
    hold_out: tuple[str, ...] = ()  # prompts never to train on (the benchmark's)
    train: object | None = None  # the family's training config (default: families.TRAINED_FAMILIES' own)
    tensorrt: str = "auto"  # also build a TensorRT(-RTX) engine of the head when installed ("off": don't)
    progress: bool = True

    def data_spec(self) -> DataSpec:
        data, option = (self.data, "--data") if self.data else (Path(self.out) / "data", "--out")
        fields = {f.name for f in dataclasses.fields(DataSpec)} - {"data", "option"}
        return DataSpec(data=Path(data), option=option, **{f: getattr(self, f) for f in fields})


def target_generator(spec: TrainDraftSpec | DataSpec) -> Generator:
    if spec.artifacts is not None:
        from specrt.layout import ArtifactLayout

        return Generator.from_engine(ArtifactLayout(spec.artifacts).ort_engine("cpu", spec.quantize), spec.checkpoint)
    if spec.quantize != "none":
        raise SpecrtError(
            f"--quantize {spec.quantize} names an engine of --artifacts; give the target's build-engines directory "
            "(--artifacts DIR) whose engine makes the training data"
        )
    return Generator.from_checkpoint(spec.checkpoint)


def training_target(checkpoint: Path, family: TrainedFamily):
    """The target's weights a trainer copies from. A head copies the embedding, the output head
    and the last layer: where the weights stay in a GGUF file only those are read as float32
    (the rest of a 1.5B model would be 4 GB more); a distilled draft model copies layers, so it
    gets the whole float32 model."""
    from specrt.export.gguf_model import GgufWeight, materialize

    if family.writes == "model":
        return load_model(checkpoint)
    target = load_model(checkpoint, streamed=True)
    if isinstance(target.lm_head.weight, GgufWeight):
        materialize(target, ("embed_tokens", "lm_head", f"layers.{len(target.layers) - 1}"))
    return target


def _require_directory(path: Path, option: str) -> None:
    """`path` is a directory or can become one (nothing in the way)."""
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == path else f"lies under {p}, which is a file"
                raise SpecrtError(f"{option} {path} {where}; give the path of a directory (new or existing)")
            return


def _one_writer(spec: DataSpec):
    """The data directory for this run alone while it adds answers and features: a second run on
    it (make-data beside train-draft, say) is refused at once, not left to cut the first one's
    features mid-write (a store drops rows past its last record when opened)."""
    _require_directory(Path(spec.data), spec.option)
    return exclusive_lock(spec.data, "answers and features for draft training", spec.option)


def prepare_answers(gen: Generator, spec: DataSpec) -> tuple[TrainingDataLayout, list]:
    """Steps 1-2, inside `_one_writer` (which checked and made the directory): the prompt set and
    the target's answers to it (with their features), extended where a directory already holds
    part of them; returns the layout and the answers in prompt order."""
    layout = TrainingDataLayout(spec.data)
    prompts = build_prompt_set(spec.prompts, spec.seed, exclude=spec.hold_out)
    caps = gen.session.caps
    # what fixes the data: prompt i is the same for any prompt count (the set is drawn in order
    # from the seed), so a run may ask for more or fewer prompts and keeps the answers it has
    identity = {
        "prompt_source": {
            "version": PROMPT_SET_VERSION,  # the templates and sources
            "seed": spec.seed,
            "python": platform.python_version(),  # the docstrings and sources the prompts are made from
            "hold_out": hashlib.sha256(json.dumps(list(spec.hold_out)).encode()).hexdigest(),
        },
        "max_new_tokens": spec.max_new_tokens,
        "target": {"checkpoint_hash": caps.checkpoint_hash, "precision": caps.precision},
        "hidden_layers": list(caps.hidden_layers),
    }
    marker = layout.root / DATA_MANIFEST
    if marker.is_file():
        fix = f"delete it and run again: it is written anew, and the answers in {layout.root} are kept where they fit"
        recorded = read_json_object(marker, SpecrtError, fix)
        if recorded != identity:
            changed = sorted(k for k in identity if recorded.get(k) != identity[k])
            raise SpecrtError(
                f"{layout.root} holds training data made with other settings ({', '.join(changed)}); give another "
                "--data directory, or delete it to make the data again"
            )
    else:
        atomic_write_text(marker, json.dumps(identity, indent=2) + "\n")
    write_prompt_set(layout.prompts, prompts)
    if layout.features.is_dir():
        try:
            FeatureStore(layout.features, feature_width(gen.session))  # checked before answers are made
        except StaleFeatures:  # an older version's format: features are derived, make them again
            shutil.rmtree(layout.features)
    answers = generate_answers(
        gen,
        prompts,
        layout.answers,
        spec.max_new_tokens,
        batch=spec.gen_batch,
        progress=spec.progress,
        features=layout.features,
        runs=layout.runs,
    )
    return layout, answers


def prepare_data(gen: Generator, spec: TrainDraftSpec | DataSpec) -> TrainingData:
    """Steps 1-3: the answers and every answer's features, split for training (TrainingData)."""
    spec = spec if isinstance(spec, DataSpec) else spec.data_spec()
    with _one_writer(spec):
        layout, answers = prepare_answers(gen, spec)
        features = cache_features(gen.session, answers, layout.features, progress=spec.progress)
    caps = gen.session.caps
    return TrainingData.load(answers, features, caps.hidden_layers, gen.config.hidden_size, layout.prompts)


def make_data(spec: DataSpec) -> dict:
    """`specrt make-data`: steps 1-3 alone (a corpus made, or extended, before any head trains on
    it); returns its size. The features stay on disk, memory-mapped by whoever trains."""
    with _one_writer(spec):  # before the target loads
        gen = target_generator(spec)
        layout, answers = prepare_answers(gen, spec)
        cache_features(gen.session, answers, layout.features, progress=spec.progress)
    return {
        "data": str(layout.root),
        "answers": len(answers),
        "answer_tokens": sum(len(a.answer_ids) for a in answers),
        "prompt_tokens": sum(len(a.prompt_ids) for a in answers),
    }


def train_draft(spec: TrainDraftSpec) -> dict:
    """Run every step (resuming finished ones); returns the training report, also written to
    <out>/head/training.json."""
    t0 = time.perf_counter()
    layout = HeadLayout(spec.out)
    _require_directory(Path(spec.out), "--out")  # before the target loads
    if spec.data is not None:
        _require_directory(Path(spec.data), "--data")
    gen = target_generator(spec)  # an engine of another checkpoint is refused here (its manifest)
    caps = gen.session.caps
    data = prepare_data(gen, spec)
    data_seconds = time.perf_counter() - t0
    del gen
    family = trained_family(spec.method)
    target = training_target(spec.checkpoint, family)
    cfg = spec.train or family.config(spec.method, TrainOptions())
    if cfg.method != spec.method:
        raise SpecrtError(f"training config for {cfg.method}, asked for {spec.method}")
    if family.writes == "model":
        return _finish_draft_model(spec, family, target, data, cfg, caps, t0, data_seconds)
    head, report = family.train()(target, data, cfg, layout.root, progress=spec.progress)
    report |= {
        "data_seconds_this_run": round(data_seconds, 1),
        "data_hash": data.data_hash,
        "target": {"checkpoint_hash": caps.checkpoint_hash, "precision": caps.precision},
    }
    save_head(head, layout.weights)
    atomic_write_text(layout.report, json.dumps(report, indent=2) + "\n")
    build_draft(layout.root, spec.checkpoint, report, spec.tensorrt)
    report["total_seconds_this_run"] = round(time.perf_counter() - t0, 1)
    atomic_write_text(layout.report, json.dumps(report, indent=2) + "\n")
    return report


def trained_family(method: str) -> TrainedFamily:
    if method not in TRAINED_FAMILIES:
        raise SpecrtError(f"unknown draft family {method!r}; choose one of {', '.join(TRAINED_FAMILIES)}")
    return TRAINED_FAMILIES[method]


def _finish_draft_model(
    spec: TrainDraftSpec, family: TrainedFamily, target, data, cfg, caps, t0: float, data_seconds: float
) -> dict:
    """Distil the draft model, write it as a checkpoint (HeadLayout.weights) and build its
    engines there (onnx/, engines/) as build-engines does for any model."""
    from specrt.engines.build import BuildSpec, build_all

    layout = HeadLayout(spec.out)
    draft, report = family.train()(target, data, cfg, layout.root, progress=spec.progress)
    save_draft_checkpoint(draft, layout.weights, spec.checkpoint)
    report |= {
        "data_seconds_this_run": round(data_seconds, 1),
        "data_hash": data.data_hash,
        "target": {"checkpoint_hash": caps.checkpoint_hash, "precision": caps.precision},
    }
    atomic_write_text(layout.report, json.dumps(report, indent=2) + "\n")
    for _ in build_all(BuildSpec(checkpoint=layout.weights, out=layout.root, tensorrt=spec.tensorrt)):
        pass
    report["total_seconds_this_run"] = round(time.perf_counter() - t0, 1)
    atomic_write_text(layout.report, json.dumps(report, indent=2) + "\n")
    return report


def build_draft(
    draft_dir: str | Path, checkpoint: str | Path, report: dict | None = None, tensorrt: str = "auto"
) -> list[Path]:
    """Export a trained head (<dir>/head) to ONNX and build its ORT engine, and its TensorRT /
    TensorRT-RTX engine when one is installed (tensorrt: auto, off, or a flavour); the manifest
    names the target precision its training features came from (training.json). Returns the
    engine directories."""
    layout = HeadLayout(draft_dir)
    if report is None:
        if not layout.report.is_file():
            raise SpecrtError(f"{layout.report} is missing; train the head with: specrt train-draft --out {draft_dir}")
        report = read_json_object(
            layout.report, SpecrtError, f"train the head again: specrt train-draft --out {draft_dir}"
        )
        _require_trained_for(layout, report, checkpoint)
    keys = ("steps", "train_sequences", "answer_tokens", "held_out", "data_hash", "tree")
    summary = {k: report.get(k) for k in keys}
    precision = report.get("target", {}).get("precision", "float32")
    export_head(layout.weights, layout.onnx, checkpoint, precision, summary)
    built = [build_head_engine(layout.onnx, layout.ort_engine("cpu"))]
    if tensorrt != "off" and (tensorrt != "auto" or available_flavours()):
        from specrt.engines.head import build_head_trt_engine
        from specrt.engines.trt import TrtBuildSpec, load_tensorrt

        flavour = load_tensorrt(tensorrt)[0]
        built.append(build_head_trt_engine(layout.onnx, layout.trt_engine(flavour), TrtBuildSpec(flavour=flavour)))
    return built


WIDTHS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")


def _require_trained_for(layout: HeadLayout, report: dict, checkpoint: str | Path) -> None:
    """Refuse to export a head for another checkpoint than the one it was trained on (by the
    hash training.json records, and by the widths head.json records): its features are that
    target's, and the new manifests would name the wrong one."""
    from specrt.export.checkpoint import checkpoint_hash, load_config
    from specrt.schema.head_io import CONFIG_FILE

    fix = f"train the head again: specrt train-draft --out {layout.root}"
    target = report.get("target")
    theirs = target.get("checkpoint_hash") if isinstance(target, dict) else None
    ours = checkpoint_hash(checkpoint)
    trained_on = read_json_object(layout.weights / CONFIG_FILE, SpecrtError, fix).get("target")
    if not isinstance(trained_on, dict):
        raise SpecrtError(f"{layout.weights / CONFIG_FILE} names no target configuration; {fix}")
    given = load_config(checkpoint).to_dict()
    differ = [f"{k} {trained_on.get(k)} vs {given.get(k)}" for k in WIDTHS if trained_on.get(k) != given.get(k)]
    if differ or (isinstance(theirs, str) and theirs != ours):
        try:  # the path the earlier export recorded, for the advice
            path = read_json_object(layout.onnx / "manifest.json", SpecrtError, "")["checkpoint"]["path"]
        except (SpecrtError, OSError, KeyError, TypeError):
            path = "THE_CHECKPOINT_IT_WAS_TRAINED_ON"
        what = f"widths {', '.join(differ)}" if differ else f"{ours[:19]}..., not {str(theirs)[:19]}..."
        raise SpecrtError(
            f"draft head {layout.root} was trained for another target checkpoint than --model {checkpoint} ({what}); "
            f"a head reads its own target's hidden states. Give its target: specrt build-draft --draft-dir "
            f"{layout.root} --model {path}, or train a head for this target: specrt train-draft --model {checkpoint}"
        )


def import_mtp(checkpoint: str | Path, out: str | Path, index: int = 0, tensorrt: str = "auto") -> list[Path]:
    """MTP module `index` that the checkpoint carries (export/mtp.py), written as a draft head
    directory in `out` with its engines built, as train-draft leaves a trained head; returns the
    engine directories."""
    from specrt.export.checkpoint import checkpoint_hash
    from specrt.export.mtp import mtp_head

    head = mtp_head(checkpoint, index)
    layout = HeadLayout(out)
    save_head(head, layout.weights)
    report = {
        "method": "mtp",
        "source": f"module {index} of {Path(checkpoint).resolve()}",
        "target": {"checkpoint_hash": checkpoint_hash(checkpoint), "precision": "float32"},
    }
    atomic_write_text(layout.report, json.dumps(report, indent=2) + "\n")
    return build_draft(out, checkpoint, report, tensorrt)
