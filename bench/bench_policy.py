"""The speculation policy on a virtual clock: which draft and N choices pay, free of machine noise.

    python bench/bench_policy.py [--artifacts artifacts/SmolLM2-135M-Instruct] [--engines f32,gguf,split] [--bursts]
                                 [--methods ngram,suffix,auto] [--ablate gate,pooling,...] [--noise 0.05]
                                 [--prompts bench/prompts.jsonl | --prompt-set 64]

This machine's speed drifts by up to 50 % over minutes, so end-to-end runs (specrt bench) cannot
tell a policy change worth 3 % from noise. Here each prompt's greedy answer is made once for real
on the float32 engine (--record: another), and then every variant generates on a target that
replays those answers (bench/replay.py): the drafts, verdicts and step shapes are the ones the
real engine gives, and every output is checked against the recorded answer. The clock is
virtual: a target step of P
positions over B rows takes what the engine's build measured for P / B positions (its
manifest's step_ms, interpolated; `split`: one position on the gguf engine, more on float32),
and each draft method's own host work per step (drafting, planning, reading its drafts in
hindsight) what a calibration pass measured on this machine beyond plain decoding's, in the
real loop on the 4-bit engine (float32 without one), as a fraction of its decode step (one
prompt per class, 3 rounds, interleaved). So a run is a function of the
policy alone, and two policies compare exactly. `--noise` adds a seeded disturbance (each step x
lognormal(0, noise), and 3 % of steps 2-6x slower: what the cost model's robust fit is for), and
`--bursts` periods of load (1.5-3x slower for ~20 steps: another process on the CPU); every
variant sees the same sequence.

The figure per prompt is the decode speedup over plain decoding on the same virtual clock
(prefill excluded: it is the same for all); plain decoding runs there too, with the step floor's
free guess (before 2026-12-05 it was counted as one-position steps, without the floor).
Ablations (--ablate) switch one heuristic off, to show what it buys:
    hindsight     lookups learn only from the drafts that were verified (and, as nothing else
                  would ever back a draft, may verify on priors: the gate off too)
    gate          a lookup's draft may be verified on its evidence's prior alone
    pooling       each match length learnt alone (shorter matches of the method not pooled in)
    calibration   predictions not scaled by realized / predicted extra tokens (drafts with weights;
                  the lookups' plan does not use it)
    spike         no spike filter for less-observed step sizes (estimators.SPIKE)
    trust         a size's time is its median from the first observation (estimators.TRUST = 1)
    curve         no least price of a step's size from the build's step costs (estimators.StepCurve):
                  the line through the sizes timed so far prices every length
(The engine's step costs as the cost model's priors, and a horizon on a lookup's first bets,
were ablated here and went on 2026-12-05: below the noise, and below zero under load.)
`--prompt-set N` runs the first N prompts of the offline prompt set (specrt/training/prompts.py,
which holds the benchmark's prompts out) instead of the benchmark file: what a policy is tuned
on, so that the benchmark's figures are not fitted to it. Prints a table per engine (rows:
prompts; columns: variants; last rows: the minimum and the geometric mean, over all prompts and
per class) and writes JSON (date, versions, machine) to bench/results/.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from harness import bench_arguments, envelope
from replay import ReplayBackend

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ABLATIONS = ("hindsight", "gate", "pooling", "calibration", "spike", "trust", "curve")


def engine_costs(artifacts: Path) -> dict[str, dict[int, float]]:
    """ms per step by positions (batch 1) of each engine, from the build's manifests."""
    from specrt.layout import ArtifactLayout

    layout = ArtifactLayout(artifacts)

    def read(engine: Path) -> dict[int, float] | None:
        m = json.loads((engine / "manifest.json").read_text()) if (engine / "manifest.json").is_file() else {}
        return {int(q): float(v) for q, v in m["step_ms"].items()} if "step_ms" in m else None

    f32, gguf = read(layout.ort_engine("cpu")), read(layout.ort_engine("cpu", "gguf"))
    out = {"f32": f32} if f32 is not None else {}
    if gguf is not None:
        out["gguf"] = gguf
        if f32 is not None:
            out["split"] = {1: gguf[1], **{q: t for q, t in f32.items() if q > 1}}
    # the int8-activation engines (make serve: int8-a8; gguf-k: the Qwen models')
    for scheme in ("gguf-a8", "int8-a8", "int4-a8", "gguf-k"):
        if (curve := read(layout.ort_engine("cpu", scheme))) is not None:
            out[scheme] = curve
    if not out:
        raise SystemExit(f"{layout.root} has no engine with measured step costs: run make build-engines")
    return out


