"""Artifacts on disk: manifests that say what made a file, and atomic writes.

Every artifact directory (ONNX export, engine) holds a manifest.json with its `kind`, the source
checkpoint's hash, the settings and the tool versions. Readers check the manifest instead of
guessing from file names, and refuse a foreign or stale artifact with a clear error. Directories
are built under a temporary name and renamed into place, so an interrupted step never leaves a
half-written artifact where a finished one is expected, and never destroys the previous one.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import platform
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

from specrt.errors import ArtifactError, ManifestMismatchError

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1


def package_versions(*names: str) -> dict[str, str]:
    out = {"python": platform.python_version()}
    for n in ("specrt", *names):
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = "not installed"
    return out


def cpu_model() -> str:
    """The processor's model name (engines optimized for one CPU are not moved to another)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `final`; on success it replaces `final`.

    On error the temporary directory is removed and `final` (if it existed) is left untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        for f in tmp.rglob("*"):
            f.chmod(0o755 if f.is_dir() else 0o644)
        tmp.chmod(0o755)
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_manifest(directory: str | Path, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    manifest = {"kind": kind, "schema_version": SCHEMA_VERSION, "created": now_iso(), **body}
    atomic_write_text(Path(directory) / MANIFEST, json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


def read_manifest(directory: str | Path, kind: str, how_to_make: str) -> dict[str, Any]:
    """The manifest of an artifact directory, checked to be of `kind`.

    `how_to_make` is the command that (re)creates such an artifact; errors quote it as the fix.
    """
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise ArtifactError(f"{directory} does not exist. Create it with: {how_to_make}")
    if not path.is_file():
        raise ArtifactError(f"{directory} has no {MANIFEST}, so it is not a specrt {kind} artifact. Re-create it with: {how_to_make}")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path} is corrupt ({e}). Re-create the artifact with: {how_to_make}") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != kind:
        got = manifest.get("kind") if isinstance(manifest, dict) else type(manifest).__name__
        raise ArtifactError(f"{directory} holds a {got!r} artifact, not {kind!r}. Point to the right directory or run: {how_to_make}")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(
            f"{path} has schema version {manifest.get('schema_version')}, this specrt reads {SCHEMA_VERSION}. Re-create it with: {how_to_make}"
        )
    return manifest


def require_same_checkpoint(manifest: dict[str, Any], expected_hash: str | None, what: str, fix: str) -> None:
    """Refuse an artifact made from another checkpoint than the one given (if one is given)."""
    made_from = manifest["checkpoint"]
    if expected_hash is not None and made_from["hash"] != expected_hash:
        raise ManifestMismatchError(
            f"{what} was made from checkpoint {made_from['path']} ({made_from['hash'][:19]}…), not from the "
            f"checkpoint given ({expected_hash[:19]}…). {fix}"
        )
