"""Artifacts on disk: manifests that say what made a file, file hashes, and atomic writes.

Every artifact directory (ONNX export, engine) holds a manifest.json with its `kind`, the source
checkpoint's hash, the settings, the tool versions and `files`: the sha256 of each file it holds.
Readers check the manifest (kind, schema, the fields they need) instead of guessing from file
names, and refuse a foreign, stale or corrupt artifact with a clear error.

Hashing hundreds of MB on every start would cost seconds, so `verify_files` reads a file in full
only when asked to (`full=True`: `specrt inspect`, `--verify-artifacts`) or when the file is not
the one last verified: its size, mtime, ctime or inode differ from the stamp (`.verified.json`)
written after the last full check. Any write to a file changes its ctime, which no user-level
tool can set back, so a flipped byte or a swapped file is always read in full and refused.
The stamp guards against accidents, not against someone who can also rewrite the manifest.

Directories are built under a temporary name (`.<name>.<random>.tmp`) and renamed into place, so
an interrupted step never leaves a half-written artifact where a finished one is expected, and
never destroys the previous one; `clean_stale_temporaries` removes what a killed build left.
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
STAMP = ".verified.json"  # what the last full hash check of an artifact's files saw (see the docstring)
SCHEMA_VERSION = 1
TMP_SUFFIX = ".tmp"  # atomic_dir's temporaries: .<name>.<random>.tmp and .<name>.old


def source_commit() -> str:
    """The commit of the checkout this specrt was imported from (with "+dirty" when tracked
    files differ from it), else $SPECRT_COMMIT (a copy without .git: set it by hand), else
    "unknown": what a benchmark's JSON records, so its figures can be traced to the code."""
    import subprocess

    run = dict(cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=20)
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], **run)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **run).stdout.strip()
            return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("SPECRT_COMMIT") or "unknown (no git checkout and no $SPECRT_COMMIT)"


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


def read_json_object(path: str | Path, error: type[Exception], fix: str) -> dict:
    """A JSON file that must hold an object, or `error` naming the file, what is wrong and `fix`."""
    try:
        value = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise error(f"{path} is not valid JSON ({e}); {fix}.") from None
    except FileNotFoundError:
        raise error(f"{path} does not exist; {fix}.") from None
    if not isinstance(value, dict):
        raise error(f"{path} must hold a JSON object, not {type(value).__name__}; {fix}.")
    return value


