"""Each of the GPU check's deciding blocks, run in its CPU mode with a planted failure: it must
be caught. The plants stand for what goes wrong on a GPU: TF32 products (accuracy), a kernel
that changes with the step's shape or the batch (exact, bitwise, generation, decode), a prefix
cache that serves other numbers, drafts that are never accepted (a check of rejection alone),
a timing that times another step than the runtime's, speed blocks that measured nothing.
"""

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specrt.runtime.backends import TorchBackend
from specrt.runtime.session import StepSession

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gpu_bitwise  # noqa: E402
import gpu_blocks  # noqa: E402
import gpu_check  # noqa: E402
import gpu_exact  # noqa: E402
import gpu_scale  # noqa: E402
import gpu_sweep  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return gpu_check.load(tiny=True)[0]


@pytest.fixture(scope="module")
def ps(model):
    return gpu_check.prompts(model.cfg.vocab_size)


def device_backend(model, dtype=torch.float32):
    backend = TorchBackend(gpu_exact.device_model(model, dtype))
    backend.caps = dataclasses.replace(backend.caps, cache_device="cpu")
    return backend


def shape_dependent(backend, when):
    """The planted kernel: the logits after the first position of a step move (the first token
    by +100: every greedy answer changes) where `when(input_ids)` holds."""
    enqueue = backend.enqueue

    def planted(inputs, cache):
        out = enqueue(inputs, cache)
        if when(inputs[0]):
            out[0][:, 1:, 3] += 100.0
        return out

    backend.enqueue = planted
    return backend


def multi_position(ids):
    return ids.shape[1] > 2  # a verification step (plain decoding's steps have the floor's 2)


def test_accuracy_fails_a_tf32_computation(model, ps):
    """TF32 rounds a product's inputs to 10 bits of mantissa: emulated by rounding the weights so;
    the old fixed tolerance (2e-2) passed it, the measured one (8x the CPU's own) does not."""
    tf32 = gpu_exact.device_model(model, torch.float32)
    with torch.no_grad():
        for p in tf32.parameters():
            p.view(torch.int32).add_(1 << 12).bitwise_and_(~((1 << 13) - 1))
    refs = {"float32": TorchBackend(model)}
    exact = gpu_blocks.float64_reference(model)
    verdict, details = gpu_blocks.accuracy_block({"float32": (device_backend(model), "float32")}, refs, exact, ps)
    assert verdict == "PASS", details["lines"]
    verdict, details = gpu_blocks.accuracy_block({"tf32": (TorchBackend(tf32), "float32")}, refs, exact, ps)
    worst = max(r["max_abs_diff"] for r in details["rows"]["tf32"])
    assert verdict == "FAIL" and details["tolerance"]["float32"] < worst < 2e-2


def test_bitwise_block_catches_a_shape_a_batch_and_a_prefix_plant(model, ps, monkeypatch):
    def run(make):
        return gpu_bitwise.bitwise_block(make, ps, "plant", batch=4, tokens=16)

    verdict, details = run(lambda: shape_dependent(device_backend(model, torch.bfloat16), multi_position))
    # (the n-gram draft finds one token at a time here: its steps have the plain step's shape)
    assert verdict == "FAIL" and not details["checks"]["suffix == plain alone, logits included"]
    assert details["checks"]["batched (4 rows) == plain alone, logits included"]
    verdict, details = run(lambda: shape_dependent(device_backend(model), lambda ids: ids.shape[0] > 1))
    assert verdict == "FAIL" and not details["checks"]["batched (4 rows) == plain alone, logits included"]
    # a prefix cache whose blocks come back moved a little: not what this prompt's prefill computes
    real = gpu_bitwise.PrefixCache.lookup

    def moved(self, prompt, cache, row):
        covered = real(self, prompt, cache, row)
        cache.keys[:, row, :, :covered] += 1e-3
        return covered

    monkeypatch.setattr(gpu_bitwise.PrefixCache, "lookup", moved)
    verdict, details = run(lambda: device_backend(model))
    failed = {k for k, ok in details["checks"].items() if not ok}
    assert verdict == "FAIL" and failed == {"prefix-cached == plain alone, logits included"}


