"""`specrt calibrate --report`: every quantized engine of an artifact directory against float32.

    result = quant_report(ReportSpec(artifacts, checkpoint)); print(format_report(result))

Per engine (float32 and each built `engines/ort-cpu-<scheme>/`), measured in one run, engines in
turn for every prompt so machine noise hits them alike:

  quality    teacher-forced on held-out text (the benchmark prompts when given, and the float
             engine's greedy answers to prompts of a seed neither the calibration set nor the draft
             heads use): perplexity, top-1 agreement with float32 at every position, mean
             KL(float32 || engine) of the next-token distribution
  exactness  from the engine's manifest: "bitwise" where every step shape gives the same bits
             under the step floor (runtime/session.py), else the bound of one- against
             multi-position steps (near-ties)
  speed      decode tokens/s (greedy, plain), the cost of one step over Q = 1, 2, 4, 8, 16
             positions after a 128-token prefill (ms; verification of N drafts is Q = N + 1)
  memory     the engine's size on disk and the resident memory its load added
  drafts     per draft method (suffix and ngram, and trained heads given): acceptance rate, mean
             accepted length, tokens/s end to end, and whether speculative output equalled the
             engine's own plain output. A head runs on the engines that compute what it was
             trained against (its features' precision: float32 and gguf); the others refuse it,
             and the table says so.

The target quantized is what this measures; quantized draft heads are not built yet.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from specrt.calibration import QUANT_SCHEMES
from specrt.errors import SpecrtError
from specrt.layout import ArtifactLayout
from specrt.runtime.generator import Generator
from specrt.runtime.logprobs import log_softmax
from specrt.runtime.runner import RunnerSpec, open_generator

REPORT_SEED = 2  # the prompt set's seed for held-out text: calibration uses 1, draft heads 0


@dataclasses.dataclass(frozen=True)
class ReportSpec:
    artifacts: Path
    checkpoint: Path
    schemes: tuple[str, ...] | None = None  # default: every scheme whose ORT engine is built
    prompts: Path | None = None  # benchmark prompts (JSON lines with 'prompt'): held-out text
    held_out: int = 8  # prompts of REPORT_SEED answered by the float engine
    new_tokens: int = 64
    positions: tuple[int, ...] = (1, 2, 4, 8, 16)
    drafts: tuple[str, ...] = ("suffix", "ngram")
    heads: tuple[Path, ...] = ()  # trained draft heads (eagle / eagle3 directories) to run on each engine
    repeats: int = 5  # timed steps per Q (median)


def log_softmax_rows(gen: Generator, ids: list[int], chunk: int = 256) -> np.ndarray:
    """(len(ids) - 1, V) float64 log-probabilities of the next token at each position, teacher-forced."""
    cache = gen.session.new_cache(1, len(ids) + 1)
    rows = []
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : start + chunk]
        rows.append(log_softmax(gen.session.forward(cache, [piece]).logits[0][: len(ids) - 1 - start]))
    return np.concatenate(rows)


def held_out_texts(ref: Generator, bench: tuple[str, ...], n: int, new_tokens: int):
    """(texts, chats): the benchmark prompts as plain text, and `n` chat prompts of REPORT_SEED
    (none of them a benchmark prompt) each followed by the float engine's greedy answer; the
    chats alone are returned too (prompts to time generation on)."""
    from specrt.training.prompts import build_prompt_set

    texts = [ref.tokenizer.encode(p, add_special_tokens=True) for p in bench]
    chats = [ref.encode_prompt(p.prompt) for p in build_prompt_set(n, REPORT_SEED, exclude=bench)]
    texts += [c + a.token_ids for c, a in zip(chats, ref.generate_ids(chats, new_tokens))]
    return texts, chats


def quality(
    ref: Generator,
    gens: dict[str, Generator],
    texts: list[list[int]],
    scorers: dict[str, Callable[[list[int]], np.ndarray]] | None = None,
) -> dict:
    """Per engine, teacher-forced over every position of `texts` against `ref`: perplexity,
    top-1 agreement with ref and the mean KL(ref || engine) of the next-token distribution.
    scorers: more entries that are no generator, each a function of a text returning what
    log_softmax_rows does (a graph run by another evaluator)."""
    score = {n: (lambda t, g=g: log_softmax_rows(g, t)) for n, g in gens.items() if g is not ref}
    score.update(scorers or {})
    names = [n for n, g in gens.items() if g is ref] + list(score)
    acc = {n: {"nll": [], "top1": [], "kl": []} for n in names}
    for text in texts:
        base = log_softmax_rows(ref, text)
        target = np.array(text[1:])
        for n in names:
            lp = score[n](text) if n in score else base
            acc[n]["nll"] += (-lp[np.arange(len(target)), target]).tolist()
            acc[n]["top1"] += (lp.argmax(-1) == base.argmax(-1)).tolist()
            acc[n]["kl"] += np.maximum((np.exp(base) * (base - lp)).sum(-1), 0).tolist()
    return {
        n: {
            "perplexity": float(np.exp(np.mean(a["nll"]))),
            "top1_agreement": float(np.mean(a["top1"])),
            "mean_kl": float(np.mean(a["kl"])),
            "positions": len(a["nll"]),
        }
        for n, a in acc.items()
    }


def _rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _step_ms(gen: Generator, prefix: list[int], q: int, repeats: int) -> float:
    """Median time of one step over q new positions after `prefix` (the cache rolled back each time)."""
    cache = gen.session.new_cache(1, len(prefix) + q + 1)
    gen.session.prefill(cache, [prefix])
    base = cache.lengths.copy()
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        gen.session.forward(cache, [prefix[:q]])
        times.append(time.perf_counter() - t0)
        cache.rollback(base)
    return 1000 * statistics.median(times[1:])  # the first warms the shape up


def _head_method(head: Path) -> str:
    """A head directory's method (eagle, eagle3, mtp, medusa), from its engine's manifest; a
    directory of another kind says which kind it is."""
    from specrt.artifacts import MANIFEST, ArtifactError, read_json_object
    from specrt.engines.head import HEAD_ENGINE_KIND
    from specrt.engines.ort import ENGINE_KIND
    from specrt.layout import HeadLayout

    manifest = HeadLayout(head).ort_engine("cpu") / MANIFEST
    fix = "give a head's directory (specrt train-draft --out DIR, or one of make drafts' drafts/MODEL/*)"
    if not manifest.is_file():
        own = head / MANIFEST
        what = "a checkpoint" if (head / "config.json").is_file() else "no built draft head"
        if own.is_file():
            what = f"an artifact of kind {read_json_object(own, ArtifactError, fix).get('kind')!r}"
        raise SpecrtError(f"--heads {head} is {what}, not a built draft head (no {manifest}); {fix}")
    m = read_json_object(manifest, ArtifactError, fix)
    if m.get("kind") != HEAD_ENGINE_KIND or not isinstance(m.get("head"), dict):
        what = f"an artifact of kind {m.get('kind')!r}"
        if m.get("kind") == ENGINE_KIND:  # build-engines output: a target's, or a draft model's
            what = "a model's engine (build-engines output)"
        raise SpecrtError(f"--heads {head}: {manifest.parent} is {what}, not a draft head's engine; {fix}")
    return m["head"]["method"]


def report_inputs(spec: ReportSpec) -> tuple[dict[str, Path], dict[str, tuple[str, dict]]]:
    """(engines by name, draft methods by name: (method, options)) that the report runs, or a
    SpecrtError naming a scheme asked for and not built, or a --heads entry that is no head:
    cheap, so a caller can check before it spends minutes on anything else."""
    layout = ArtifactLayout(spec.artifacts)
    schemes = spec.schemes if spec.schemes is not None else QUANT_SCHEMES
    engines = {"float32": layout.ort_engine("cpu")}
    engines.update({s: layout.ort_engine("cpu", s) for s in schemes if layout.ort_engine("cpu", s).is_dir()})
    missing = [s for s in spec.schemes or () if s not in engines]
    if missing:  # asked for by name: a report without them would answer another question
        raise SpecrtError(
            f"{spec.artifacts} has no engine of {', '.join(missing)} (no {layout.ort_engine('cpu', missing[0])}); "
            f"build it with: specrt build-engines --model CHECKPOINT --out {spec.artifacts} --quantize {missing[0]}"
            + (", or leave --schemes out to report on the engines built" if len(engines) > 1 else "")
        )
    # draft methods: the lookups, and each head under its method's name and directory
    methods = {d: (d, {}) for d in spec.drafts}
    for head in spec.heads:
        method = _head_method(Path(head))
        methods[f"{method} ({Path(head).name})"] = (method, {"draft_dir": head})
    return engines, methods


def quant_report(spec: ReportSpec, log: Callable[[str], None] = print) -> dict:
    from specrt.artifacts import cpu_model, package_versions
    from specrt.runtime.drafts import make_proposer
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy
    from specrt.training.prompts import benchmark_prompts

    engines, methods = report_inputs(spec)
    gens, memory = {}, {}
    for name, engine in engines.items():
        before = _rss_mib()
        gens[name] = open_generator(RunnerSpec(engine=engine, checkpoint=spec.checkpoint))
        memory[name] = {
            "engine_mib": round(sum(p.stat().st_size for p in engine.rglob("*") if p.is_file()) / 2**20, 1),
            "load_rss_mib": round(_rss_mib() - before, 1),
        }
    ref = gens["float32"]
    bench = benchmark_prompts(spec.prompts) if spec.prompts and Path(spec.prompts).is_file() else ()
    texts, chats = held_out_texts(ref, bench, spec.held_out, spec.new_tokens)
    log(
        f"held-out text: {len(texts)} sequences, {sum(len(t) - 1 for t in texts)} positions; engines: {', '.join(gens)}"
    )

    measured = quality(ref, gens, texts)
    log("quality measured")

    prefix = (texts[-1] * 4)[:128]
    speed = {n: {"decode": [], "step_ms": {}} for n in gens}
    drafts = {n: {d: {"tok_s": [], "accepted": [], "rate": [], "equal": 0, "runs": 0} for d in methods} for n in gens}
    refused = {n: {} for n in gens}
    for chat in chats[:4]:
        for n, g in gens.items():
            plain = g.generate_ids([chat], spec.new_tokens)[0]
            speed[n]["decode"].append(plain.decode_tokens_per_second)
            for d, (method, options) in methods.items():
                if d in refused[n]:
                    continue
                with warnings.catch_warnings():  # engines that are not exact say so: the table shows it
                    warnings.simplefilter("ignore")
                    try:
                        opts = {**options, "target": g.session.caps} if options else {}
                        dec = SpeculativeDecoder(g, make_proposer(method, **opts), make_policy("auto"))
                    except SpecrtError as e:  # a head trained against another precision of the target
                        refused[n][d] = str(e)
                        continue
                t0 = time.perf_counter()
                res = dec.generate_ids([chat], spec.new_tokens)[0]
                r = drafts[n][d]
                r["tok_s"].append(len(res.token_ids) / (time.perf_counter() - t0))
                r["accepted"].append(res.metrics.mean_accepted_length)
                r["rate"].append(res.metrics.acceptance_rate)
                r["equal"] += res.token_ids == plain.token_ids
                r["runs"] += 1
    for n, g in gens.items():
        speed[n]["step_ms"] = {q: round(_step_ms(g, prefix, q, spec.repeats), 2) for q in spec.positions}
    log("speed measured")

    rows = {}
    for n, g in gens.items():
        q1 = speed[n]["step_ms"][spec.positions[0]]
        q = measured[n]
        rows[n] = {
            "perplexity": round(q["perplexity"], 3),
            "top1_agreement": round(q["top1_agreement"], 4),
            "mean_kl": round(q["mean_kl"], 5),
            "batch_variance": g.backend.caps.batch_invariance["relative"] if g.backend.caps.batch_invariance else None,
            "exactness": g.session.exactness()["exact"],
            "decode_tok_s": round(statistics.median(speed[n]["decode"]), 1),
            "step_ms": speed[n]["step_ms"],
            "step_cost_vs_q1": {q: round(ms / q1, 2) for q, ms in speed[n]["step_ms"].items()},
            **memory[n],
            "drafts": {
                d: (
                    {"refused": refused[n][d]}
                    if d in refused[n]
                    else {
                        "tok_s": round(statistics.median(r["tok_s"]), 1),
                        "mean_accepted_length": round(statistics.median(r["accepted"]), 2),
                        "acceptance_rate": round(statistics.median(r["rate"]), 3),
                        "equals_plain": f"{r['equal']}/{r['runs']}",
                    }
                )
                for d, r in drafts[n].items()
            },
        }
    return {
        "benchmark": "quantization-report",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model()},
        "versions": package_versions("onnxruntime", "onnx", "numpy"),
        "artifacts": str(spec.artifacts),
        "held_out": {"sequences": len(texts), "positions": measured["float32"]["positions"], "seed": REPORT_SEED},
        "new_tokens": spec.new_tokens,
        "engines": rows,
    }


def format_report(result: dict) -> str:
    rows = result["engines"]
    qs = list(next(iter(rows.values()))["step_ms"])
    drafts = list(next(iter(rows.values()))["drafts"])
    head = f"{'engine':<10}{'MiB':>6}{'ppl':>8}{'top-1':>8}{'KL':>9}{'exact':>11}{'decode/s':>10}"
    head += "".join(f"{'Q=' + str(q):>8}" for q in qs)
    lines = [head + "   (step cost relative to Q=1)"]
    for n, r in rows.items():
        bv = "n/a" if r["batch_variance"] is None else f"{r['batch_variance']:.1e}"
        bv = "bitwise" if r.get("exactness") == "bitwise" else bv
        line = f"{n:<10}{r['engine_mib']:>6.0f}{r['perplexity']:>8.3f}{r['top1_agreement'] * 100:>7.1f}%"
        line += f"{r['mean_kl']:>9.4f}{bv:>11}{r['decode_tok_s']:>10.1f}"
        line += "".join(f"{r['step_cost_vs_q1'][q]:>7.2f}x" for q in qs)
        lines.append(line)
    for d in drafts:
        lines.append(f"\n{d} draft, N = auto: tokens/s end to end, mean accepted length, acceptance, = plain")
        for n, r in rows.items():
            x = r["drafts"][d]
            if "refused" in x:
                lines.append(f"{n:<10}  refused: {x['refused'][:90]}")
                continue
            lines.append(
                f"{n:<10}{x['tok_s']:>8.1f}{x['mean_accepted_length']:>8.2f}{x['acceptance_rate']:>8.3f}"
                f"{x['equals_plain']:>8}"
            )
    return "\n".join(lines)


def plot_report(result: dict, path: Path) -> Path | None:
    """Decode speed against agreement with float32, one point per engine (needs matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    groups: list[tuple[float, float, bool, list[str]]] = []  # engines at one point share a label
    for n, r in result["engines"].items():
        x, y = r["decode_tok_s"], 100 * r["top1_agreement"]
        runs = [d["equals_plain"].split("/") for d in r["drafts"].values() if "equals_plain" in d]
        bound = r["batch_variance"] is not None and r["batch_variance"] <= 1e-4
        exact = (r.get("exactness") == "bitwise" or bound) and all(a == b for a, b in runs)
        near = next((g for g in groups if abs(g[0] - x) < 8 and abs(g[1] - y) < 1.5 and g[2] == exact), None)
        if near is None:
            groups.append((x, y, exact, [n]))
        else:
            near[3].append(n)
    for x, y, exact, names in groups:
        ax.scatter(x, y, marker="o" if exact else "x", color="C0" if exact else "C3")
        ax.annotate(" / ".join(names), (x, y), fontsize=8, xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("decode tokens/s (plain, greedy)")
    ax.set_ylabel("top-1 agreement with float32 (%)")
    ax.set_title(
        f"quantized engines, {result['machine']['cpu']} (x: speculative output not always = plain)", fontsize=9
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
