"""Artifacts that were damaged after they were built: refused by the loaders and by inspect.

Every artifact's manifest records the sha256 of its files. Loading hashes a file in full only
when it is not the file the last full check saw (size, mtime, ctime or inode differ from the
stamp); `inspect` and `--verify-artifacts` always hash in full. Each test damages a copy of the
tiny artifacts the way a disk, a copy or a person would, and checks the refusal and its fix.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

import specrt.artifacts as artifacts
from specrt.cli import main
from specrt.engines.build import BuildSpec, build_all
from specrt.engines.ort import load_ort_session
from specrt.errors import ArtifactError
from specrt.inspection import inspect_artifact
from specrt.runtime.generator import Generator

from conftest import random_model, save_checkpoint, tiny_hf_config

ENGINE = "engines/ort-cpu"
GRAPH = "onnx-fused"  # the graph the engine runs (it references it: engines/ort.py)


@pytest.fixture
def art(tiny_artifacts, tmp_path):
    return shutil.copytree(tiny_artifacts, tmp_path / "art")


@pytest.fixture(scope="module")
def other_art(tmp_path_factory):
    """Artifacts of another, smaller model: the source of a swapped graph."""
    cfg = tiny_hf_config(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1)
    d = tmp_path_factory.mktemp("other")
    ckpt = save_checkpoint(random_model(cfg, seed=3), cfg, d / "ckpt")
    list(build_all(BuildSpec(checkpoint=ckpt, out=d / "art", tensorrt="off")))
    return d / "art"


def flip_byte(path, keep_mtime=False):
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(st.st_size // 2)
        b = fh.read(1)
        fh.seek(st.st_size // 2)
        fh.write(bytes([b[0] ^ 0x40]))
    if keep_mtime:  # as `touch -r` would: only the ctime tells
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def generate(art, *extra):
    return CliRunner().invoke(
        main, ["generate", "--artifacts", str(art), "--prompt", "w5 w6", "--max-new-tokens", "6", *extra]
    )


@pytest.fixture
def count_hashes(monkeypatch):
    """The names of the files hashed in full, in order."""
    seen = []
    real = artifacts.file_sha256

    def counting(path):
        seen.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(artifacts, "file_sha256", counting)
    return seen


@pytest.mark.parametrize("name", ["model.onnx.data", "model.onnx"])
@pytest.mark.parametrize("keep_mtime", [False, True])
def test_flipped_byte_is_refused_by_generate_and_inspect(art, name, keep_mtime):
    assert generate(art).exit_code == 0  # loads, and stamps the files as verified
    flip_byte(art / GRAPH / name, keep_mtime)
    r = generate(art)
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.output.strip().splitlines()[-1] == (
        f"Error: {art / GRAPH / name} does not match the sha256 in its manifest (corrupt, or replaced by another "
        "file); "
        "re-create it with: specrt build-engines --model CHECKPOINT --out DIR"
    )
    i = inspect_artifact(art / ENGINE)
    assert not i.usable and f"{name} does not match the sha256" in i.verdict


def test_swapped_graph_is_refused_before_onnxruntime_sees_it(art, other_art):
    for f in ("model.onnx", "model.onnx.data"):
        shutil.copy(other_art / GRAPH / f, art / GRAPH / f)
    r = generate(art)
    assert r.exit_code == 1 and "model.onnx does not match the sha256" in r.output and "input" not in r.output.lower()
    r = CliRunner().invoke(main, ["inspect", str(art)])
    assert r.exit_code == 1 and "refused here" in r.output and "does not match the sha256" in r.output
    assert "usable here" in r.output  # the intact onnx/ export beside it still is


@pytest.mark.parametrize("export", ["onnx", "onnx-fused"])
def test_swapped_onnx_export_is_refused_and_rebuilt(art, other_art, tiny_checkpoint, export):
    """A damaged export is made again, not reused; the ORT engine is rebuilt when it is the
    export it was built from (the fused one; TensorRT reads onnx/)."""
    shutil.copy(other_art / export / "model.onnx.data", art / export / "model.onnx.data")
    assert not inspect_artifact(art / export).usable
    lines = list(build_all(BuildSpec(checkpoint=tiny_checkpoint, out=art, tensorrt="off")))
    if export == "onnx":
        assert "exported" in lines[0] and "onnx-fused: up to date" in lines[1] and "up to date" in lines[2]
    else:
        assert "up to date" in lines[0] and "onnx-fused: written" in lines[1] and "built" in lines[2]
    assert all(inspect_artifact(art / d).usable for d in ("onnx", "onnx-fused", ENGINE))


def test_a_fresh_build_is_not_hashed_again_on_load(tiny_artifacts, count_hashes):
    load_ort_session(tiny_artifacts / ENGINE)  # the build hashed and stamped its files
    assert count_hashes == []


def test_copied_engine_is_hashed_once_then_trusted(tiny_artifacts, tmp_path, count_hashes):
    copy = shutil.copytree(tiny_artifacts, tmp_path / "copy")  # new inodes: the stamp does not vouch for them
    load_ort_session(copy / ENGINE)
    assert sorted(count_hashes) == ["model.onnx", "model.onnx.data"]  # the graph the engine runs
    count_hashes.clear()
    load_ort_session(copy / ENGINE)
    assert count_hashes == []
    os.utime(copy / GRAPH / "model.onnx")  # touched: hashed again (and passes)
    load_ort_session(copy / ENGINE)
    assert count_hashes == ["model.onnx"]
    count_hashes.clear()
    load_ort_session(copy / ENGINE, verify="full")  # --verify-artifacts
    assert sorted(count_hashes) == ["model.onnx", "model.onnx.data"]


def test_inspect_hashes_in_full_even_when_the_stamp_vouches(tiny_artifacts, count_hashes):
    assert inspect_artifact(tiny_artifacts / ENGINE).usable
    assert sorted(count_hashes) == ["model.onnx", "model.onnx.data"]


def test_verify_artifacts_flag_hashes_in_full(art, count_hashes):
    load_ort_session(art / ENGINE)
    count_hashes.clear()
    assert generate(art).exit_code == 0 and "model.onnx" not in count_hashes
    assert generate(art, "--verify-artifacts").exit_code == 0
    assert {"model.onnx", "model.onnx.data"} <= set(count_hashes)


def test_engine_without_file_hashes_is_rebuilt(art, tiny_checkpoint):
    """An engine whose manifest has no `files` (written by an older specrt) is refused with the
    fix, and build-engines replaces it instead of reusing it."""
    mpath = art / ENGINE / "manifest.json"
    m = json.loads(mpath.read_text())
    del m["files"]
    mpath.write_text(json.dumps(m))
    with pytest.raises(
        ArtifactError, match="lacks the field 'files' .* Re-create the artifact with: specrt build-engines"
    ):
        Generator.from_engine(art / ENGINE)
    lines = list(build_all(BuildSpec(checkpoint=tiny_checkpoint, out=art, tensorrt="off")))
    assert "up to date" in lines[0] and "up to date" in lines[1] and "built" in lines[2]
    Generator.from_engine(art / ENGINE)


MISSING = [
    (ENGINE, "provider"),
    (ENGINE, "versions"),
    (ENGINE, "config"),
    (ENGINE, "checkpoint"),
    (ENGINE, "onnx"),
    (ENGINE, "host_cpu"),
    ("onnx", "config"),
    ("onnx", "files"),
    ("onnx", "inputs"),
]


@pytest.mark.parametrize("where, field", MISSING)
def test_manifest_without_a_field_is_one_line(art, where, field):
    mpath = art / where / "manifest.json"
    m = json.loads(mpath.read_text())
    del m[field]
    mpath.write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["inspect", str(art / where)])
    assert r.exit_code == 1 and not isinstance(r.exception, (KeyError, TypeError, AttributeError)), r.output
    assert f"lacks the field '{field}'" in r.output and "Traceback" not in r.output
    if where == ENGINE:
        r = generate(art)
        assert r.exit_code == 1 and not isinstance(r.exception, (KeyError, TypeError)), r.output
        assert f"lacks the field '{field}'" in r.output.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("config", {"vocab_size": 128}, "lacks fields"),
        ("files", {"model.opt.onnx": 5}, "'files' should map file names"),
        ("provider", 3, "field 'provider' should be a string"),
        ("checkpoint", {"path": "x"}, "'checkpoint' needs 'path' and 'hash'"),
    ],
)
def test_manifest_with_a_wrong_field_is_one_line(art, field, value, message):
    mpath = art / ENGINE / "manifest.json"
    m = json.loads(mpath.read_text())
    m[field] = value
    mpath.write_text(json.dumps(m))
    r = generate(art)
    assert (
        r.exit_code == 1 and message in r.output and not isinstance(r.exception, (KeyError, TypeError, AttributeError))
    ), r.output


def test_killed_build_leaves_nothing_a_rerun_keeps(art, tiny_checkpoint):
    """A build killed hard (no Python cleanup) leaves its temporary directory; the next build
    removes it first."""
    code = (
        "import os, sys\n"
        "from specrt.artifacts import atomic_dir\n"
        f"with atomic_dir({str(art / ENGINE)!r}) as tmp:\n"
        "    (tmp / 'model.opt.onnx.data').write_bytes(b'x' * 4096)\n"
        "    os._exit(9)\n"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    left = [p.name for p in (art / "engines").iterdir() if p.name.endswith(".tmp")]
    assert len(left) == 1 and left[0].startswith(".ort-cpu.")
    lines = list(build_all(BuildSpec(checkpoint=tiny_checkpoint, out=art, tensorrt="off")))
    assert lines[0].startswith("cleaned ") and left[0] in lines[0]
    assert not [p for p in (art / "engines").iterdir() if p.name.endswith(".tmp")]
    assert any("up to date" in line for line in lines)


def test_second_build_in_the_same_directory_is_refused(art, tiny_checkpoint):
    with artifacts.exclusive_lock(art, "a test"):
        with pytest.raises(ArtifactError, match=rf"{art} is being written by pid {os.getpid()} .*use another --out"):
            list(build_all(BuildSpec(checkpoint=tiny_checkpoint, out=art, tensorrt="off")))
    list(build_all(BuildSpec(checkpoint=tiny_checkpoint, out=art, tensorrt="off")))  # free again
