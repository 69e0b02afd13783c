"""Every script under bench/ answers --help: its imports and arguments hold without the peers,
models or artifacts it measures (a broken benchmark is found here, not in a long run)."""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
# a *_worker.py runs in a peer's own Python (onnxruntime-genai's), reading a job from stdin
SCRIPTS = sorted(
    p for p in BENCH.glob("*.py") if 'if __name__ == "__main__":' in p.read_text() and not p.stem.endswith("_worker")
)


def test_the_scripts_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"bench_exact.py", "bench_prefill.py", "bench_concurrency.py"} <= names
    assert "harness.py" not in names  # a module, not a script


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_bench_script_answers_help(script, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    assert done.value.code in (0, None)
    assert "usage:" in out.getvalue()


def test_the_sampled_check_passes_exact_speculation_and_fails_a_biased_sampler(tiny_artifacts, tmp_path, monkeypatch):
    """bench/sampled_check.py (bench_exact --chi-square): a draft model with q != p (another
    random model) sampled through verification passes against the target's exact joint; a
    sampler that does not follow the target (greedy in place of T = 0.7) fails it."""
    import dataclasses

    from specrt.engines.build import BuildSpec, build_all
    from specrt.runtime.drafts import make_proposer
    from specrt.runtime.generator import Generator
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy

    from conftest import TINY_HF, random_model, save_checkpoint

    monkeypatch.syspath_prepend(str(BENCH))
    from sampled_check import two_token_check

    gen = Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")
    gen.eos_ids = frozenset()
    other = save_checkpoint(random_model(TINY_HF, seed=11), TINY_HF, tmp_path / "draft")
    list(build_all(BuildSpec(checkpoint=other, out=tmp_path / "draft-art", tensorrt="off")))
    draft = make_proposer("draft-model", draft_dir=tmp_path / "draft-art", target=gen.session.caps)
    spec = SpeculativeDecoder(gen, draft, make_policy(2))
    ok = two_token_check(gen, spec, [40, 41, 42], rounds=6, rows=48, temperature=0.7)
    assert ok["samples"] == 288 and ok["drafted"] > ok["accepted"] > 0 and ok["p_value"] > 1e-3

    class Greedy:  # samples nothing: every draw is the likeliest pair
        def generate_ids(self, prompts, n, sampling):
            return spec.generate_ids(prompts, n, dataclasses.replace(sampling, temperature=0.0))

    assert two_token_check(gen, Greedy(), [40, 41, 42], rounds=2, rows=48, temperature=0.7)["p_value"] < 1e-6


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--exact-engines", "int4 bitwise"], "are not among --engines"),
        (["--exact-from", "40"], "--exact-from 40 must lie in 0"),
    ],
)
def test_bench_exact_refuses_bad_exactness_arguments_before_building(extra, says, tmp_path):
    """Checked before any engine is built: the artifacts folder is never made."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "bench" / "bench_exact.py"
    args = ["--artifacts", str(tmp_path / "art"), "--model", str(tmp_path / "none"), "--engines", "float32 bitwise"]
    args += ["--exact-engines", "float32 bitwise"] if "--exact-engines" not in extra else []
    run = subprocess.run([sys.executable, str(script), *args, *extra], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and says in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "art").exists()


def test_bench_step_rules_collects_what_the_build_probed(tiny_artifacts, tmp_path, monkeypatch, capsys):
    """bench/bench_step_rules.py reads each ORT engine's probe from its manifest: the floor the
    runtime follows (engines/ort_measure.floor_of), the cuts and the CPU, in the table and JSON."""
    import json

    from specrt.artifacts import cpu_model
    from specrt.engines.ort_measure import floor_of

    monkeypatch.syspath_prepend(str(BENCH))
    out = tmp_path / "rules.json"
    monkeypatch.setattr(sys, "argv", ["bench_step_rules.py", str(tiny_artifacts), "--out", str(out)])
    runpy.run_path(str(BENCH / "bench_step_rules.py"), run_name="__main__")
    rows = json.loads(out.read_text())["rows"]
    manifest = json.loads((tiny_artifacts / "engines" / "ort-cpu" / "manifest.json").read_text())
    assert [r["engine"] for r in rows] == ["ort-cpu"]
    row = rows[0]
    assert row["floor"] == floor_of(manifest["batch_invariance"]) and row["host_cpu"] == cpu_model()
    assert row["cuts"] == manifest["step_cuts"]["cuts"] and row["scheme"] == "float32"
    assert f"{row['floor']:>5}" in capsys.readouterr().out


def test_bench_step_rules_refuses_a_folder_without_engines(tmp_path):
    import subprocess

    script = BENCH / "bench_step_rules.py"
    run = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "build them first" in run.stderr, run.stderr[-2000:]


def _four_bit_graph(folder: Path, level: int, K: int = 64, N: int = 24) -> np.ndarray:
    """A one-node graph of a 4-bit MatMulNBits (blocks of 32, zero point 8) at `level`, written
    as folder/model.onnx; returns its weights (K x N) dequantized by hand."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, (N, K // 32, 32), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, (N, K // 32)).astype(np.float32)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    node = helper.make_node(
        "MatMulNBits", ["x", "B", "scales"], ["y"], domain="com.microsoft",
        K=K, N=N, bits=4, block_size=32, accuracy_level=level,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales.reshape(-1), "scales")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    folder.mkdir()
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(folder / "model.onnx"))
    return ((codes.astype(np.float64) - 8) * scales[..., None]).reshape(N, K).T


def test_bench_row_kernels_measures_against_the_weights_as_dequantized_by_hand(tmp_path, monkeypatch):
    """bench/bench_row_kernels.py reads a product's weights through ORT's level-0 kernel; here
    they are known, so its reference is checked: at level 0 both kernels are within float
    rounding of it, at level 4 (int8 activations) both are off by the activations' rounding."""
    import json

    import onnx

    from specrt.engines.ort_products import one_node_session

    monkeypatch.syspath_prepend(str(BENCH))
    _four_bit_graph(tmp_path / "a8", level=4)
    dense = _four_bit_graph(tmp_path / "f32", level=0)
    node = onnx.load(str(tmp_path / "f32" / "model.onnx")).graph
    read = one_node_session(node.node[0], list(node.initializer), 64, 24, 0)
    assert np.array_equal(read.run(None, {"x": np.eye(64, dtype=np.float32)})[0], dense.astype(np.float32))
    out = tmp_path / "rk.json"
    argv = ["bench_row_kernels.py", str(tmp_path / "a8"), str(tmp_path / "f32"), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(BENCH / "bench_row_kernels.py"), run_name="__main__")
    a8, f32 = json.loads(out.read_text())["graphs"]
    assert (a8["accuracy_level"], f32["accuracy_level"], a8["products"]) == (4, 0, 1)
    assert all(1e-4 < a8["median"][k] < 0.1 for k in ("lone", "together"))
    assert all(f32["median"][k] < 1e-5 for k in ("lone", "together"))


def test_a_result_never_overwrites_an_earlier_one(tmp_path, monkeypatch):
    """Two runs on one day keep both files: the second is <name>-2.json."""
    monkeypatch.syspath_prepend(str(BENCH))
    import harness

    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    first = harness.write_results("engines-2026-12-07", {"run": 1})
    second = harness.write_results("engines-2026-12-07", {"run": 2})
    assert first.name == "engines-2026-12-07.json" and second.name == "engines-2026-12-07-2.json"
    assert '"run": 1' in first.read_text() and '"run": 2' in second.read_text()
    assert {p.name for p in tmp_path.iterdir()} == {first.name, second.name}  # no temporary left
