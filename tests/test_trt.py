"""TensorRT engine builds (run in CI with tensorrt-rtx, which builds on a CPU-only machine),
profiles as data, and refusal of corrupt or mismatched engines. Running an engine needs a GPU."""

import json
import shutil

import pytest

from specrt.engines.profiles import CACHE_ALIGN, EngineShapes, ProfileSpec, Range
from specrt.errors import ArtifactError, ManifestMismatchError, SpecrtError

# -- profiles (no TensorRT needed) ---------------------------------------------------------------


def test_profile_shapes_cover_every_input():
    p = ProfileSpec("verify", Range(1, 1, 2), Range(1, 4, 17), Range(0, 100, 300))
    shapes = p.shapes(num_layers=2, kv_heads=3, head_dim=64)
    assert shapes["input_ids"] == ((1, 1), (1, 4), (2, 17))
    assert shapes["attention_mask"] == ((1, 1, 1), (1, 4, 104), (2, 17, 317))
    assert shapes["past_key_values.1.value"] == ((1, 3, 0, 64), (1, 3, 100, 64), (2, 3, 300, 64))
    assert shapes["logits_index"] == ((1, 1), (1, 4), (2, 17))
    assert len(shapes) == 4 + 4


def test_default_profiles_and_selection():
    verify, prefill = EngineShapes(max_context=1024, max_prefill=256, max_verify=9).profiles()
    assert (verify.name, verify.q_len) == ("verify", Range(1, 4, 9))
    assert (prefill.name, prefill.q_len.max) == ("prefill", 256)
    # the runtime feeds its whole cache (context + one verification), rounded up so that the
    # largest cache's layer slices are 256-byte aligned too
    assert verify.past_len.max == 1088 and verify.past_len.max % CACHE_ALIGN == 0 and 1088 - 64 < 1024 + 9
    assert verify.holds(1, 1, 500) and not verify.holds(1, 10, 500) and prefill.holds(1, 10, 500)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (EngineShapes(max_prefill=4096, max_context=2048), "must not exceed max_context"),
        (EngineShapes(max_verify=0), "must be positive"),
    ],
)
def test_invalid_engine_shapes(shapes, match):
    with pytest.raises(SpecrtError, match=match):
        shapes.profiles()


def test_invalid_range():
    with pytest.raises(
        SpecrtError, match=r"verify.q_len = \(min 5, opt 3, max 8\) must satisfy 1 <= min <= opt <= max"
    ):
        ProfileSpec("verify", Range(1, 1, 1), Range(5, 3, 8), Range(0, 0, 10)).validate()


# -- builds with TensorRT-RTX --------------------------------------------------------------------

trt_mod = pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx is not installed (make setup installs it)")


@pytest.fixture(scope="module")
def tiny_engine(tiny_artifacts):
    return tiny_artifacts / "engines" / "trt-tensorrt-rtx"


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_tiny_engine_built_with_both_profiles(tiny_engine, tiny_checkpoint):
    from specrt.engines.trt import read_trt_manifest
    from specrt.export.checkpoint import checkpoint_hash

    m = read_trt_manifest(tiny_engine, checkpoint_hash_expected=checkpoint_hash(tiny_checkpoint))
    assert m["flavour"] == "tensorrt-rtx" and m["tensorrt_version"] == trt_mod.__version__
    assert [p["name"] for p in m["profiles"]] == ["verify", "prefill"]
    assert m["inputs"][0] == {"name": "input_ids", "dtype": "int64", "shape": [-1, -1]}
    assert m["inputs"][2]["dtype"] == "bool" and m["outputs"][0]["name"] == "logits"
    assert (tiny_engine / "model.engine").stat().st_size > 100_000
    # TF32 (TensorRT's default for float32 GEMMs) was off in the builder: exactness against float32
    assert m["tf32"] is False


