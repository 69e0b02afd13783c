"""The speculation policy on a virtual clock: which draft and N choices pay, free of machine noise.

    python bench/bench_policy.py [--artifacts artifacts/SmolLM2-135M-Instruct] [--engines f32,gguf,split]
                                 [--methods ngram,suffix,auto] [--ablate calibration,...] [--noise 0.05]

This machine's speed drifts by up to 50 % over minutes, so end-to-end runs (specrt bench) cannot
tell a policy change worth 3 % from noise. Here every generation runs for real on the float32
engine (greedy: the tokens, drafts and verdicts are the real ones, and every output is checked
against plain decoding), but the clock the cost model reads is virtual: a target step of P
positions over B rows takes what the engine's build measured for P / B positions (its manifest's
step_ms, interpolated; `split`: one position on the gguf engine, more on float32), and the
runtime's own work per step (the policy's plan, the lookups) what a calibration pass measured
on this machine, as constants (the plan's charged on the steps where it read the estimates).
So a run is a function of the policy alone, and two policies compare exactly. `--noise` adds a
seeded disturbance (each step x lognormal(0, noise), and 3 % of steps 2-6x slower: what the cost
model's robust fit is for); every variant sees the same sequence.

The figure per prompt is the decode speedup over plain decoding on the same virtual clock
(prefill excluded: it is the same for all). Ablations (--ablate) switch one heuristic of the
cost model off, to show what it buys:
    calibration   predictions not scaled by realized / predicted extra tokens
    spike         no spike filter for less-observed step sizes (estimators.SPIKE)
    trust         a size's time is its median from the first observation (estimators.TRUST = 1)
    probes        no probes while speculation is off
    priors        the generic alpha, beta priors instead of the engine's measured step costs
Prints a table per engine (rows: prompts; columns: variants; last rows: the minimum and the
geometric mean) and writes JSON (date, versions, machine) to bench/results/.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from harness import bench_arguments, envelope

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ABLATIONS = ("calibration", "spike", "trust", "probes", "priors")


def engine_costs(artifacts: Path) -> dict[str, dict[int, float]]:
    """ms per step by positions (batch 1) of each engine, from the build's manifests."""
    from specrt.layout import ArtifactLayout

    layout = ArtifactLayout(artifacts)

    def read(engine: Path) -> dict[int, float] | None:
        m = json.loads((engine / "manifest.json").read_text()) if (engine / "manifest.json").is_file() else {}
        return {int(q): float(v) for q, v in m["step_ms"].items()} if "step_ms" in m else None

    f32, gguf = read(layout.ort_engine("cpu")), read(layout.ort_engine("cpu", "gguf"))
    if f32 is None:
        raise SystemExit(f"{layout.ort_engine('cpu')} has no measured step costs: run make build-engines")
    out = {"f32": f32}
    if gguf is not None:
        out["gguf"] = gguf
        out["split"] = {1: gguf[1], **{q: t for q, t in f32.items() if q > 1}}
    return out


class VirtualClock:
    """Step times from a cost curve, runtime work as constants, optional seeded noise."""

    def __init__(self, curve: dict[int, float], plan_s: float, draft_s: float, noise: float, seed: int):
        self.qs = np.array(sorted(curve), np.float64)
        self.ms = np.array([curve[q] for q in sorted(curve)])
        self.plan_s, self.draft_s, self.noise = plan_s, draft_s, noise
        self.rng = np.random.default_rng(seed)
        self.total = 0.0

    def step(self, positions: int, batch: int) -> float:
        t = float(np.interp(positions / batch, self.qs, self.ms)) * 1e-3
        if self.noise:
            t *= float(self.rng.lognormal(0.0, self.noise))
            if self.rng.random() < 0.03:
                t *= float(self.rng.uniform(2, 6))
        return t


