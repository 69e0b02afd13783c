"""The code stays formatted and linted (ruff, configured in pyproject.toml: 120 columns)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).parent / "ruff"

pytestmark = pytest.mark.skipif(
    not RUFF.exists(), reason="ruff is not installed (the test extra; make setup installs it)"
)


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    r = subprocess.run([str(RUFF), *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (
        f"run `ruff {' '.join(command)} .` (or `ruff format .`):\n{r.stdout[-3000:]}{r.stderr[-1000:]}"
    )
