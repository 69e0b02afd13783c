"""A check of a number against a tolerance fails on NaN: `if err > tol: fail` lets NaN through
(every comparison with NaN is False), so the package and its scripts write the failure test as
`not err <= tol` (or the pass test as `err < tol`). Read from the source, so a new check of the
old kind fails here."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("tol", "limit_abs", "max_abs", "max_err", "cutoff", "threshold")


def _names(node) -> str:
    return " ".join(
        n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else str(n.value)
        for n in ast.walk(node)
        if isinstance(n, (ast.Name, ast.Attribute)) or (isinstance(n, ast.Constant) and isinstance(n.value, str))
    ).lower()


def nan_blind_checks(source: str) -> list[int]:
    """Lines where an `if` or `assert` tests `x > bound` / `x >= bound` (a failure test NaN passes
    as a success) with a tolerance named on the right."""
    found = []
    for node in ast.walk(ast.parse(source)):
        test = node.test if isinstance(node, (ast.If, ast.Assert, ast.IfExp, ast.While)) else None
        for cmp in [] if test is None else [n for n in ast.walk(test) if isinstance(n, ast.Compare)]:
            for op, right in zip(cmp.ops, cmp.comparators):
                if isinstance(op, (ast.Gt, ast.GtE)) and any(w in _names(right) for w in WORDS):
                    if not isinstance(node, ast.Assert):  # `assert x > tol` fails on NaN: fine
                        found.append(cmp.lineno)
    return found


def test_no_tolerance_check_passes_nan():
    bad = []
    for path in sorted([*(ROOT / "specrt").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]):
        bad += [f"{path.relative_to(ROOT)}:{line}" for line in nan_blind_checks(path.read_text())]
    assert not bad, f"write these failure tests as `not x <= tol` (NaN must fail): {bad}"


def test_the_check_finds_the_old_parity_test():
    old = 'if parity["logits_max_abs"] > PARITY_TOLERANCE * max(1.0, scale):\n    raise Bad()\n'
    assert nan_blind_checks(old) == [1]
    assert nan_blind_checks(old.replace("if parity", "if not parity").replace(" > ", " <= ")) == []
