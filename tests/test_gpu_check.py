"""The GPU check script on the CPU: its CPU mode end to end (in an interpreter without the
packages a bare CUDA image lacks, as it runs there), and its checks made to fail.

CUDA graphs and host syncs are emulated here (test_torch_device.emulate_graphs: a 'graph'
re-runs the step on its captured buffers; a capture raises the warning torch's sync debug mode
raises on a GPU, and the sync audit counts the host reads a GPU step would sync on), so the
capture-count and sync checks are shown to fail on a planted recapture or host read; what they
measure on a real GPU only a GPU run tells. tests/test_gpu_check_plants.py plants the others.
"""

import dataclasses
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from test_torch_device import emulate_graphs

from specrt.runtime.backends import TorchBackend, torch_model
from specrt.runtime.session import StepSession

from conftest import random_model, tiny_hf_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_blocks  # noqa: E402
import gpu_check  # noqa: E402
import gpu_sweep  # noqa: E402

HF = tiny_hf_config(vocab_size=64)
# the emulated syncs warn outside the audited step too (captures during warm-up)
pytestmark = pytest.mark.filterwarnings("ignore:called a synchronizing CUDA operation")


@pytest.fixture(scope="module")
def model():
    return random_model(HF, seed=5, scale=0.3)


def prompts():
    return gpu_check.prompts(HF["vocab_size"])


def device_cache_backend(model):
    """The device-resident cache path on the CPU (torch tensors), eager."""
    backend = TorchBackend(model)
    backend.caps = dataclasses.replace(backend.caps, cache_device="cpu")
    return backend


def graph_backend(model, recapture: bool = False):
    """Emulated CUDA graphs whose capture syncs (torch.cuda.graph synchronizes); with recapture
    every replay captures again (the planted bug the checks must catch)."""
    backend = TorchBackend(model)
    emulate_graphs(backend)
    capture = backend._capture

    def syncing_capture(fn):
        warnings.warn(f"called a {gpu_blocks.SYNC_WARNING}")
        return capture(fn)

    backend._capture = syncing_capture
    if recapture:
        replay = backend._replay

        def forgetful(inputs, cache):
            backend._graphs.clear()
            return replay(inputs, cache)

        backend._replay = forgetful
    return backend


# Packages specrt or its tests use that the lent GPU machines' image lacks (it has torch, numpy,
# onnx, onnxruntime, tokenizers, transformers, safetensors, jinja2, click, tqdm, pytest; nothing
# can be installed there): an import of one on the check's way would end the one lent run.
DEVICE_LACKS = (
    "gguf",
    "llguidance",
    "fastapi",
    "uvicorn",
    "starlette",
    "pydantic",
    "prometheus_client",
    "tensorrt",
    "tensorrt_rtx",
    "polygraphy",
    "onnx_graphsurgeon",
    "openai",
    "ray",
)
# PathFinder blind to DEVICE_LACKS (the interpreter then finds them absent, as it would there)
HIDE = """
import importlib.machinery as m, runpy, sys
class Hide(m.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] in LACKS else super().find_spec(name, path, target)
sys.meta_path[:] = [Hide if f is m.PathFinder else f for f in sys.meta_path]
sys.argv = ARGV
run = runpy.run_path if ARGV[0].endswith(".py") else runpy.run_module
run(ARGV[0], run_name="__main__")
"""


def on_device_image(argv: list[str]) -> subprocess.CompletedProcess:
    """`argv` (a script and its arguments, or a module run as -m) in a fresh interpreter that
    cannot import DEVICE_LACKS."""
    code = f"LACKS, ARGV = {set(DEVICE_LACKS)!r}, {argv!r}\n" + HIDE
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_cpu_mode_runs_every_block_it_can(tmp_path):
    """Run as on the GPU machine: a fresh interpreter without the packages its image lacks."""
    run = on_device_image([gpu_check.__file__, "--device", "cpu", "--tiny", "--out", str(tmp_path)])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    verdicts = {name: b["verdict"] for name, b in result["blocks"].items()}
    assert verdicts == {
        "env": "INFO",
        "accuracy": "PASS",
        "exact": "PASS",  # on the CPU the PyTorch backend's own rule must be bitwise in every shape
        "bitwise": "PASS",
        "graphs": "SKIP",
        "syncs": "PASS",  # host reads counted
        "greedy": "PASS",
        "generation": "PASS",
        "sweep": "INFO",
        "decode": "INFO",
        "scale": "INFO",
        "tensorrt": "SKIP",
    }
    assert result["verdict"] == "PASS" and result["checked"] == ["torch eager"]
    assert set(result["not_checked"]) == {"tensorrt", "tensorrt-rtx"}
    assert len(result["commit"]) >= 40 and result["device"] == "cpu"  # a git checkout here
    cells = result["blocks"]["sweep"]["cells"]["eager"]
    assert len(cells) == 6 and all(c["wall_ms"] > 0 and c["gpu_ms"] is None for c in cells)
    # a one-position step is timed as the session runs it: padded to the floor's two positions
    assert {(c["positions"], c["computed"]) for c in cells} == {(1, 2), (3, 3), (9, 9)}
    counts = result["blocks"]["bitwise"]["runs"]["bfloat16 eager"]
    assert counts["suffix"]["counts"]["accepted"] > 0 and counts["ngram"]["counts"]["drafted"] > 0
    decode = result["blocks"]["decode"]["rows"]
    assert {(r["method"], r["batch"]) for r in decode} == {(m, b) for m in ("plain", "suffix", "ngram") for b in (1, 4)}
    assert all(r["equal"] for r in decode)
    assert result["blocks"]["scale"]["oracle"], "the accepted lengths measured on the CPU were not found"
    log = (tmp_path / "gpu-check.log").read_text()
    assert "[PASS] greedy" in log and "not checked: tensorrt" in log


