"""Every script under bench/ answers --help: its imports and arguments hold without the peers,
models or artifacts it measures (a broken benchmark is found here, not in a long run)."""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
from pathlib import Path

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
