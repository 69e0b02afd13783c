"""ORT engines: build, reuse, provider report, and refusal of stale, foreign or corrupt engines."""

import json
import shutil
from pathlib import Path

import pytest

from specrt.engines.build import BuildSpec, build_all
from specrt.engines.ort import OrtOptions, build_ort_engine, load_ort_session
from specrt.errors import ArtifactError, ManifestMismatchError, SpecrtError
from specrt.export.checkpoint import checkpoint_hash
from specrt.runtime.generator import Generator

from conftest import random_model, save_checkpoint, tiny_hf_config


def copy_artifacts(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_engine_reports_provider_and_records_versions(tiny_artifacts):
    session, manifest, provider = load_ort_session(tiny_artifacts / "engines" / "ort-cpu")
    assert provider == "CPUExecutionProvider" == session.get_providers()[0]
    assert manifest["kind"] == "ort-engine" and manifest["versions"]["onnxruntime"]
    # it runs the graph it was built from, referenced, not a copy
    assert manifest["graph_dir"] == "../../onnx-fused" and manifest["files"] == {}
    assert not (tiny_artifacts / "engines" / "ort-cpu" / "model.opt.onnx").exists()
    assert load_ort_session(str(tiny_artifacts / "engines" / "ort-cpu"))[1] == manifest  # a str path too


def test_build_all_reuses_up_to_date_artifacts(tiny_checkpoint, tiny_artifacts, tmp_path):
    out = copy_artifacts(tiny_artifacts, tmp_path / "art")
    lines = list(build_all(BuildSpec(checkpoint=tiny_checkpoint, out=out)))
    assert "up to date" in lines[0] and "up to date" in lines[1]
    from specrt.engines.trt import available_flavours

    if available_flavours():
        assert "up to date" in lines[2]
    else:
        assert "skipped: neither tensorrt nor tensorrt-rtx is installed" in lines[2]


def test_build_all_rebuilds_when_checkpoint_changes(tiny_checkpoint, tiny_artifacts, tmp_path):
    out = copy_artifacts(tiny_artifacts, tmp_path / "art")
    other = save_checkpoint(random_model(tiny_hf_config(), seed=7), tiny_hf_config(), tmp_path / "other")
    lines = list(build_all(BuildSpec(checkpoint=other, out=out)))
    assert lines[0].startswith("model") and "copied" in lines[0]  # the run-time files of the new checkpoint
    assert "exported" in lines[1] and "onnx-fused: written" in lines[2] and "built" in lines[3]
    assert json.loads((out / "engines/ort-cpu/manifest.json").read_text())["checkpoint"]["hash"] == checkpoint_hash(
        other
    )


def test_engine_from_other_checkpoint_is_refused(tiny_artifacts, tmp_path):
    other = save_checkpoint(random_model(tiny_hf_config(), seed=9), tiny_hf_config(), tmp_path / "other")
    with pytest.raises(ManifestMismatchError, match="engine .* was made from checkpoint .* Rebuild it"):
        Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu", checkpoint=other)


def test_engine_built_by_other_onnxruntime_is_refused(tiny_artifacts, tmp_path):
    art = copy_artifacts(tiny_artifacts, tmp_path / "art")
    mpath = art / "engines/ort-cpu/manifest.json"
    m = json.loads(mpath.read_text())
    m["versions"]["onnxruntime"] = "0.0.1"
    mpath.write_text(json.dumps(m))
    with pytest.raises(ManifestMismatchError, match="onnxruntime 0.0.1"):
        load_ort_session(art / "engines/ort-cpu")


def test_engine_optimized_on_other_cpu_is_refused(tiny_artifacts, tmp_path):
    art = copy_artifacts(tiny_artifacts, tmp_path / "art")
    mpath = art / "engines/ort-cpu/manifest.json"
    m = json.loads(mpath.read_text())
    m["host_cpu"] = "Some Other CPU 9000"
    mpath.write_text(json.dumps(m))
    with pytest.raises(ManifestMismatchError, match="optimized on a 'Some Other CPU 9000' CPU.*Rebuild it here"):
        load_ort_session(art / "engines/ort-cpu")
    # build-engines notices the stale engine and rebuilds it
    lines = list(build_all(BuildSpec(checkpoint=Path(m["checkpoint"]["path"]), out=art)))
    assert "onnx-fused: up to date" in lines[1] and "built" in lines[2]
    load_ort_session(art / "engines/ort-cpu")


def test_corrupt_engine_file_is_refused(tiny_artifacts, tmp_path):
    art = copy_artifacts(tiny_artifacts, tmp_path / "art")
    (art / "onnx-fused/model.onnx").write_bytes(b"\x00garbage" * 100)  # the graph the engine runs
    with pytest.raises(
        ArtifactError,
        match="model.onnx does not match the sha256 in its manifest .* re-create it with: specrt build-engines",
    ):
        load_ort_session(art / "engines/ort-cpu")
    # unchecked (verify="none"), ONNX Runtime's own refusal is still one clear error
    with pytest.raises(ArtifactError, match="could not load .*model.onnx .* rebuild it"):
        load_ort_session(art / "engines/ort-cpu", verify="none")


@pytest.mark.parametrize("damage", ["no-manifest", "bad-json", "wrong-kind"])
def test_missing_or_foreign_manifest_is_refused(tiny_artifacts, tmp_path, damage):
    art = copy_artifacts(tiny_artifacts, tmp_path / "art")
    mpath = art / "engines/ort-cpu/manifest.json"
    if damage == "no-manifest":
        mpath.unlink()
    elif damage == "bad-json":
        mpath.write_text("{not json")
    else:
        mpath.write_text((art / "onnx/manifest.json").read_text())
    with pytest.raises(ArtifactError, match="specrt build-engines"):
        load_ort_session(art / "engines/ort-cpu")


def test_unavailable_gpu_provider_is_a_clear_error(tiny_artifacts, tmp_path):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has CUDA; the refusal path cannot be shown here")
    with pytest.raises(SpecrtError, match="CUDAExecutionProvider is not available .* onnxruntime-gpu"):
        build_ort_engine(tiny_artifacts / "onnx", tmp_path / "cuda", OrtOptions(provider="cuda"))
    assert not (tmp_path / "cuda").exists()


def test_engine_for_other_provider_is_refused(tiny_artifacts):
    with pytest.raises(ManifestMismatchError, match="built for CPUExecutionProvider, not CUDAExecutionProvider"):
        load_ort_session(tiny_artifacts / "engines" / "ort-cpu", OrtOptions(provider="cuda"))


def test_build_reexports_a_graph_without_the_heads_layers(tiny_checkpoint, tmp_path):
    """An export made before draft heads read several layers (hidden_layers [-1]) is exported
    again by build-engines, so heads find their features."""
    from specrt.engines.build import BuildSpec, build_all
    from specrt.export.step_graph import export_step_graph
    from specrt.schema.graph_files import read_onnx_manifest
    from specrt.schema.head_io import default_target_layers

    export_step_graph(tiny_checkpoint, tmp_path / "onnx", hidden_layers=(-1,), progress=False)
    lines = list(build_all(BuildSpec(checkpoint=tiny_checkpoint, out=tmp_path, tensorrt="off")))
    assert any("returns the features of layers [-1]" in line for line in lines)
    assert read_onnx_manifest(tmp_path / "onnx")["hidden_layers"] == list(default_target_layers(2))


def test_an_engine_whose_graph_is_gone_says_so(tiny_artifacts, tmp_path):
    art = copy_artifacts(tiny_artifacts, tmp_path / "art")
    shutil.rmtree(art / "onnx-fused")  # the graph the engine references
    with pytest.raises(ArtifactError, match=r"runs the step graph in .*onnx-fused, which is gone; rebuild it with"):
        load_ort_session(art / "engines/ort-cpu")