def test_the_gpu_tests_load_without_what_the_device_image_lacks():
    """scripts/gpu_check.sh runs these tests there after the check."""
    run = on_device_image(["pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_torch_device.py"])
    assert run.returncode == 0 and "tests collected" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def test_sweep_gpu_time_falls_back_without_cuda(model):
    session = StepSession(device_cache_backend(model))
    cache = session.new_cache(2, 64)
    session.forward(cache, [[5, 6, 7], [8, 9, 10]])
    cell = gpu_sweep.time_cell(session, cache, 2, 3, repeats=2)
    assert cell["wall_ms"] > 0 and cell["gpu_ms"] is None and cell["host_ms"] is None
    assert cell["ran"] == "eager" and cache.lengths.tolist() == [3, 3]  # rolled back after each step
    lines = gpu_sweep.sweep_lines({"cells": {"eager": [{"mode": "eager", **cell}]}, "not_run": 4})
    assert "   -  " in lines[1] and "4 cells not run" in lines[-1]


def test_capture_counts_pass_and_fail_on_a_planted_recapture(model):
    ps = prompts()
    verdict, details = gpu_blocks.graphs_block(lambda: graph_backend(model), lambda: device_cache_backend(model), ps)
    assert verdict == "PASS", details["lines"]
    assert details["capture_counts"] == [0, 1, 2, 3]
    verdict, details = gpu_blocks.graphs_block(
        lambda: graph_backend(model, recapture=True), lambda: device_cache_backend(model), ps
    )
    assert verdict == "FAIL" and details["capture_counts"] != [0, 1, 2, 3]
    assert not details["checks"]["a second generation captures nothing"]


def test_sync_audit_passes_and_fails_on_a_planted_recapture(model):
    ps = prompts()
    verdict, details = gpu_blocks.syncs_block(lambda: graph_backend(model), ps)
    assert (verdict, details["syncs"]) == ("PASS", gpu_blocks.EXPECTED_SYNCS), details["lines"]
    verdict, details = gpu_blocks.syncs_block(lambda: graph_backend(model, recapture=True), ps)
    # every step captured again: one sync more in each kind of step
    assert verdict == "FAIL" and details["syncs"] == {k: v + 1 for k, v in gpu_blocks.EXPECTED_SYNCS.items()}


def test_sync_audit_fails_on_a_planted_host_read(model, monkeypatch):
    """A step that reads one value more to the host (an `.item()` in a sampled step) is caught,
    and so is a step that reads nothing (an audit that saw nothing)."""
    real = torch_model.device_logits

    def reading(logits, want_logits):
        if want_logits:
            logits.max().item()
        return real(logits, want_logits)

    monkeypatch.setattr(torch_model, "device_logits", reading)
    verdict, details = gpu_blocks.syncs_block(lambda: device_cache_backend(model), prompts())
    assert verdict == "FAIL" and details["syncs"]["sampled"] == 2 and details["syncs"]["decode"] == 1
    monkeypatch.setattr(gpu_blocks, "HOST_READS", ())
    verdict, details = gpu_blocks.syncs_block(lambda: device_cache_backend(model), prompts())
    assert verdict == "FAIL" and set(details["syncs"].values()) == {0}


def test_graphs_block_fails_where_nothing_is_captured_or_a_prefill_is(model, monkeypatch):
    ps = prompts()
    verdict, details = gpu_blocks.graphs_block(
        lambda: emulate_graphs_off(model), lambda: device_cache_backend(model), ps
    )
    assert verdict == "FAIL" and not details["checks"]["a first generation captures"]
    assert details["checks"]["a second generation captures nothing"]  # alone it passed a backend without graphs
    # a planted bug: prefill chunks captured like verification steps (the chunk of 48 tokens was
    # past the 32-position limit, so it was never captured whatever the rule)
    monkeypatch.setattr(torch_model, "graphable", lambda graphs, q, k, most: graphs and q <= most)
    verdict, details = gpu_blocks.graphs_block(lambda: graph_backend(model), lambda: device_cache_backend(model), ps)
    assert verdict == "FAIL" and details["capture_counts"][0] == 1


