"""A checkpoint's files and its fingerprint, without torch: `checkpoint_hash(path)` is what every
artifact manifest records and what opening an engine checks (export/checkpoint.py loads the
weights themselves).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from specrt.errors import CheckpointError

_HASH_CHUNK = 8 << 20


KINDS = (
    "specrt reads a directory with config.json and *.safetensors, a directory `specrt convert FILE.gguf --out DIR "
    "--weights gguf` wrote (config.json and the tokenizer: no safetensors, the weights stay in the GGUF file), or a "
    ".gguf file"
)


def require_checkpoint_dir(ckpt_dir: Path, remake: str | None = None) -> None:
    """Refuse a checkpoint directory that is not there, naming the command that makes it again
    where a record says (`remake`), else what a checkpoint is and how the registry's are made."""
    if not Path(ckpt_dir).is_dir():
        how = (
            f"It was converted from a GGUF file; make it again with: {remake}"
            if remake
            else f"{KINDS} (for the registry's models run `make model`, with MODEL=NAME for one but the default)"
        )
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist. {how}.")


def require_checkpoint(path: str | Path, remake: str | None = None) -> None:
    """A checkpoint (a .gguf file or a directory) that is there (require_checkpoint_dir)."""
    if not Path(path).is_file():
        require_checkpoint_dir(Path(path), remake)


GGUF_SOURCE = "gguf_source.json"  # in a converted checkpoint: the GGUF file it came from (path, sha256)


def gguf_weights(ckpt_dir: str | Path) -> Path | None:
    """The GGUF file a checkpoint's weights are: a .gguf checkpoint itself, or the file a
    directory reads them from (`specrt convert --weights gguf` writes no copy of them); None for
    a directory with weights of its own."""
    if Path(ckpt_dir).suffix == ".gguf":
        return Path(ckpt_dir)
    record = Path(ckpt_dir) / GGUF_SOURCE
    if not record.is_file():
        return None
    try:
        source = json.loads(record.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{record} is not valid JSON ({e}); convert the GGUF file again.") from None
    if not isinstance(source, dict) or not source.get("weights_in_file"):
        return None
    path = recorded_file(ckpt_dir, source)
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt_dir} reads its weights from the GGUF file {path}, which is gone; put it back or convert the "
            "file again (specrt convert FILE --out DIR --weights gguf)."
        )
    if isinstance(source.get("sha256"), str) and file_digest(path) != source["sha256"]:
        raise CheckpointError(
            f"{path} changed since {ckpt_dir} was converted from it (its sha256 is not the one {record.name} "
            f"records), and {ckpt_dir} reads its weights from it: put the original file back, or convert the file as "
            f"it is now: specrt convert {path} --out {ckpt_dir} --weights gguf (then rebuild its engines)."
        )
    return path


def recorded_file(ckpt_dir: str | Path, source: dict) -> Path:
    """The GGUF file a gguf_source.json names: where it was at convert, else the same place
    relative to the checkpoint (a project folder moved with its models)."""
    path = Path(source.get("file", ""))
    relative = source.get("relative")
    if not path.is_file() and isinstance(relative, str) and (Path(ckpt_dir) / relative).is_file():
        return Path(ckpt_dir) / relative
    return path


def file_digest(path: str | Path) -> str:
    """The sha256 of a file ("sha256:..."), read in full only when the file is not the one last
    read: its path, size, modification time, change time or inode differ (any write changes the
    change time, which no user-level tool sets back). Remembered in ~/.cache/specrt, as
    checkpoint_hash's are: a 1 GB GGUF is checked at every start for the cost of a stat."""
    path = Path(path).resolve()
    st = os.stat(path)
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
    cache_path = _hash_cache_path().with_name("file-hashes.json")
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    if isinstance(cache, dict) and isinstance(cache.get(key), str):
        return cache[key]
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
    digest = "sha256:" + h.hexdigest()
    cache = {k: v for k, v in (cache if isinstance(cache, dict) else {}).items() if not k.startswith(f"{path}:")}
    _write_cache(cache_path, {**cache, key: digest})
    return digest


def _write_cache(cache_path: Path, cache: dict) -> None:
    try:  # the cache is an optimisation: a read-only home directory only costs time
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_name(f".{cache_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_path)
    except OSError:
        pass


def weight_files(ckpt_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in a stable order."""
    ckpt_dir = Path(ckpt_dir)
    require_checkpoint_dir(ckpt_dir)
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in ckpt_dir.glob("*.bin")) + sorted(p.name for p in ckpt_dir.glob("*.pt"))
        hint = (
            f" It has pickle weights ({', '.join(pickles)}), which specrt does not load; re-save them as safetensors."
            if pickles
            else ""
        )
        if not hint and (ckpt_dir / "config.json").is_file():
            hint = (
                f" It holds config.json but no weights, and no {GGUF_SOURCE} naming a GGUF file it reads them from "
                "(what `specrt convert FILE.gguf --out DIR --weights gguf` writes); convert the file again."
            )
        raise CheckpointError(f"no *.safetensors files in {ckpt_dir}.{hint}")
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            needed = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is corrupt ({e}); restore it from the original checkpoint.") from None
        missing = sorted(needed - {f.name for f in files})
        if missing:
            raise CheckpointError(
                f"{ckpt_dir} is incomplete: shards {', '.join(missing)} named in {index.name} are missing."
            )
    return files


def _hash_cache_path() -> Path:
    root = os.environ.get("SPECRT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "specrt"
    )
    return Path(root) / "checkpoint-hashes.json"


def checkpoint_hash(path: str | Path) -> str:
    """sha256 over config.json and the weight files (or over the GGUF file, or config.json and
    the GGUF file a converted directory reads its weights from).

    Hashing a checkpoint reads all of it (~1.3 s for 540 MB), so results are remembered in
    ~/.cache/specrt keyed by each file's path, size and modification time; any change to a file
    changes its key and forces a fresh hash.
    """
    path = Path(path)
    if path.is_file():
        files = [path]
    elif gguf_weights(path) is not None:
        files = [path / "config.json", gguf_weights(path)]
    else:
        files = weight_files(path)
        if not (path / "config.json").is_file():
            raise CheckpointError(
                f"{path} has no config.json; a checkpoint directory needs it next to its safetensors files."
            )
        files = [path / "config.json", *files]
    stats = [os.stat(f) for f in files]
    key = "|".join(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}" for f, st in zip(files, stats))
    cache_path = _hash_cache_path()
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(_HASH_CHUNK):
                h.update(chunk)
    digest = "sha256:" + h.hexdigest()
    cache = {k: v for k, v in cache.items() if not k.startswith(str(files[0].resolve().parent))}
    _write_cache(cache_path, {**cache, key: digest})
    return digest
