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