def emulate_graphs_off(model):
    """A backend that reports captures but never captures (cuda_graphs off)."""
    backend = device_cache_backend(model)
    backend.max_graph_q = 32
    return backend


def test_decode_timing_captures_nothing_and_a_recapture_is_seen(model):
    """The warm-up runs the timed generation twice (the second with the draft as the timed run
    finds it), so the timed run captures nothing; a backend that recaptures on every replay
    shows captures while timing."""
    ps = prompts()
    rows = gpu_sweep.decode_speed(lambda graphs: graph_backend(model), ["graphs"], ps, batches=(1, 2), tokens=24)
    assert [r["captured"] for r in rows] == [0] * 6 and all(r["equal"] for r in rows), rows
    rows = gpu_sweep.decode_speed(
        lambda graphs: graph_backend(model, recapture=True), ["graphs"], ps, batches=(1,), tokens=24
    )
    assert all(r["captured"] > 0 for r in rows), rows


def test_blocks_reruns_the_blocks_asked_for(tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--blocks", "greedy"]) == 0
    blocks = json.loads((tmp_path / "gpu-check.json").read_text())["blocks"]
    ran = {name for name, b in blocks.items() if b["verdict"] != "SKIP"}
    assert ran == {"env", "greedy"} and blocks["accuracy"]["reason"] == "not asked for (--blocks)"
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--blocks", "greedy,nope"])
    assert "unknown blocks ['nope']" in capsys.readouterr().err


def test_greedy_mismatch_names_its_index_and_the_reference_margin(model):
    reference = TorchBackend(model)
    prompt = prompts()[1][:20]
    session = StepSession(reference)
    cache = session.new_cache(1, 64)
    expected, ids = [], list(prompt)
    for _ in range(8):  # greedy by hand, with the logits kept
        logits = session.forward(cache, [ids], last_only=True).logits[0, 0].astype(np.float64)
        ids = [int(logits.argmax())]
        expected.append(ids[0])
    got = expected[:5] + [(expected[5] + 1) % HF["vocab_size"]] + expected[6:]
    row = gpu_blocks.mismatch(reference, prompt, got, expected, cutoff=1e-5)
    cache = session.new_cache(1, 64)
    at5 = np.sort(session.forward(cache, [prompt + expected[:5]], last_only=True).logits[0, 0].astype(np.float64))
    assert row["index"] == 5 and row["margin"] == pytest.approx(at5[-1] - at5[-2])
    assert row["verdict"] == ("near tie" if row["margin"] < 1e-5 else "FAIL")
    above = gpu_blocks.mismatch(reference, prompt, got, expected, cutoff=row["margin"] * 2)
    assert above["verdict"] == "near tie" and "cutoff" in above["note"]
    nan = gpu_blocks.mismatch(reference, prompt, got, expected, cutoff=gpu_blocks.near_tie(float("nan")))
    assert nan["verdict"] == "FAIL"  # a NaN measurement makes no mismatch a near tie
    assert gpu_blocks.mismatch(reference, prompt, expected, expected, cutoff=1.0)["verdict"] == "equal"
    # the cutoff follows the measured difference (GPU vs CPU ~1e-5), not a fixed 1e-3
    assert gpu_blocks.near_tie(1e-5) == 2e-5 and gpu_blocks.near_tie(0.0) == gpu_blocks.NEAR_TIE_FLOOR
    # a gap of whole units is a wrong kernel, not rounding: it excuses no mismatch
    assert np.isnan(gpu_blocks.near_tie(1.0)) and gpu_blocks.near_tie(gpu_blocks.NEAR_TIE_CAP) > 0


def test_a_failing_block_is_saved_and_a_sticky_cuda_error_skips_the_gpu_blocks(tmp_path, monkeypatch):
    report = gpu_check.Report(tmp_path, {"device": "cuda"})

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "cuda_broken", lambda: True)
    assert report.run("accuracy", broken)[0] == "FAIL"
    saved = json.loads((tmp_path / "gpu-check.json").read_text())  # written after the block
    assert "illegal memory access" in saved["blocks"]["accuracy"]["traceback"]
    assert report.run("graphs", lambda: ("PASS", {}))[0] == "SKIP"
    assert report.run("env", lambda: ("INFO", {}), gpu=False)[0] == "INFO"
    assert "Traceback" in (tmp_path / "gpu-check.log").read_text() and report.failed
