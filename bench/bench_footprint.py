"""Footprint of ORT engines: disk, resident memory after loading, and step latency, side by side.

    python bench/bench_footprint.py A_ARTIFACTS B_ARTIFACTS [--names a,b] [--repeats 5]

For each artifact directory (from `specrt build-engines`): the size of onnx/ and engines/ort-cpu/,
the TensorRT-RTX engine when built, the resident memory a fresh process gains by loading the
engine and after running every vocabulary id once (each in a subprocess, so the runs do not share
memory), and the median latency of a decode step (Q = 1 at past 300) and a
259-token prefill, measured alternately between the engines in one process. Also checks that both
produce the same greedy tokens. Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RSS_SNIPPET = """
import sys, gc
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'):
            return int(line.split()[1]) / 1024
from specrt.runtime.generator import Generator
import onnxruntime  # noqa: F401  (its import is not part of the engine's footprint)
gc.collect(); before = rss()
gen = Generator.from_engine(sys.argv[1])
gc.collect(); loaded = rss() - before
V = gen.config.vocab_size
for start in range(0, V, 512):  # every vocabulary id once: all embedding rows touched
    gen.session.forward(gen.session.new_cache(1, 512), [list(range(start, min(V, start + 512)))], last_only=True)
gc.collect(); print(loaded, rss() - before)
"""


def du_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifacts", nargs=2, type=Path)
    ap.add_argument("--names", default="a,b")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    names = args.names.split(",")

    import numpy as np

    from specrt.benchmark import write_result_json
    from specrt.layout import ArtifactLayout
    from specrt.runtime.generator import Generator

    rows = {}
    gens = {}
    for name, art in zip(names, args.artifacts):
        layout = ArtifactLayout(art)
        engine = layout.ort_engine()
        rss = [
            [
                float(v)
                for v in subprocess.run(
                    [sys.executable, "-c", RSS_SNIPPET, str(engine)],
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=ROOT,
                ).stdout.split()
            ]
            for _ in range(2)
        ]
        onnx_manifest = json.loads((layout.onnx / "manifest.json").read_text())
        rtx = layout.trt_engine("tensorrt-rtx")
        rows[name] = {
            "artifacts": str(art),
            "onnx_mib": round(du_mib(layout.onnx), 1),
            "ort_engine_mib": round(du_mib(engine), 1),
            "trt_rtx_engine_mib": round(du_mib(rtx), 1) if rtx.is_dir() else None,
            "load_rss_mib": round(statistics.median(r[0] for r in rss), 1),
            "all_rows_rss_mib": round(statistics.median(r[1] for r in rss), 1),
            "tied_embedding_shared": onnx_manifest.get("tied_embedding_shared", False),
            "decode_ms": [],
            "prefill_ms": [],
        }
        gens[name] = Generator.from_engine(engine)

    rng = np.random.default_rng(0)
    vocab = next(iter(gens.values())).config.vocab_size
    prompt = rng.integers(3, vocab, 300).tolist()
    for _ in range(args.repeats):
        for name, gen in gens.items():  # alternate, so drift in the machine's speed hits both
            cache = gen.session.new_cache(1, 320)
            t = time.perf_counter()
            gen.session.prefill(cache, [prompt[:259]])
            rows[name]["prefill_ms"].append((time.perf_counter() - t) * 1e3)
            gen.session.forward(cache, [prompt[259:300]])
            times = []
            for i in range(12):
                cache.rollback(np.array([300]))
                t = time.perf_counter()
                gen.session.forward(cache, [[prompt[i]]])
                times.append((time.perf_counter() - t) * 1e3)
            rows[name]["decode_ms"].append(statistics.median(times[2:]))
    tokens = {
        name: [r.token_ids for r in gen.generate_ids([prompt[:40], prompt[100:130]], 32)] for name, gen in gens.items()
    }
    same = len({json.dumps(t) for t in tokens.values()}) == 1
    for row in rows.values():
        row["decode_ms"] = round(statistics.median(row["decode_ms"]), 2)
        row["prefill_ms"] = round(statistics.median(row["prefill_ms"]), 1)

    print(
        f"{'engine':<12}{'onnx MiB':>10}{'ort MiB':>9}{'trt-rtx MiB':>13}{'RSS loaded':>12}{'RSS all rows':>14}{'decode ms':>11}{'prefill 259 ms':>16}  tied shared"  # noqa: E501 (a table row)
    )
    for name, r in rows.items():
        print(
            f"{name:<12}{r['onnx_mib']:>10}{r['ort_engine_mib']:>9}{str(r['trt_rtx_engine_mib']):>13}{r['load_rss_mib']:>12}{r['all_rows_rss_mib']:>14}"  # noqa: E501 (a table row)
            f"{r['decode_ms']:>11}{r['prefill_ms']:>16}  {r['tied_embedding_shared']}"
        )
    print(f"greedy tokens equal: {same}")
    result = {
        **envelope("onnxruntime", "onnx", "torch", "numpy"),
        "repeats": args.repeats,
        "rows": rows,
        "greedy_equal": same,
    }
    print(f"wrote {write_result_json(result, args.out, 'footprint')}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