def test_bitwise_block_fails_when_no_draft_is_accepted(model, ps, monkeypatch):
    """Speculative == plain at zero accepted tokens tests rejection only: the block says FAIL."""
    real = gpu_bitwise.make_policy
    monkeypatch.setattr(gpu_bitwise, "make_policy", lambda n: real(0))  # drafts nothing
    verdict, details = gpu_bitwise.bitwise_block(lambda: device_backend(model), ps, "plant", batch=4, tokens=16)
    failed = {k for k, ok in details["checks"].items() if not ok}
    assert verdict == "FAIL" and failed == {
        "suffix: drafts accepted (else only rejection was tested)",
        "ngram: drafts accepted (else only rejection was tested)",
    }


def test_exact_generation_and_decode_catch_a_shape_dependent_kernel(model, ps):
    def planted(m=model, graphs=False):
        return shape_dependent(device_backend(m), multi_position)

    verdict, details = gpu_exact.exact_block(model, lambda m, g: planted(m), "cpu", ("eager",))
    assert verdict == "FAIL", details["lines"]
    verdict, details = gpu_blocks.generation_block(planted, ps)
    assert verdict == "FAIL" and not details["checks"]["greedy speculative == plain (or a near tie)"]
    rows = gpu_sweep.decode_speed(lambda graphs: planted(), ["eager"], ps, batches=(1,), tokens=16)
    assert [(r["method"], r["equal"]) for r in rows][:2] == [("plain", True), ("suffix", False)]


def test_timed_step_is_the_step_the_session_runs(model):
    """The GPU-time column times the inputs `forward` hands the backend, the floor's padding
    included (it timed a one-position step the runtime never runs)."""
    backend = device_backend(model)
    seen = []
    step = backend.step
    backend.step = lambda ids, *a, **kw: seen.append(ids.shape) or step(ids, *a, **kw)
    session = StepSession(backend)
    cache = session.new_cache(2, 64)
    session.forward(cache, [[5, 6, 7], [8, 9, 10]])
    for q in (1, 2, 5):
        tokens = [[11] * q, [12] * q]
        seen.clear()
        session.forward(cache, tokens, want_logits=False)
        cache.rollback(np.array([3, 3]))
        assert gpu_sweep.timed_inputs(session, cache, tokens)[0].shape == seen[0] == (2, max(q, session.floor))


def test_speed_blocks_fail_when_they_measured_nothing(model, ps, tmp_path, monkeypatch):
    result = gpu_sweep.sweep(lambda graphs: device_backend(model), ["eager"], (1,), (1, 3), deadline=0.0)
    assert gpu_check.measured(result) == "FAIL" and result["not_run"] == 2
    monkeypatch.setattr(gpu_scale, "RESULTS", tmp_path)  # no accepted lengths to price
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path / "out"), "--blocks", "scale"]) == 1
    scale = json.loads((tmp_path / "out" / "gpu-check.json").read_text())["blocks"]["scale"]
    assert scale["verdict"] == "FAIL" and scale["cells"]["eager"]


def test_oracle_prices_accepted_lengths_from_the_step_times():
    """tokens a step x T(B, 1) / T(B, 1 + drafted), linear between measured positions; the cost
    model's prediction beside it."""
    cells = [{"batch": 1, "positions": q, "wall_ms": ms} for q, ms in ((1, 10.0), (3, 12.0), (5, 16.0))]
    rows = gpu_scale.oracle(cells, [{"source": "x", "tokens_per_step": 2.0, "drafted": 3.0}], floor=2)
    assert rows[0]["measured"] == pytest.approx(2.0 * 10.0 / 14.0) and rows[0]["predicted"] > 1
    found = gpu_scale.accepted_lengths()
    assert found and all(r["drafted"] > 0 and r["tokens_per_step"] >= 1 for r in found)