class VirtualClock:
    """Step times from a cost curve, a method's host work as a share of a decode step, optional
    seeded noise: each step x lognormal(0, noise) and 3 % of steps 2-6x slower; with `bursts`,
    also periods of load (another process taking the CPU), in virtual time, so that plain
    decoding and a draft see the same load at the same moment: quiet for 40 decode steps and
    loaded for 20 on average (exponential), each period slowing every step in it by one factor
    drawn from 1.5-3x."""

    def __init__(self, curve: dict[int, float], work: float, noise: float, seed: int, bursts: bool = False):
        self.qs = np.array(sorted(curve), np.float64)
        self.ms = np.array([curve[q] for q in sorted(curve)])
        self.work_s = work * self.ms[0] * 1e-3
        self.noise, self.bursts = noise, bursts
        self.rng = np.random.default_rng(seed)
        self.total = 0.0
        self.now = 0.0  # virtual seconds of steps so far
        self.periods: list[tuple[float, float, float]] = []  # (start, end, slowdown) of the loaded periods
        if bursts:
            rng, at, step_s = np.random.default_rng([seed, 7]), 0.0, self.ms[0] * 1e-3
            while at < 1e4 * step_s:
                at += rng.exponential(40 * step_s)
                length = rng.exponential(20 * step_s)
                self.periods.append((at, at + length, float(rng.uniform(1.5, 3.0))))
                at += length

    def load(self) -> float:
        """The slowdown at this virtual moment (1: a quiet period)."""
        for start, end, factor in self.periods:
            if start <= self.now < end:
                return factor
            if start > self.now:
                break
        return 1.0

    def step(self, positions: int, batch: int) -> float:
        t = float(np.interp(positions / batch, self.qs, self.ms)) * 1e-3
        if self.noise:
            t *= float(self.rng.lognormal(0.0, self.noise))
            if self.rng.random() < 0.03:
                t *= float(self.rng.uniform(2, 6))
        t *= self.load()
        self.now += t + self.work_s
        return t


def patched(ablations: set[str]):
    """Switch the named heuristics off (this process only); returns a function that restores them."""
    from specrt.runtime import estimators, policy

    model = policy.CostModel
    saved = {
        "SPIKE": estimators.SPIKE,
        "TRUST": estimators.TRUST,
        "calibration": model.calibration,
        "backed": model.backed,
        "_counts": model._counts,
        "curve": estimators.StepCurve.__bool__,
    }
    if "spike" in ablations:
        estimators.SPIKE = float("inf")
    if "trust" in ablations:
        estimators.TRUST = 1
    if "calibration" in ablations:
        model.calibration = lambda self: 1.0
    if "gate" in ablations or "hindsight" in ablations:
        model.backed = lambda self, key: True
    if "curve" in ablations:
        estimators.StepCurve.__bool__ = lambda self: False
    if "pooling" in ablations:

        def own(self, key):
            acc = self.evidence(key)
            return acc.tried.tolist(), acc.hit.tolist()

        model._counts = own

    def restore():
        estimators.SPIKE, estimators.TRUST = saved["SPIKE"], saved["TRUST"]
        model.calibration, model.backed, model._counts = saved["calibration"], saved["backed"], saved["_counts"]
        estimators.StepCurve.__bool__ = saved["curve"]

    return restore


def run_virtual(target, method: str, ids: list[int], tokens: int, clock: VirtualClock, ablate=()):
    """One greedy generation with the cost model on `clock`; (result, virtual decode seconds)."""
    from specrt.runtime.drafts import make_proposer
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy
    from specrt.runtime.verification import DraftTree

    if method == "plain":  # no draft, N = 0: what Generator runs
        from specrt.runtime.drafts.base import NoDraft
        from specrt.runtime.policy import FixedPolicy

        decoder = SpeculativeDecoder(target, NoDraft(), FixedPolicy(0))
    else:
        decoder = SpeculativeDecoder(target, make_proposer(method), make_policy("auto"))
    real_observe = decoder.observe

    def observe(state, r):
        r.verify_seconds = clock.step(r.positions, r.batch)
        r.draft_seconds = clock.work_s
        clock.total += r.verify_seconds + r.draft_seconds
        if "hindsight" in ablate:  # only what was verified is read (no rivals)
            for s in r.rows:  # the floor's guesses are no lookup's drafts
                t = s.tree  # what was verified, without its rivals
                kept = DraftTree(t.tokens, t.parents, t.q, t.scores, t.evidence)
                s.drafted = DraftTree.empty() if s.guessed else kept
        real_observe(state, r)

    decoder.observe = observe
    clock.total = 0.0
    result = decoder.generate_ids([ids], tokens)[0]
    return result, clock.total


