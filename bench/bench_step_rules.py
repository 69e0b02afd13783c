"""What each ONNX Runtime engine's build found about its own step shapes, per engine and CPU.

    python bench/bench_step_rules.py artifacts/SmolLM2-135M-Instruct artifacts/gemma-3-270m

Every ORT engine under each artifact directory records in its manifest what its build probed on
the CPU it was built on: the step floor (1 where a one-position step gives a position the same
bits as a longer step, else 2), the step cuts (positions no step may span: where the attention
adds in another order once a step ends past them), which step shapes agree bitwise, how far a
one-position step's logits move from a longer step's (the cost of running without the floor)
and the step times by positions. Nothing is measured here: this collects those records into
one table and one JSON, so that builds on different CPUs (an Intel Xeon, an AMD EPYC) can be
set side by side. Prints a table; writes JSON to bench/results/.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness import bench_arguments, envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def engine_rule(manifest: dict) -> dict:
    """One engine's probed rule, from its manifest (kind ort-engine, fused or portable graph)."""
    from specrt.engines.ort_measure import floor_of

    inv = manifest.get("batch_invariance") or {}
    cuts = manifest.get("step_cuts") or {}
    ms = manifest.get("step_ms") or {}
    return {
        "scheme": (manifest.get("quantization") or {}).get("scheme") or manifest.get("precision") or "float32",
        "graph": manifest.get("graph_flavour"),
        "host_cpu": manifest.get("host_cpu"),
        "onnxruntime": (manifest.get("versions") or {}).get("onnxruntime"),
        "built": manifest.get("created"),
        "floor": floor_of(inv) if inv.get("bitwise") else None,
        "bitwise": inv.get("bitwise"),
        # how far a one-position step's logits move from a longer step's, relative to their range
        "one_position_relative": inv.get("relative"),
        "one_position_argmax_agreement": inv.get("argmax_agreement"),
        "cuts": cuts.get("cuts"),
        "period": cuts.get("period"),
        "confirmed_at": cuts.get("confirmed_at") if cuts.get("confirmed") else None,
        "probed_to": cuts.get("probed_to"),
        "step_ms": ms,
    }


def collect(artifacts: Path) -> list[dict]:
    """Every ORT engine's rule under one build-engines output, in name order."""
    rows = []
    for path in sorted((artifacts / "engines").glob("*/manifest.json")):
        manifest = json.loads(path.read_text())
        if manifest.get("kind") != "ort-engine":
            continue
        rows.append({"model": artifacts.name, "engine": path.parent.name, **engine_rule(manifest)})
    return rows


def cuts_text(row: dict) -> str:
    from specrt.inspection import step_cuts_text

    if row["cuts"] is None:
        return "not probed"
    text = step_cuts_text(row)
    return text + (f" (confirmed at {row['confirmed_at']})" if row["confirmed_at"] else "")


def print_table(rows: list[dict]) -> None:
    head = f"{'model':<24} {'engine':<9} {'cpu':<28} {'floor':>5} {'1-pos moves':>11} {'ms 1/2':>11}  step cuts"
    print(head)
    print("-" * len(head))
    for r in rows:
        moved = "-" if r["one_position_relative"] is None else f"{r['one_position_relative']:.1e}"
        ms = r["step_ms"]
        times = f"{ms.get('1', float('nan')):.1f}/{ms.get('2', float('nan')):.1f}"
        floor = "?" if r["floor"] is None else str(r["floor"])
        cpu = (r["host_cpu"] or "?")[:28]
        print(f"{r['model'][:24]:<24} {r['scheme']:<9} {cpu:<28} {floor:>5} {moved:>11} {times:>11}  {cuts_text(r)}")


def main() -> None:
    ap = bench_arguments(__doc__, artifacts=False)
    ap.add_argument("artifacts", type=Path, nargs="+", help="build-engines outputs (each with engines/).")
    ap.add_argument("--note", default="", help="What else ran while the engines were built (their step times).")
    args = ap.parse_args()
    missing = [str(a) for a in args.artifacts if not (a / "engines").is_dir()]
    if missing:
        sys.exit(f"no engines/ under {', '.join(missing)}: build them first (specrt build-engines --out ...)")
    rows = [row for a in args.artifacts for row in collect(a)]
    if not rows:
        sys.exit("no ONNX Runtime engine found under the artifact directories given: nothing to collect")
    print_table(rows)
    from specrt.benchmark import write_result_json

    result = {
        **envelope("onnxruntime", **({"note": args.note} if args.note else {})),
        "artifacts": [str(a) for a in args.artifacts],
        "rows": rows,
    }
    print(f"wrote {write_result_json(result, args.out, 'step-rules')}")


if __name__ == "__main__":
    main()
