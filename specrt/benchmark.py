"""`specrt bench`: speculative decoding on a prompt set, side by side in one run.

For every repeat and prompt (in turn, so machine noise hits all methods alike; after one untimed
plain run of the prompt, and in an order that rotates with the repeat) it times, end to end
(prefill included) and greedy:
    specrt plain decoding, each draft method at each fixed N and at N = auto,
    transformers' prompt lookup (prompt_lookup_num_tokens) and transformers' plain generate.
Then a sweep of fixed N on one prompt class gives measured decode speedup vs N (prefill
excluded), drawn beside the cost
model's prediction  E[tokens | N] / (T_draft/T_decode + 1 + alpha * N), where E[tokens | N] and
the drafted length come from the largest-N run (truncating its drafts) and alpha is measured.
Writes JSON (with date, versions and machine) and a PNG; returns the result dict.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

from specrt.artifacts import cpu_model, package_versions
from specrt.errors import SpecrtError
from specrt.runtime.drafts import DRAFT_METHODS


@dataclasses.dataclass
class SpecBenchConfig:
    engine_dir: Path  # the float32 ORT engine (its manifest names the checkpoint)
    checkpoint: Path | None = None
    artifacts: Path | None = None  # with quantize / split: the build-engines directory
    quantize: str = "none"  # run the quantized ORT engine of this scheme (build-engines --quantize)
    split: bool = False  # quantize gguf: one-position steps on the 4-bit engine, longer ones on float32
    prompts: Path = Path("bench/prompts.jsonl")
    out_dir: Path = Path("bench/results")
    max_new_tokens: int = 192
    repeats: int = 2
    methods: tuple[str, ...] = ("ngram", "suffix", "auto", "lookahead")
    fixed_n: tuple[int, ...] = (4, 8)
    sweep_n: tuple[int, ...] = (1, 2, 4, 8, 12, 16)
    sweep_method: str = "ngram"  # a chain: truncating its drafts predicts smaller N exactly
    sweep_class: str = "code_edit"
    transformers: bool = True  # compare with transformers' prompt lookup and plain generate
    main_runs: bool = True  # False: only the speedup-vs-N sweep
    hf_lookup_tokens: int = 10
    drafts: Path | None = None  # a `make drafts` directory: adds its heads (eagle/, eagle3/, mtp/, medusa/)
    tree: tuple[int, int] = (4, 6)  # EAGLE-2 dynamic trees: top-k per node, depth (the node budget is N)
    sweep: bool = True


def auto_heads() -> tuple[str, ...]:
    """The heads `--draft auto` is run with, each in its method's directory (a family's `in_auto`)."""
    from specrt.families import families

    return tuple(n for n, f in families().items() if f.drafting.in_auto)


def _tree(tree) -> dict:
    return {"tree": tree} if tree else {}


def head_variants(cfg: SpecBenchConfig, log: Callable[[str], None]) -> list[tuple[str, str, dict]]:
    """(label, method, options) of the trained heads under cfg.drafts (N = auto each)."""
    if cfg.drafts is None:
        return []
    from specrt.layout import HeadLayout

    out = []
    for method, entry in DRAFT_METHODS.items():  # those with weights, in a `make drafts` directory each
        if not (entry.needs_draft_dir or entry.head_optional):
            continue
        d = Path(cfg.drafts) / method
        if entry.head_optional:  # auto with each head it takes: its trees where no copy serves
            for head in auto_heads():
                if HeadLayout(Path(cfg.drafts) / head).ort_engine().is_dir():
                    tree = _tree(cfg.tree) if DRAFT_METHODS[head].takes_tree else {}  # Medusa: its own tree
                    out.append((f"{method}+{head}", method, {"draft_dir": Path(cfg.drafts) / head} | tree))
            continue
        if entry.takes_tree:
            shapes = [(f"{method} chain", None), (f"{method} tree", cfg.tree)]
        else:  # Medusa drafts its own tree of choices (training.json); a draft model, chains
            shapes = [(method, None)]
        if not HeadLayout(d).ort_engine().is_dir():
            log(f"skipped {', '.join(label for label, _ in shapes)}: no head engine under {d} (make drafts)")
            continue
        out += [(label, method, {"draft_dir": d} | _tree(tree)) for label, tree in shapes]
    return out


def load_prompts(path: Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise SpecrtError(f"prompt set {path} not found; pass --prompts FILE (JSON lines with 'class' and 'prompt').")
    prompts = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            p = json.loads(line)
            prompts.append({"class": str(p["class"]), "prompt": str(p["prompt"])})
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SpecrtError(
                f"{path}:{i + 1}: each line must be a JSON object with 'class' and 'prompt' ({e})"
            ) from None
    return prompts


def run_spec_benchmark(cfg: SpecBenchConfig, log: Callable[[str], None] = print) -> dict:
    from specrt.runtime.drafts import make_proposer
    from specrt.runtime.runner import RunnerSpec, open_generator, open_runner
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy

    prompts = load_prompts(cfg.prompts)
    if cfg.quantize == "none" and not cfg.split:
        gen = open_generator(RunnerSpec(engine=cfg.engine_dir, checkpoint=cfg.checkpoint))
    else:
        gen, _ = open_runner(  # its option checks: --split without --quantize gguf is refused
            RunnerSpec(artifacts=cfg.artifacts, checkpoint=cfg.checkpoint, quantize=cfg.quantize, split=cfg.split)
        )
    hf = None
    if cfg.transformers and cfg.main_runs:
        import torch
        from transformers import AutoModelForCausalLM

        checkpoint = (
            cfg.checkpoint or json.loads((Path(cfg.engine_dir) / "manifest.json").read_text())["checkpoint"]["path"]
        )
        hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
        torch.set_num_threads(os.cpu_count() or 1)

    def timed(fn):
        t = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t

    def hf_generate(ids, lookup):
        import torch

        kw = {"prompt_lookup_num_tokens": cfg.hf_lookup_tokens} if lookup else {}
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=cfg.max_new_tokens,
                do_sample=False,
                eos_token_id=sorted(gen.eos_ids),
                pad_token_id=sorted(gen.eos_ids)[0],
                **kw,
            )
        return out[0, len(ids) :].tolist()

    variants = [(f"{m} N={n}", m, {}, n) for m in cfg.methods for n in (*cfg.fixed_n, "auto")]
    variants += [(f"{label} N=auto", m, opts, "auto") for label, m, opts in head_variants(cfg, log)]
    runs = []  # one dict per (repeat, prompt, variant)
    for r in range(cfg.repeats if cfg.main_runs else 0):
        for pi, p in enumerate(prompts):
            ids = gen.encode_prompt(p["prompt"])
            # untimed: a prompt's first generation pays ORT's first run of its shapes (several % on
            # whichever variant ran first), and its tokens are what every variant must equal
            plain = gen.generate_ids([ids], cfg.max_new_tokens)[0]
            base = {"repeat": r, "prompt": pi, "class": p["class"]}
            timings = {}
            order = [("plain", None, None, None), *variants]
            for label, method, opts, n in order[r % len(order) :] + order[: r % len(order)]:  # each repeat rotates
                if method is None:
                    res, t = timed(lambda: gen.generate_ids([ids], cfg.max_new_tokens)[0])
                    runs.append(
                        {
                            **base,
                            "variant": "plain",
                            "tokens": len(res.token_ids),
                            "seconds": t,
                            "same_as_plain": res.token_ids == plain.token_ids,
                            "decode_seconds": res.decode_seconds,
                        }
                    )
                    timings[label] = t
                    continue
                if opts:
                    opts = {**opts, "target": gen.session.caps}
                proposer = make_proposer(method, **opts)  # fresh: no cross-prompt memory
                spec = SpeculativeDecoder(gen, proposer, make_policy(n))
                res, t = timed(lambda: spec.generate_ids([ids], cfg.max_new_tokens)[0])
                timings[label] = t
                m = res.metrics
                runs.append(
                    {
                        **base,
                        "variant": label,
                        "draft_share": m.draft_seconds / res.decode_seconds if res.decode_seconds else None,
                        "tokens": len(res.token_ids),
                        "seconds": t,
                        "decode_seconds": res.decode_seconds,
                        "same_as_plain": res.token_ids == plain.token_ids,
                        "mean_accepted_length": m.mean_accepted_length,
                        "acceptance_rate": m.acceptance_rate,
                        "alpha": m.alpha,
                        # the cost model's own prediction for the run (its fitted costs and acceptance)
                        "predicted_speedup": m.predicted_speedup,
                    }
                )
            t_plain = timings["plain"]
            line = [f"r{r + 1} #{pi + 1} {p['class']:<13} plain {len(plain.token_ids) / t_plain:5.1f} tok/s"]
            line += [
                f"{label.removesuffix(' N=auto')}/{n} {t_plain / timings[label]:4.2f}x" for label, _, _, n in variants
            ]
            if hf is not None:
                for name, lookup in (("transformers prompt lookup", True), ("transformers plain", False)):
                    toks, t = timed(lambda: hf_generate(ids, lookup))
                    runs.append(
                        {
                            **base,
                            "variant": name,
                            "tokens": len(toks),
                            "seconds": t,
                            "same_as_plain": toks == plain.token_ids,
                        }
                    )
                line.append(f"hf-pld {runs[-2]['tokens'] / runs[-2]['seconds']:5.1f} tok/s")
            log("  ".join(line))

    # sweep: measured and predicted speedup vs N on one class
    sweep_prompts = [i for i, p in enumerate(prompts) if p["class"] == cfg.sweep_class]
    sweep = {
        "method": cfg.sweep_method,
        "class": cfg.sweep_class,
        "n": list(cfg.sweep_n),
        "measured": [],
        "predicted": [],
    }
    per_n: dict[int, list[float]] = {n: [] for n in cfg.sweep_n}
    pred_n: dict[int, list[float]] = {n: [] for n in cfg.sweep_n}
    if not cfg.sweep:
        sweep_prompts = []
    for pi in sweep_prompts:
        ids = gen.encode_prompt(prompts[pi]["prompt"])
        plain = gen.generate_ids([ids], cfg.max_new_tokens)[0]
        for n in cfg.sweep_n:
            res = SpeculativeDecoder(gen, make_proposer(cfg.sweep_method), make_policy(n)).generate_ids(
                [ids], cfg.max_new_tokens
            )[0]
            # decode only (prefill excluded), as the cost model describes the decode loop
            per_n[n].append(res.decode_tokens_per_second / plain.decode_tokens_per_second)
            pred_n[n].append(res.metrics.predicted_speedup or float("nan"))
        log(f"sweep #{pi + 1}: " + "  ".join(f"N={n} {per_n[n][-1]:.2f}x" for n in cfg.sweep_n))
    sweep["measured"] = [statistics.median(per_n[n]) for n in cfg.sweep_n] if sweep_prompts else []
    sweep["predicted"] = [statistics.median(pred_n[n]) for n in cfg.sweep_n] if sweep_prompts else []

    summary = summarize(runs)
    result = {
        "benchmark": "speculative-decoding",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": package_versions("onnxruntime", "torch", "transformers", "numpy"),
        "backend": gen.backend.description,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()},
        "summary": summary,
        "sweep": sweep,
        "runs": runs,
    }
    return result


def summarize(runs: list[dict]) -> dict:
    """Per class and variant: end-to-end tokens/s (prefill included; total tokens / total seconds
    per repeat, median over repeats) and its speedup over specrt plain; for specrt runs also the
    decode-only speedup (tokens after the first / decode seconds, prefill excluded); mean accepted
    length; greedy equality with plain."""
    classes = sorted({r["class"] for r in runs}, key=[r["class"] for r in runs].index)
    variants = sorted({r["variant"] for r in runs}, key=[r["variant"] for r in runs].index)
    repeats = sorted({r["repeat"] for r in runs})
    out: dict = {}
    for c in classes:
        out[c] = {}
        for v in variants:
            tps, dps = [], []
            for rep in repeats:
                sel = [r for r in runs if r["class"] == c and r["variant"] == v and r["repeat"] == rep]
                if sel:
                    tps.append(sum(r["tokens"] for r in sel) / sum(r["seconds"] for r in sel))
                if sel and "decode_seconds" in sel[0]:
                    dps.append(sum(r["tokens"] - 1 for r in sel) / sum(r["decode_seconds"] for r in sel))
            sel = [r for r in runs if r["class"] == c and r["variant"] == v]
            if not sel:
                continue
            entry = {
                "tokens_per_s": statistics.median(tps),
                "same_as_plain": f"{sum(r['same_as_plain'] for r in sel)}/{len(sel)}",
            }
            if dps:
                entry["decode_tokens_per_s"] = statistics.median(dps)
            if "mean_accepted_length" in sel[0]:
                entry["mean_accepted_length"] = statistics.median(r["mean_accepted_length"] for r in sel)
                entry["acceptance_rate"] = statistics.median(r["acceptance_rate"] for r in sel)
            if sel[0].get("draft_share") is not None:
                entry["draft_share"] = statistics.median(r["draft_share"] for r in sel)
            predicted = [r["predicted_speedup"] for r in sel if r.get("predicted_speedup") is not None]
            if predicted:
                entry["predicted_speedup"] = statistics.median(predicted)
            out[c][v] = entry
        plain = out[c]["plain"]
        for e in out[c].values():
            e["speedup_vs_plain"] = e["tokens_per_s"] / plain["tokens_per_s"]
            if "decode_tokens_per_s" in e:
                e["decode_speedup_vs_plain"] = e["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
    return out


def format_table(result: dict) -> str:
    summary = result["summary"]
    if not summary:
        return "(no main runs)"
    classes = list(summary)
    variants = list(next(iter(summary.values())))
    head = f"{'variant':<28}" + "".join(f"{c:>28}" for c in classes)
    lines = [head, "-" * len(head)]
    for v in variants:
        cells = []
        for c in classes:
            e = summary[c].get(v)
            if e is None:
                cells.append(f"{'-':>28}")
                continue
            dec = f"{e['decode_speedup_vs_plain']:4.2f}x" if "decode_speedup_vs_plain" in e else ""
            mal = f"L{e['mean_accepted_length']:.1f}" if "mean_accepted_length" in e else ""
            cells.append(f"{e['tokens_per_s']:6.1f} {e['speedup_vs_plain']:4.2f}x {dec:>5} {mal:>5}".rjust(28))
        lines.append(f"{v:<28}" + "".join(cells))
    lines.append(
        "cells: end-to-end tokens/s and its speedup over specrt plain (prefill included), decode-only speedup,"
    )
    lines.append("       L = mean accepted length (bonus token included)")
    return "\n".join(lines)


def plot_sweep(result: dict, path: Path) -> Path | None:
    sweep = result["sweep"]
    if not sweep["measured"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(sweep["n"], sweep["measured"], "o-", label="measured")
    if sweep["predicted"]:
        ax.plot(
            sweep["n"],
            sweep["predicted"],
            "s--",
            label="cost model with the run's acceptance: L / (T_draft/T_decode + 1 + β + αN)",
        )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("draft tokens per step N")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"{sweep['method']} drafts, {sweep['class']} prompts ({result['machine']['cpu']})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_result_json(result: dict, out_dir: str | Path, name: str) -> Path:
    """Write a benchmark's result as `<out_dir>/<name>-<date>.json` (the bench scripts share this),
    or, where `out_dir` names a .json file, as that file (a folder of that name was made before);
    a later run of the same day (of the same file) gets `-2`, `-3`, ...: an earlier result is
    never overwritten."""
    from specrt.artifacts import atomic_write_text

    out_dir = Path(out_dir)
    if out_dir.suffix == ".json" and not out_dir.is_dir():
        out_dir, stem = out_dir.parent, out_dir.stem
    else:
        stem = f"{name}-{datetime.date.today().isoformat()}"
    out_dir.mkdir(parents=True, exist_ok=True)
    path, n = out_dir / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = out_dir / f"{stem}-{n}.json"
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")  # a killed run leaves the last result whole
    return path


def write_results(result: dict, out_dir: Path) -> tuple[Path, Path | None]:
    json_path = write_result_json(result, out_dir, "speculative" if result["summary"] else "speculative-sweep")
    return json_path, plot_sweep(result, Path(out_dir) / f"speedup-vs-n-{datetime.date.today().isoformat()}.png")