def host_work(gen, methods, prompts, tokens: int, rounds: int = 2) -> dict[str, float]:
    """Each method's host work per step beyond plain decoding's, as a share of a plain decode step,
    measured here in the real loop: per step, its time outside the engine's own step (median),
    less plain decoding's, over the median engine step of plain decoding; methods interleaved."""
    from specrt.runtime.drafts import make_proposer
    from specrt.runtime.drafts.base import NoDraft
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy

    backend = gen.session.backend
    inner = backend.step
    host: dict[str, list[float]] = {m: [] for m in ("none", *methods)}
    engine: list[float] = []
    spent = [0.0]

    def timed_step(*a, **k):
        t = time.perf_counter()
        out = inner(*a, **k)
        spent[0] += time.perf_counter() - t
        return out

    backend.step = timed_step
    try:
        for _ in range(rounds):
            for method in host:
                plain = method == "none"
                decoder = SpeculativeDecoder(
                    gen, NoDraft() if plain else make_proposer(method), make_policy(0 if plain else "auto")
                )
                step = decoder.step

                def timed(*args, _step=step, _method=method):
                    spent[0] = 0.0
                    t = time.perf_counter()
                    record = _step(*args)
                    host[_method].append(time.perf_counter() - t - spent[0])
                    if _method == "none":
                        engine.append(spent[0])
                    return record

                decoder.step = timed
                for ids in prompts:
                    decoder.generate_ids([ids], tokens)
    finally:
        backend.step = inner
    base, step_s = statistics.median(host["none"]), statistics.median(engine)
    return {m: max(statistics.median(v) - base, 0.0) / step_s for m, v in host.items() if m != "none"}


def load_prompt_rows(args) -> list[dict]:
    from specrt.benchmark import load_prompts
    from specrt.training.prompts import benchmark_prompts, build_prompt_set

    if not args.prompt_set:
        return load_prompts(args.prompts)
    made = build_prompt_set(args.prompt_set, exclude=benchmark_prompts(args.prompts))
    return [{"class": p.kind, "prompt": p.prompt} for p in made]


def summary(rows: list[dict], labels: list[str]) -> dict:
    def gmean(values):
        return float(np.exp(np.mean(np.log(values))))

    classes = list(dict.fromkeys(r["class"] for r in rows))
    return {
        "min": {v: min(r[v] for r in rows) for v in labels},
        "gmean": {v: gmean([r[v] for r in rows]) for v in labels},
        "gmean_by_class": {c: {v: gmean([r[v] for r in rows if r["class"] == c]) for v in labels} for c in classes},
        "min_by_class": {c: {v: min(r[v] for r in rows if r["class"] == c) for v in labels} for c in classes},
    }