def patched(ablations: set[str]):
    """Switch the named heuristics off (this process only); returns a function that restores them."""
    from specrt.runtime import estimators, policy

    saved = {
        "SPIKE": estimators.SPIKE,
        "TRUST": estimators.TRUST,
        "calibration": policy.CostModel.calibration,
    }
    if "spike" in ablations:
        estimators.SPIKE = float("inf")
    if "trust" in ablations:
        estimators.TRUST = 1
    if "calibration" in ablations:
        policy.CostModel.calibration = lambda self: 1.0

    def restore():
        estimators.SPIKE, estimators.TRUST = saved["SPIKE"], saved["TRUST"]
        policy.CostModel.calibration = saved["calibration"]

    return restore


def run_virtual(gen, method: str, ids: list[int], tokens: int, clock: VirtualClock, ablate=()):
    """One greedy generation with the cost model on `clock`; (result, virtual decode seconds)."""
    from specrt.runtime.drafts import make_proposer
    from specrt.runtime.policy import CostModel
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy

    decoder = SpeculativeDecoder(gen, make_proposer(method), make_policy("auto"))
    if "probes" in ablate:
        decoder.policy.probe_every = 10**9
    if "priors" in ablate:  # the generic priors
        per_token = decoder.proposer.cost_per_token
        decoder.new_cost_model = lambda: CostModel(decoder.policy.max_draft, draft_per_token=per_token)
    real_observe = decoder.observe

    def observe(state, r):
        r.verify_seconds = clock.step(r.positions, len(r.rows))
        drafted = any(n > 0 for n in r.asked.values())
        r.draft_seconds = (clock.plan_s if planned[0] else 0.0) + (clock.draft_s if drafted else 0.0)
        planned[0] = False
        clock.total += r.verify_seconds + r.draft_seconds
        real_observe(state, r)

    decoder.observe = observe
    planned = [False]  # whether this step's plan read the estimates (a policy may skip it while off)
    make_model = decoder.new_cost_model

    def new_cost_model():
        model = make_model()
        speedups = model.speedups

        def counted(*a, **k):
            planned[0] = True
            return speedups(*a, **k)

        model.speedups = counted
        return model

    decoder.new_cost_model = new_cost_model
    clock.total = 0.0
    result = decoder.generate_ids([ids], tokens)[0]
    return result, clock.total


def calibrate(gen, methods, prompts, tokens: int) -> dict[str, tuple[float, float]]:
    """(plan seconds per step, lookup seconds per drafting step) per method, measured here: the
    median of the real runtime work between steps (the plan, and the proposer's call)."""
    from specrt.runtime.drafts import make_proposer
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy

    out = {}
    for method in methods:
        plans, drafts = [], []
        decoder = SpeculativeDecoder(gen, make_proposer(method), make_policy("auto"))
        plan, propose = decoder.policy.plan, decoder.propose

        def timed_plan(model, rows, _plan=plan):
            read, speedups = [], model.speedups
            model.speedups = lambda *a, **k: read.append(1) or speedups(*a, **k)
            t = time.perf_counter()
            out_ = _plan(model, rows)
            if read:  # a plan that read the estimates (a policy may skip it while off)
                plans.append(time.perf_counter() - t)
            model.speedups = speedups
            return out_

        def timed_propose(state, rows, p, _propose=propose):
            t = time.perf_counter()
            out_ = _propose(state, rows, p)
            if any(n > 0 for n in p.values()):
                drafts.append(time.perf_counter() - t)
            return out_

        decoder.policy.plan, decoder.propose = timed_plan, timed_propose
        for ids in prompts:
            decoder.generate_ids([ids], tokens)
        out[method] = (statistics.median(plans), statistics.median(drafts) if drafts else 0.0)
    return out