def read_json_lines(path: str | Path, error: type[Exception], fix: str, fields: tuple[str, ...] = ()) -> list[dict]:
    """The objects of a JSON-lines file (blank lines skipped), each holding `fields`, or `error`
    naming the file, the first bad line and `fix`."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise error(f"{path} does not exist; {fix}.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path} cannot be read ({e}); {fix}.") from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            raise error(f"{path}:{i} is not a JSON line ({e}); {fix}.") from None
        lacking = [f for f in fields if not isinstance(value, dict) or f not in value]
        if lacking:
            raise error(f"{path}:{i} is not a JSON object with {', '.join(map(repr, lacking))}; {fix}.")
        out.append(value)
    return out


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `final`; on success it replaces `final`.

    On error the temporary directory is removed and `final` (if it existed) is left untouched.
    The files the new manifest lists under `files` were hashed by their writer: once in place
    they are stamped as verified, so the first load does not read them again.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=TMP_SUFFIX, dir=final.parent))
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
    try:
        files = json.loads((final / MANIFEST).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        files = None
    if isinstance(files, dict):
        _write_stamp(final, {name: _stat_record(final / name, digest) for name, digest in files.items()})


def clean_stale_temporaries(directory: str | Path) -> list[Path]:
    """Remove what interrupted atomic_dir calls left in `directory` and its subdirectories
    (`.<name>.*.tmp`, `.<name>.old`); returns what was removed. Call it only while no other
    build writes there (build-engines holds a lock on its output directory)."""
    directory = Path(directory)
    removed = []
    if not directory.is_dir():
        return removed
    for parent in [directory, *(d for d in directory.iterdir() if d.is_dir() and not d.name.startswith("."))]:
        for p in parent.iterdir():
            if p.is_dir() and p.name.startswith(".") and (p.name.endswith(TMP_SUFFIX) or p.name.endswith(".old")):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


@contextlib.contextmanager
def exclusive_lock(directory: str | Path, what: str, option: str = "--out") -> Iterator[None]:
    """Hold an advisory lock on `directory` (a `.lock` file in it) for one writer at a time; a
    second writer is refused at once with a message instead of corrupting the first one's work
    (`option`: the command's option that names the directory)."""
    import fcntl

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            raise ArtifactError(
                f"{directory} is being written by {holder} ({what}); wait for it to finish or use another {option}"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}")
        fh.flush()
        try:
            yield
        finally:
            fh.truncate(0)
            fcntl.flock(fh, fcntl.LOCK_UN)


def _stat_record(path: Path, digest: str) -> dict:
    st = path.stat()
    return {
        "sha256": digest,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "ino": st.st_ino,
    }


def _read_stamp(directory: Path) -> dict:
    try:
        stamp = json.loads((directory / STAMP).read_text())
        return stamp if isinstance(stamp, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_stamp(directory: Path, stamp: dict) -> None:
    try:
        atomic_write_text(directory / STAMP, json.dumps(stamp, indent=1) + "\n")
    except OSError:  # a read-only artifact: every load then verifies in full
        pass


def check_files(
    directory: str | Path, manifest: dict, names: tuple[str, ...], how_to_make: str, verify: str = "auto"
) -> None:
    """Refuse an artifact whose manifest does not list exactly the files `names`, then check their
    hashes (verify: "auto" as in verify_files, "full" always in full, "none" not at all)."""
    if set(manifest["files"]) != set(names):
        raise ArtifactError(
            f"{directory}: its manifest lists {sorted(manifest['files'])}, not {' and '.join(names)}; "
            f"re-create it with: {how_to_make}"
        )
    if verify != "none":
        verify_files(directory, manifest["files"], how_to_make, full=verify == "full")


def verify_files(directory: str | Path, files: dict[str, str], how_to_make: str, full: bool = False) -> None:
    """Refuse the artifact unless every file in `files` ({name: "sha256:..."}) is there and has
    that hash. A file is read in full when `full`, or when it is not the file the stamp of the last
    full check describes; files that pass are stamped."""
    directory = Path(directory)
    stamp = _read_stamp(directory)
    changed = False
    for name, digest in files.items():
        path = directory / name
        if not path.is_file():
            raise ArtifactError(f"{directory} lacks {name}, which its manifest lists; re-create it with: {how_to_make}")
        if not full and stamp.get(name) == _stat_record(path, digest):
            continue
        if file_sha256(path) != digest:
            raise ArtifactError(
                f"{path} does not match the sha256 in its manifest (corrupt, or replaced by another file); "
                f"re-create it with: {how_to_make}"
            )
        stamp[name] = _stat_record(path, digest)
        changed = True
    if changed:
        _write_stamp(directory, {k: v for k, v in stamp.items() if k in files})


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_manifest(directory: str | Path, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    manifest = {"kind": kind, "schema_version": SCHEMA_VERSION, "created": now_iso(), **body}
    atomic_write_text(Path(directory) / MANIFEST, json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


def read_manifest(
    directory: str | Path, kind: str, how_to_make: str, required: dict[str, type] | None = None
) -> dict[str, Any]:
    """The manifest of an artifact directory, checked to be of `kind` and to hold each `required`
    field with its type ({name: type}).

    `how_to_make` is the command that (re)creates such an artifact; errors quote it as the fix.
    """
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise ArtifactError(f"{directory} does not exist. Create it with: {how_to_make}")
    if not path.is_file():
        raise ArtifactError(
            f"{directory} has no {MANIFEST}, so it is not a specrt {kind} artifact. Re-create it with: {how_to_make}"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ArtifactError(f"{path} is corrupt ({e}). Re-create the artifact with: {how_to_make}") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != kind:
        got = manifest.get("kind") if isinstance(manifest, dict) else type(manifest).__name__
        raise ArtifactError(
            f"{directory} holds a {got!r} artifact, not {kind!r}. Point to the right directory or run: {how_to_make}"
        )
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(
            f"{path} has schema version {manifest.get('schema_version')}, this specrt reads {SCHEMA_VERSION}. "
            f"Re-create it with: {how_to_make}"
        )
    for name, typ in {**COMMON_FIELDS, **(required or {})}.items():
        if name not in manifest:
            raise ArtifactError(
                f"{path} lacks the field {name!r} (an incomplete or hand-edited manifest, or one written by an older "
                "specrt). "
                f"Re-create the artifact with: {how_to_make}"
            )
        if not isinstance(manifest[name], typ) or isinstance(manifest[name], bool) and typ is not bool:
            raise ArtifactError(
                f"{path}: field {name!r} should be {_type_name(typ)}, got {json.dumps(manifest[name])[:40]}. "
                f"Re-create the artifact with: {how_to_make}"
            )
    ckpt = manifest["checkpoint"]
    if not (isinstance(ckpt.get("path"), str) and isinstance(ckpt.get("hash"), str)):
        raise ArtifactError(
            f"{path}: field 'checkpoint' needs 'path' and 'hash' strings. Re-create the artifact with: {how_to_make}"
        )
    if not all(
        isinstance(k, str) and isinstance(v, str) and v.startswith("sha256:") for k, v in manifest["files"].items()
    ):
        raise ArtifactError(
            f"{path}: field 'files' should map file names to 'sha256:...' hashes. Re-create the artifact with: "
            f"{how_to_make}"
        )
    return manifest


# every artifact's manifest has these; each reader adds its own
COMMON_FIELDS = {"checkpoint": dict, "config": dict, "files": dict}


def _type_name(typ) -> str:
    return {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number"}.get(
        typ, typ.__name__
    )


def require_same_checkpoint(manifest: dict[str, Any], expected_hash: str | None, what: str, fix: str) -> None:
    """Refuse an artifact made from another checkpoint than the one given (if one is given)."""
    made_from = manifest["checkpoint"]
    if expected_hash is not None and made_from["hash"] != expected_hash:
        raise ManifestMismatchError(
            f"{what} was made from checkpoint {made_from['path']} ({made_from['hash'][:19]}…), not from the "
            f"checkpoint given ({expected_hash[:19]}…). {fix}"
        )
