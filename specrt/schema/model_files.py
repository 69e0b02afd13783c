"""The model's run-time files that an artifact folder carries, so that a copied folder runs at any
path without the checkpoint it was built from (an edge box that receives only the built engines):

    <root>/model/   tokenizer.json, tokenizer_config.json, chat_template.jinja, config.json, ...
                    and manifest.json (the checkpoint's hash, each file's sha256, the command
                    that makes the checkpoint again)

build-engines writes it from the checkpoint (`write_model_files`); every engine records where it
is, relative to the engine (`model_dir`, as it records its graph), and a run reads the tokenizer
and chat template from there (`engine_model_files`), checked against the manifest's hashes as an
engine's own files are. A checkpoint given explicitly at run time still wins (and must be the
engine's).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from specrt.artifacts import (
    MANIFEST,
    atomic_dir,
    file_sha256,
    read_manifest,
    verify_files,
    write_manifest,
)
from specrt.errors import ArtifactError
from specrt.layout import ArtifactLayout
from specrt.schema.checkpoint_files import GGUF_SOURCE

MODEL_FILES_KIND = "model-files"
# what a run reads of a checkpoint besides its weights (runtime/tokenizer.py; the config for reference)
RUN_TIME_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "config.json",
    "generation_config.json",
)
HOW = "specrt build-engines --model CHECKPOINT --out DIR"


def remake_command(checkpoint: Path) -> str | None:
    """The command that makes a checkpoint directory again, where it records one: a conversion
    of a GGUF file (gguf_source.json) with the weights it chose; None for a directory of its own."""
    try:
        source = json.loads((Path(checkpoint) / GGUF_SOURCE).read_text())
        file = str(source["file"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    weights = " --weights gguf" if source.get("weights_in_file") else ""
    return f"specrt convert {file} --out {Path(checkpoint).resolve()}{weights}"


def write_model_files(checkpoint: str | Path, root: str | Path, ckpt_hash: str) -> tuple[Path | None, bool]:
    """(`root`/model/, written) from the checkpoint's run-time files, unless it holds this
    checkpoint's already; (None, False) for a checkpoint without a tokenizer directory (a .gguf
    file)."""
    checkpoint, out = Path(checkpoint), ArtifactLayout(root).model_files
    if not (checkpoint / "tokenizer.json").is_file():
        return None, False
    if _current(out, ckpt_hash):
        return out, False
    with atomic_dir(out) as tmp:
        names = [n for n in RUN_TIME_FILES if (checkpoint / n).is_file()]
        for name in names:
            shutil.copyfile(checkpoint / name, tmp / name)
        write_manifest(
            tmp,
            MODEL_FILES_KIND,
            {
                "checkpoint": {"path": str(checkpoint.resolve()), "hash": ckpt_hash},
                "config": _json_or_empty(tmp / "config.json"),
                "remake": remake_command(checkpoint),
                "files": {n: file_sha256(tmp / n) for n in names},
            },
        )
    return out, True


def model_dir_for(engine_dir: str | Path, root: str | Path, ckpt_hash: str) -> str | None:
    """What an engine's manifest records as `model_dir`: root/model/ relative to the engine, when it
    holds this checkpoint's files (None: the run reads the checkpoint itself)."""
    out = ArtifactLayout(root).model_files
    if not _current(out, ckpt_hash):
        return None
    return os.path.relpath(out.resolve(), Path(engine_dir).resolve())


def engine_model_files(engine_dir: str | Path, manifest: dict, verify: str = "auto") -> Path | None:
    """The folder of run-time files an engine's manifest names, checked (its manifest, the
    engine's checkpoint, each file's hash), or None for an engine that names none."""
    relative = manifest.get("model_dir")
    if not isinstance(relative, str):
        return None
    engine_dir = Path(engine_dir)
    folder = (engine_dir / relative).resolve()
    if not (folder / MANIFEST).is_file():
        raise ArtifactError(
            f"engine {engine_dir} reads its tokenizer and chat template from {folder}, which is gone; copy the whole "
            f"artifacts folder (the engines, their graphs and model/ together), or rebuild it with: {HOW}"
        )
    m = read_manifest(folder, MODEL_FILES_KIND, HOW)
    if m["checkpoint"]["hash"] != manifest["checkpoint"]["hash"]:
        raise ArtifactError(
            f"{folder} holds the files of another checkpoint than engine {engine_dir} was built from; rebuild the "
            f"engines with: {HOW}"
        )
    if verify != "none":
        verify_files(folder, m["files"], HOW, full=verify == "full")
    return folder


def missing_checkpoint_advice(engine_dir: str | Path, manifest: dict) -> str:
    """What an engine without run-time files of its own says when its checkpoint is gone."""
    path = manifest["checkpoint"]["path"]
    return (
        f"engine {engine_dir} was built before engines carried their tokenizer, and reads it from the checkpoint it "
        f"was built from, {path}, which is not there. Rebuild the engines with the checkpoint present (specrt "
        f"build-engines --model {path} --out DIR: they then run from the artifacts folder alone), or give --model "
        "with that checkpoint"
    )


def model_files_remake(engine_dir: str | Path, manifest: dict, checkpoint: str | Path) -> str | None:
    """The command that makes `checkpoint` again, where the engine's run-time files record one
    for that checkpoint (a conversion of a GGUF file); None otherwise."""
    relative = manifest.get("model_dir")
    if not isinstance(relative, str):
        return None
    try:
        m = json.loads(((Path(engine_dir) / relative) / MANIFEST).read_text())
        same = Path(m["checkpoint"]["path"]).resolve() == Path(checkpoint).resolve()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return m.get("remake") if same and isinstance(m.get("remake"), str) else None


def _current(out: Path, ckpt_hash: str) -> bool:
    try:
        m = read_manifest(out, MODEL_FILES_KIND, HOW)
        verify_files(out, m["files"], HOW)
    except ArtifactError:
        return False
    return m["checkpoint"]["hash"] == ckpt_hash


def _json_or_empty(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
