"""The layering stays: export -> engines -> runtime -> server/cli (contracts in pyproject.toml,
checked by import-linter; imports inside functions count too)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"

pytestmark = pytest.mark.skipif(
    not LINT.exists(), reason="import-linter is not installed (the test extra; make setup installs it)"
)


def lint(package_parent: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(package_parent), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        capture_output=True,
        text=True,
        cwd=package_parent,
        env=env,
        timeout=120,
    )


def test_layers_are_kept():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "2 kept, 0 broken" in r.stdout


@pytest.mark.parametrize(
    "module, upward",
    [
        ("engines/ort.py", "from specrt.runtime.generator import Generator"),  # the cycle this check was made for
        ("runtime/backends/base.py", "from specrt.runtime.speculative import SpeculativeDecoder"),
        ("export/config.py", "    from specrt.engines import build  # inside a function"),
    ],
)
def test_an_upward_import_breaks_the_check(tmp_path, module, upward):
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "specrt", copy / "specrt", ignore=shutil.ignore_patterns("__pycache__"))
    path = copy / "specrt" / module
    text = path.read_text()
    if upward.startswith("    "):
        text += f"\n\ndef _late():\n{upward}\n"
    else:
        text += f"\n{upward}  # noqa\n"
    path.write_text(text)
    r = lint(copy)
    assert r.returncode != 0 and "BROKEN" in r.stdout, r.stdout[-2000:]