def test_build_for_chosen_compute_capability(tiny_artifacts, tmp_path):
    from specrt.engines.trt import TrtBuildSpec, build_trt_engine, read_trt_manifest

    spec = TrtBuildSpec(
        flavour="tensorrt-rtx",
        shapes=EngineShapes(max_context=128, max_prefill=32, max_verify=5),
        compute_capabilities=("SM89",),
        tf32=True,  # asked for explicitly: the manifest records what the builder had
    )
    out = build_trt_engine(tiny_artifacts / "onnx", tmp_path / "sm89", spec, progress=False)
    assert read_trt_manifest(out)["compute_capabilities"] == ["SM89"] and read_trt_manifest(out)["tf32"] is True
    with pytest.raises(SpecrtError, match="unknown compute capability 'SM1'"):
        build_trt_engine(
            tiny_artifacts / "onnx", tmp_path / "bad", TrtBuildSpec(compute_capabilities=("SM1",)), progress=False
        )
    assert not (tmp_path / "bad").exists()
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SpecrtError, match="CURRENT means the GPU of this machine, and none is visible"):
            build_trt_engine(
                tiny_artifacts / "onnx",
                tmp_path / "cur",
                TrtBuildSpec(compute_capabilities=("CURRENT",)),
                progress=False,
            )
        assert not (tmp_path / "cur").exists()


def test_invalid_shapes_fail_before_building(tiny_artifacts, tmp_path):
    from specrt.engines.trt import TrtBuildSpec, build_trt_engine

    with pytest.raises(SpecrtError, match="must not exceed max_context"):
        build_trt_engine(
            tiny_artifacts / "onnx",
            tmp_path / "e",
            TrtBuildSpec(shapes=EngineShapes(max_context=8, max_prefill=64)),
            progress=False,
        )
    assert not (tmp_path / "e").exists()


def test_corrupt_engine_is_refused(tiny_engine, tmp_path):
    from specrt.engines.trt import read_trt_manifest

    e = copy(tiny_engine, tmp_path / "e")
    data = bytearray((e / "model.engine").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (e / "model.engine").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="model.engine does not match the sha256 in its manifest"):
        read_trt_manifest(e)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("tensorrt_version", "1.0.0", "was built with tensorrt-rtx 1.0.0, but .* is installed"),
        ("flavour", "tensorrt", "was built with tensorrt, which is not installed"),
    ],
)
def test_engine_from_other_tensorrt_is_refused(tiny_engine, tmp_path, field, value, match):
    from specrt.engines.trt import read_trt_manifest

    e = copy(tiny_engine, tmp_path / "e")
    m = json.loads((e / "manifest.json").read_text())
    m[field] = value
    (e / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestMismatchError, match=match):
        read_trt_manifest(e)


def test_engine_from_other_onnx_or_checkpoint_is_refused(tiny_engine):
    from specrt.engines.trt import read_trt_manifest

    with pytest.raises(ManifestMismatchError, match="another export of the ONNX step graph"):
        read_trt_manifest(tiny_engine, onnx_files={"model.onnx": "sha256:0"})
    with pytest.raises(ManifestMismatchError, match="was made from checkpoint"):
        read_trt_manifest(tiny_engine, checkpoint_hash_expected="sha256:" + "1" * 64)


@pytest.mark.real_model
def test_default_model_engine_built(real_artifacts):
    """build-engines on the default model builds a TensorRT-RTX engine with both profiles."""
    from specrt.engines.trt import read_trt_manifest

    m = read_trt_manifest(real_artifacts / "engines" / "trt-tensorrt-rtx")
    assert [p["name"] for p in m["profiles"]] == ["verify", "prefill"]
    assert m["profiles"][0]["q_len"]["max"] == 17 and m["profiles"][1]["q_len"]["max"] == 512
    assert len([i for i in m["inputs"] if i["name"].startswith("past_key_values.")]) == 60
    assert (real_artifacts / "engines" / "trt-tensorrt-rtx" / "model.engine").stat().st_size > 100 << 20


def test_engine_without_a_tf32_record_is_rebuilt(tiny_checkpoint, tiny_artifacts, tmp_path):
    """Engines built before the manifest recorded TF32 were built with TensorRT's default (on):
    build-engines rebuilds them; an engine that records it is kept."""
    from specrt.engines.build import BuildSpec, build_all

    art = copy(tiny_artifacts, tmp_path / "art")
    spec = BuildSpec(checkpoint=tiny_checkpoint, out=art, tensorrt="tensorrt-rtx")
    assert any("tensorrt-rtx" in line and "up to date" in line for line in build_all(spec))
    manifest = art / "engines" / "trt-tensorrt-rtx" / "manifest.json"
    m = json.loads(manifest.read_text())
    del m["tf32"]
    manifest.write_text(json.dumps(m))
    lines = list(build_all(spec))
    assert any("tensorrt-rtx" in line and "built in" in line for line in lines), lines
    assert json.loads(manifest.read_text())["tf32"] is False