def main() -> None:
    ap = bench_arguments(__doc__, artifacts=True, prompts=True)
    ap.add_argument("--engines", default="f32,gguf,split", help="Cost curves: f32, gguf, split.")
    ap.add_argument("--methods", default="ngram,suffix,auto", help="Drafts, each with N = auto.")
    ap.add_argument("--ablate", default="", help=f"Comma-separated, each a variant of the first method: {ABLATIONS}.")
    ap.add_argument("--noise", type=float, default=0.0, help="Step-time disturbance (lognormal sigma).")
    ap.add_argument("--seed", type=int, default=0, help="The noise's seed (each prompt its own stream of it).")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()

    from specrt.benchmark import load_prompts, write_result_json
    from specrt.runtime.runner import RunnerSpec, open_generator

    curves = engine_costs(args.artifacts)
    engines = [e for e in args.engines.split(",") if e]
    missing = [e for e in engines if e not in curves]
    if missing:
        raise SystemExit(f"no step costs for {missing}: build the gguf engine (make build-engines)")
    methods = [m for m in args.methods.split(",") if m]
    ablations = [a for a in args.ablate.split(",") if a]
    if set(ablations) - set(ABLATIONS):
        raise SystemExit(f"--ablate: choose among {', '.join(ABLATIONS)}")
    gen = open_generator(RunnerSpec(artifacts=args.artifacts))
    prompts = load_prompts(args.prompts)
    encoded = [gen.encode_prompt(p["prompt"]) for p in prompts]
    work = calibrate(gen, methods, encoded[:3], 48)
    for m, (plan, draft) in work.items():
        print(f"runtime work per step, {m}: plan {plan * 1e6:.0f} us, lookup {draft * 1e6:.0f} us (measured here)")
    variants = [(m, m, ()) for m in methods] + [(f"{methods[0]} -{a}", methods[0], (a,)) for a in ablations]
    results = {}
    for engine in engines:
        curve = curves[engine]
        caps = gen.backend.caps
        gen.backend.caps = dataclasses.replace(caps, step_ms=curve)  # the cost model's priors: this engine's
        rows = []
        for pi, (p, ids) in enumerate(zip(prompts, encoded)):
            plain = gen.generate_ids([ids], args.max_new_tokens)[0]
            n = len(plain.token_ids)
            noise_seed = 1000 * pi + args.seed
            plain_clock = VirtualClock(curve, 0.0, 0.0, args.noise, noise_seed)
            plain_s = sum(plain_clock.step(1, 1) for _ in range(n - 1))
            row = {"prompt": pi, "class": p["class"], "tokens": n}
            for label, method, ablate in variants:
                restore = patched(set(ablate))
                try:
                    clock = VirtualClock(curve, *work[method], args.noise, noise_seed)
                    res, seconds = run_virtual(gen, method, ids, args.max_new_tokens, clock, ablate)
                finally:
                    restore()
                if res.token_ids != plain.token_ids:
                    raise SystemExit(f"{label} on prompt {pi}: output differs from plain decoding")
                row[label] = plain_s / seconds
            rows.append(row)
            cells = "".join(f" {row[v[0]]:5.2f}" for v in variants)
            print(f"{engine:5s} #{pi:<2d} {p['class']:<13}{cells}", flush=True)
        gen.backend.caps = caps
        labels = [v[0] for v in variants]
        results[engine] = {
            "rows": rows,
            "min": {v: min(r[v] for r in rows) for v in labels},
            "gmean": {v: float(np.exp(np.mean([np.log(r[v]) for r in rows]))) for v in labels},
            "step_ms": {str(q): t for q, t in curve.items()},
        }
    print()
    head = f"{'engine':<7}{'':>6}" + "".join(f"{v[0]:>18}" for v in variants)
    print(head)
    for engine, r in results.items():
        for what in ("min", "gmean"):
            print(f"{engine:<7}{what:>6}" + "".join(f"{r[what][v[0]]:>17.3f}x" for v in variants))
    result = {
        **envelope("onnxruntime", "numpy"),
        "benchmark": "policy-virtual-clock",
        "config": {
            "methods": methods,
            "ablate": ablations,
            "noise": args.noise,
            "seed": args.seed,
            "max_new_tokens": args.max_new_tokens,
        },
        "runtime_work_s": {m: {"plan": w[0], "lookup": w[1]} for m, w in work.items()},
        "engines": results,
    }
    print(f"wrote {write_result_json(result, args.out, 'policy')}")


if __name__ == "__main__":
    main()