def main() -> None:
    ap = bench_arguments(__doc__, artifacts=True, prompts=True)
    ap.add_argument(
        "--engines",
        default="f32,gguf,split",
        help="Cost curves: f32, gguf, split, and the int8-activation engines built (gguf-a8, int8-a8, int4-a8, "
        "gguf-k).",
    )
    ap.add_argument(
        "--record",
        default="none",
        help="The engine whose greedy answers are replayed (none: float32; gguf-k for a model whose weights stay in "
        "its GGUF).",
    )
    ap.add_argument("--methods", default="ngram,suffix,auto", help="Drafts, each with N = auto.")
    ap.add_argument("--ablate", default="", help=f"Comma-separated, each a variant of the first method: {ABLATIONS}.")
    ap.add_argument("--noise", type=float, default=0.0, help="Step-time disturbance (lognormal sigma).")
    ap.add_argument("--seed", type=int, default=0, help="The noise's seed (each prompt its own stream of it).")
    ap.add_argument("--bursts", action="store_true", help="Periods of load, 1.5-3x slower (VirtualClock).")
    ap.add_argument("--prompt-set", type=int, default=0, help="Run this many offline prompt-set prompts instead.")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--host-work", default="", help="method=share,... as an earlier run measured them (skips measuring)"
    )
    args = ap.parse_args()

    from specrt.benchmark import write_result_json
    from specrt.runtime.runner import RunnerSpec, open_generator
    from specrt.runtime.target import Target

    curves = engine_costs(args.artifacts)
    engines = [e for e in args.engines.split(",") if e]
    missing = [e for e in engines if e not in curves]
    if missing:
        raise SystemExit(f"no step costs for {missing}: build the gguf engine (make build-engines)")
    methods = [m for m in args.methods.split(",") if m]
    ablations = [a for a in args.ablate.split(",") if a]
    if set(ablations) - set(ABLATIONS):
        raise SystemExit(f"--ablate: choose among {', '.join(ABLATIONS)}")
    gen = open_generator(RunnerSpec(artifacts=args.artifacts, quantize=args.record))
    prompts = load_prompt_rows(args)
    encoded = [gen.encode_prompt(p["prompt"]) for p in prompts]
    work = {m: float(v) for m, v in (kv.split("=") for kv in args.host_work.split(",") if kv)}
    if not set(methods) <= set(work):
        # measured where it weighs most: beside the 4-bit engine's step when there is one
        fastest = open_generator(RunnerSpec(artifacts=args.artifacts, quantize="gguf")) if "gguf" in curves else gen
        by_class = list({p["class"]: ids for p, ids in zip(prompts, encoded)}.values())  # one prompt per class
        work = host_work(fastest, methods, by_class, 64, rounds=3)
    for m, share in work.items():
        print(f"host work per step beyond plain decoding, {m}: {share:.2%} of a decode step")
    t = time.perf_counter()
    answers = [gen.generate_ids([ids], args.max_new_tokens)[0].token_ids for ids in encoded]
    print(f"{len(answers)} answers recorded on the {args.record} engine in {time.perf_counter() - t:.0f} s", flush=True)
    variants = [(m, m, ()) for m in methods] + [(f"{methods[0]} -{a}", methods[0], (a,)) for a in ablations]
    results = {}
    for engine in engines:
        curve = curves[engine]
        replay = ReplayBackend(
            {tuple(ids): a for ids, a in zip(encoded, answers)},
            gen.config.vocab_size,
            tuple(sorted(gen.eos_ids)),
            step_ms=curve,  # the cost model's priors: this engine's
            # the recording engine's step floor (its free guess) on its own curve; the others as before
            **({"floor": gen.session.caps.floor} if engine == args.record else {}),
        )
        target = Target(replay)
        rows = []
        for pi, (p, ids, answer) in enumerate(zip(prompts, encoded, answers)):
            noise_seed = 1000 * pi + args.seed
            # plain decoding on the same clock: with the step floor each step computes two positions and
            # its second carries a free guess (runtime/session.py), so it is run, not counted
            plain_clock = VirtualClock(curve, 0.0, args.noise, noise_seed, args.bursts)
            plain, plain_s = run_virtual(target, "plain", ids, args.max_new_tokens, plain_clock)
            if plain.token_ids != answer:
                raise SystemExit(f"plain decoding on the replay target differs from the recorded answer ({pi})")
            row = {"prompt": pi, "class": p["class"], "tokens": len(answer)}
            for label, method, ablate in variants:
                restore = patched(set(ablate))
                try:
                    clock = VirtualClock(curve, work[method], args.noise, noise_seed, args.bursts)
                    res, seconds = run_virtual(target, method, ids, args.max_new_tokens, clock, ablate)
                finally:
                    restore()
                if res.token_ids != answer:
                    raise SystemExit(f"{label} on prompt {pi}: output differs from the recorded answer")
                row[label] = plain_s / seconds
            rows.append(row)
            if len(prompts) <= 16:
                cells = "".join(f" {row[v[0]]:5.2f}" for v in variants)
                print(f"{engine:5s} #{pi:<2d} {p['class']:<13}{cells}", flush=True)
        labels = [v[0] for v in variants]
        results[engine] = {"rows": rows, **summary(rows, labels), "step_ms": {str(q): t for q, t in curve.items()}}
    print()
    print(f"{'engine':<7}{'':>14}" + "".join(f"{v[0]:>18}" for v in variants))
    for engine, r in results.items():
        for what in ("min", "gmean"):
            print(f"{engine:<7}{what:>14}" + "".join(f"{r[what][v[0]]:>17.3f}x" for v in variants))
        for c, by in r["gmean_by_class"].items():
            print(f"{engine:<7}{c[:14]:>14}" + "".join(f"{by[v[0]]:>17.3f}x" for v in variants))
    result = {
        **envelope("onnxruntime", "numpy"),
        "benchmark": "policy-virtual-clock",
        "config": {
            "methods": methods,
            "ablate": ablations,
            "noise": args.noise,
            "bursts": args.bursts,
            "seed": args.seed,
            "max_new_tokens": args.max_new_tokens,
            "prompts": f"prompt set, first {args.prompt_set}" if args.prompt_set else str(args.prompts),
        },
        "host_work_share": work,
        "engines": results,
    }
    print(f"wrote {write_result_json(result, args.out, 'policy')}")


if __name__ == "__main__":
    main()
