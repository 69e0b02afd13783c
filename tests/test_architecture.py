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
    assert "3 kept, 0 broken" in r.stdout  # the two layer contracts and the torch rule


@pytest.mark.parametrize(
    "module, upward",
    [
        ("engines/ort.py", "from specrt.runtime.generator import Generator"),  # the cycle this check was made for
        ("runtime/backends/base.py", "from specrt.runtime.speculative import SpeculativeDecoder"),
        ("schema/config.py", "    from specrt.engines import build  # inside a function"),
        ("schema/head_io.py", "import torch"),  # the torch rule: what the runtime reads stays torch-free
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


def test_the_runtime_and_its_drafts_load_without_torch():
    """Importing the draft methods, the generation loops, the server's service and what reads
    engines and heads loads no torch (their I/O lives in step_io, graph_files and head_io): a
    fresh interpreter imports them and looks."""
    import subprocess
    import sys

    modules = [
        "specrt.runtime.drafts", "specrt.runtime.batching", "specrt.runtime.runner", "specrt.server.service",
        "specrt.engines.ort", "specrt.engines.head", "specrt.inspection",
    ]  # fmt: skip
    code = f"import sys\nfor m in {modules!r}:\n    __import__(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_opening_an_ort_engine_loads_no_torch(tiny_artifacts):
    """Opening the ORT engine and generating with it (Generator.from_engine: the manifest, the
    checkpoint's fingerprint, the session) loads no torch: it was imported for the fingerprint."""
    import subprocess
    import sys

    from specrt.layout import ArtifactLayout

    engine = ArtifactLayout(tiny_artifacts).ort_engine()
    code = (
        "import sys\nfrom specrt.runtime.generator import Generator\n"
        f"gen = Generator.from_engine({str(engine)!r})\n"
        "assert gen.generate_ids([[5, 6, 7]], 3)[0].token_ids\nprint('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_import_graph_has_no_circle():
    """No module imports one that imports it back, directly or through others (the static
    conveniences' mixin made the last circle: runtime/generates.py <-> runtime/speculative.py)."""
    grimp = pytest.importorskip("grimp", reason="import-linter's graph library (the test extra)")
    graph = grimp.build_graph("specrt", cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    done, on_path, circles = set(), [], []

    def visit(m):  # depth first; a module met again on the current path closes a circle
        if m in on_path:
            circles.append(on_path[on_path.index(m) :] + [m])
            return
        if m in done:
            return
        on_path.append(m)
        for n in sorted(edges.get(m, ())):
            visit(n)
        on_path.pop()
        done.add(m)

    for m in sorted(edges):
        visit(m)
    assert not circles, " -> ".join(circles[0])
