"""Is a lone row's 4-bit product less accurate than the same row's beside others?

    python bench/bench_row_kernels.py artifacts/SmolLM2-135M-Instruct/onnx-fused-gguf-a8

Where a build's probe finds that a one-position step moves the logits (on an AMD EPYC, the
engines whose 4-bit products take int8 activations: `gguf-a8`, `int4-a8`), the engine keeps a
floor of two positions per step. This asks whether the floor also changes accuracy: each
MatMulNBits product of the graph, run alone as a one-node graph on the CPU that runs this, is
given rows of random activations (standard normal, a few channels scaled 20x as real
activations have outliers) one at a time and all together, and both results are set against
the same product computed in float64 from the same dequantized weights (read exactly from the
node at accuracy level 0, which dequantizes to float32: its product with the identity). Prints,
per graph, the median over products of the relative RMS error of each kernel and of their
difference; writes JSON to bench/results/.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np

from harness import bench_arguments, envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def relative_rms(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(((a - ref) ** 2).mean() / (ref**2).mean()))


def measure_graph(path: Path, rows: int, limit: int | None) -> dict:
    """Each 4-bit product's errors, lone row and rows together, against the float64 product."""
    import onnx

    from specrt.engines.ort_products import one_node_session, weight_products

    model = onnx.load(str(path))
    rng = np.random.default_rng(0)
    products, level = [], None
    for node, weights, K, N in weight_products(model, ("MatMulNBits",)):
        level = next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)
        engine = one_node_session(node, weights, K, N, level)
        # the dequantized weights, exactly: level 0 dequantizes to float32 and each output of
        # the identity's product is one weight times 1 plus zeros
        dense = one_node_session(node, weights, K, N, 0).run(None, {"x": np.eye(K, dtype=np.float32)})[0]
        x = rng.standard_normal((rows, K)).astype(np.float32)
        x[:, rng.integers(0, K, 4)] *= 20
        ref = x.astype(np.float64) @ dense.astype(np.float64)
        together = engine.run(None, {"x": x})[0]
        lone = np.concatenate([engine.run(None, {"x": x[i : i + 1]})[0] for i in range(rows)])
        products.append(
            {
                "node": node.name,
                "lone": relative_rms(lone, ref),
                "together": relative_rms(together, ref),
                "lone_vs_together": relative_rms(lone, together.astype(np.float64)),
                "bitwise": bool(np.array_equal(lone, together)),
            }
        )
        if limit and len(products) >= limit:
            break
    if not products:
        return {"graph": str(path), "products": 0}
    med = {k: statistics.median(p[k] for p in products) for k in ("lone", "together", "lone_vs_together")}
    lone_worse = sum(p["lone"] > p["together"] for p in products)
    return {
        "graph": str(path),
        "accuracy_level": level,
        "products": len(products),
        "bitwise_products": sum(p["bitwise"] for p in products),
        "lone_worse": lone_worse,
        "median": med,
        "per_product": products,
    }


def main() -> None:
    ap = bench_arguments(__doc__, artifacts=False)
    ap.add_argument("graphs", type=Path, nargs="+", help="fused 4-bit graph folders (each with model.onnx).")
    ap.add_argument("--rows", type=int, default=4, help="Rows of activations per product (default 4).")
    ap.add_argument("--limit", type=int, default=None, help="Products per graph (default: all).")
    args = ap.parse_args()
    missing = [str(g) for g in args.graphs if not (g / "model.onnx").is_file()]
    if missing:
        sys.exit(
            f"no model.onnx under {', '.join(missing)}: give a graph folder (artifacts/<model>/onnx-fused-gguf-a8)"
        )
    if args.rows < 2:
        sys.exit(f"--rows {args.rows}: give at least 2 (the rows are compared alone and together)")
    results = []
    head = f"{'graph':<48} {'level':>5} {'products':>8} {'bitwise':>7} {'lone':>9} {'together':>9} "
    head += f"{'apart':>9} {'lone worse':>10}"
    print(head)
    print("-" * len(head))
    for g in args.graphs:
        r = measure_graph(g / "model.onnx", args.rows, args.limit)
        if not r["products"]:
            print(f"{str(g)[-48:]:<48} no 4-bit product (MatMulNBits) in this graph")
            continue
        m = r["median"]
        print(
            f"{str(g)[-48:]:<48} {r['accuracy_level']:>5} {r['products']:>8} {r['bitwise_products']:>7} "
            f"{m['lone']:>9.2e} {m['together']:>9.2e} {m['lone_vs_together']:>9.2e} {r['lone_worse']:>10}"
        )
        results.append(r)
    print("\nlone, together: relative RMS error against the float64 product (median over products);")
    print("apart: lone against together; lone worse: products where the lone row's error is the larger")
    from specrt.benchmark import write_result_json

    result = {**envelope("onnxruntime", "onnx"), "rows": args.rows, "graphs": results}
    print(f"wrote {write_result_json(result, args.out, 'row-kernels')}")


if __name__ == "__main__":
    main()
