"""Exact by construction, and then fast: each engine with the step floor (bitwise) and without it
(near-ties), plain and `--draft auto`, side by side in one run.

    .venv/bin/python bench/bench_exact.py --artifacts artifacts/SmolLM2-135M-Instruct \
        --model models/SmolLM2-135M-Instruct [--genai-python /path/to/venv/bin/python] \
        [--exact-prompts 200 --exact-tokens 256 --exact-engines "gguf-a8 bitwise,gguf-a8 near-ties"]
        [--exact-from 60]

Engines: float32, gguf (the GGUF's own blocks, float32 activations), gguf-a8 (the same blocks,
int8 activations), int8-a8, int4 and int4-a8 (ORT's integer kernels), each run bitwise (every
step computes at least two positions per row, a one-position step's second one carrying a free
guess) and near-ties (one-position steps as they are); an engine is built when missing. Every
measurement runs the engines in turn, repeat after repeat, so machine noise hits them alike;
medians are reported, and each mode's run over the plain run beside it (the same repeat and
prompt), median [min-max]: a ratio read run by run, as the machine's state changes between repeats.

  decode    plain greedy and --draft auto (and --draft-model: the draft model alone and auto
            with it; --head: a trained head alone and auto with it), tokens/s end to end per prompt class of
            bench/prompts.jsonl (up to EOS or --new-tokens), plain's decode steps alone (as
            onnxruntime-genai's figure, which runs --new-tokens ignoring EOS), and plain's tokens
            per step (the guesses)
  exact     greedy --draft auto against plain on the same engine and setting, over
            --exact-prompts made here (training/prompts.py, seed 7, none of the benchmark's) x
            --exact-tokens: the prompts whose tokens are bitwise equal (--exact-from K starts at
            prompt K, extending an earlier run; Ctrl-C or kill ends this part and keeps what it checked)
  steps     each engine's step cost by positions, as its build measured it (ms)
  anchor    onnxruntime-genai's int4 graph (round-to-nearest int4, int8 activations), with
            --genai-python: its decode tokens/s beside the others
  peer      llama.cpp's llama-server on the GGUF itself, with --llama-server: plain, its n-gram
            speculative modes and its draft model (--llama-modes, --llama-draft), end to end and
            decode tokens/s (bench/llamacpp_peer.py); a speculative mode on a fresh server for each
            generation, as ours get a fresh draft (its n-gram cache keeps earlier answers: a
            repeat of a prompt copied its own answer, 57 against 13 tokens/s)

Table on stdout, JSON in bench/results/exact-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import time
from pathlib import Path

from bench_fused import build_genai_model, genai_runs

from specrt.benchmark import write_result_json
from specrt.engines.build import BuildSpec, build_all
from specrt.layout import ArtifactLayout
from specrt.runtime.generator import Generator
from specrt.runtime.sampling import SamplingParams

from harness import envelope

SCHEMES = {
    "float32": "none",
    "gguf": "gguf",
    "gguf-a8": "gguf-a8",
    "gguf-k": "gguf-k",  # the GGUF's blocks on specrt's own kernel (int8 activations)
    "int4": "int4",
    "int8-a8": "int8-a8",
    "int4-a8": "int4-a8",
}
SETTINGS = ("bitwise", "near-ties")
DEFAULT_ENGINES = ",".join(f"{n} {s}" for n in ("float32", "gguf", "gguf-a8") for s in SETTINGS)


def encode(gen, row: dict, chat: bool) -> list[int]:
    """A prompt row's ids: "prompt" (one user message), or "messages" (a conversation so far,
    in the model's chat template: the multi-turn class)."""
    if "messages" not in row:
        return gen.encode_prompt(row["prompt"], chat=chat)
    return gen.tokenizer.encode(gen.tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True))


def runners(gen, draft_model: Path | None = None, head: Path | None = None):
    """plain, --draft auto and, given a draft model's engine, --draft draft-model and auto with
    it, given a trained head's directory, the head alone (--draft <its method>) and auto with it
    (N by the cost model): fresh ones each call (a draft's index keeps what it saw)."""
    from specrt.engines.head import head_method
    from specrt.runtime.drafts import make_proposer
    from specrt.runtime.speculative import SpeculativeDecoder, make_policy

    out = {"plain": gen, "auto": SpeculativeDecoder(gen, make_proposer("auto"), make_policy("auto"))}
    if draft_model is not None:
        proposer = make_proposer("draft-model", draft_dir=draft_model, target=gen.session.caps)
        out["draft-model"] = SpeculativeDecoder(gen, proposer, make_policy("auto"))
        with_model = make_proposer("auto", draft_dir=draft_model, target=gen.session.caps)
        out["auto+draft-model"] = SpeculativeDecoder(gen, with_model, make_policy("auto"))
    if head is not None:
        caps = gen.session.caps
        alone = make_proposer(head_method(head), draft_dir=head, target=caps)
        out["head"] = SpeculativeDecoder(gen, alone, make_policy("auto"))
        with_head = make_proposer("auto", draft_dir=head, target=caps)
        out["auto+head"] = SpeculativeDecoder(gen, with_head, make_policy("auto"))
    return out


def timed(runner, ids: list[int], n: int, sampling: SamplingParams):
    t0 = time.perf_counter()
    r = runner.generate_ids([ids], n, sampling)[0]
    return r, len(r.token_ids) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True, help="The checkpoint (its GGUF origin gives the blocks).")
    ap.add_argument("--prompts", type=Path, default=Path(__file__).with_name("prompts.jsonl"))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="Sample at this temperature (seeded per repeat and prompt, the same seed for every mode) instead of "
        "greedy; sampled answers differ between modes, so their equality is not counted.",
    )
    ap.add_argument(
        "--chi-square",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="Also sample the first two tokens of the story prompt ROUNDS x 8 times through the draft model "
        "(else the head, else auto) at --temperature (0.7 when greedy) and test them against the target's exact "
        "joint (bench/sampled_check.py).",
    )
    ap.add_argument("--exact-prompts", type=int, default=40)
    ap.add_argument("--exact-tokens", type=int, default=256)
    ap.add_argument(
        "--exact-from",
        type=int,
        default=0,
        help="Start the exactness prompts at this index of the same seed-7 set (the set is the same "
        "whatever its length, so a run can extend an earlier one: --exact-from 60 with =200 runs 60-199).",
    )
    ap.add_argument(
        "--exact-engines",
        default="float32 bitwise,gguf bitwise,gguf-a8 bitwise,gguf-a8 near-ties",
        help="Comma-separated engine settings (ENGINE SETTING[=PROMPTS], default --exact-prompts) whose exactness "
        "is counted.",
    )
    ap.add_argument(
        "--engines",
        default=DEFAULT_ENGINES,
        help=f"Comma-separated engine settings (ENGINE SETTING) run side by side; engines: {', '.join(SCHEMES)}; "
        "settings: bitwise, near-ties (each engine is built when missing).",
    )
    ap.add_argument("--genai-python", default=None, help="A Python with onnxruntime-genai: the anchor.")
    ap.add_argument(
        "--genai-checkpoint",
        type=Path,
        default=None,
        help="--genai-python: the float32 checkpoint its builder reads (default --model; a GGUF-backed model "
        "needs `specrt convert --weights float32`).",
    )
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary: a peer on the GGUF.")
    ap.add_argument("--gguf", type=Path, default=None, help="--llama-server: the GGUF (default: the checkpoint's).")
    ap.add_argument("--llama-draft", type=Path, default=None, help="--llama-modes draft-simple: the draft's GGUF.")
    ap.add_argument(
        "--draft-model", type=Path, default=None, help="A draft model's ORT engine: --draft draft-model too."
    )
    ap.add_argument(
        "--head", type=Path, default=None, help="A trained head's directory: the head alone and --draft auto with it."
    )
    ap.add_argument(
        "--llama-modes", default="plain,ngram-simple,ngram-mod", help="--llama-server: plain and n-gram spec types."
    )
    ap.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Apply the chat template to the prompts (--no-chat: a pretrained model's plain text).",
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    args = ap.parse_args()

    from specrt.training.prompts import build_prompt_set

    engines = [tuple(e.split()) for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if len(e) != 2 or e[0] not in SCHEMES or e[1] not in SETTINGS]
    if bad:
        ap.error(
            f"--engines: {bad} are not ENGINE SETTING pairs (engines {', '.join(SCHEMES)}; settings bitwise, near-ties)"
        )
    # checked before the builds and the timed runs: an error at their end would lose them
    wanted = [e.strip().partition("=") for e in args.exact_engines.split(",") if e.strip()]
    counts = {name.strip(): int(n) if n else args.exact_prompts for name, _, n in wanted}
    unknown = sorted(set(counts) - {f"{n} {s}" for n, s in engines})
    if unknown:
        ap.error(f"--exact-engines {unknown} are not among --engines")
    if not 0 <= args.exact_from < min(counts.values(), default=1):
        ap.error(f"--exact-from {args.exact_from} must lie in 0 to the smallest prompt count minus 1")
    for scheme in sorted({SCHEMES[n] for n, _ in engines}):
        for line in build_all(BuildSpec(checkpoint=args.model, out=args.artifacts, quantize=scheme, tensorrt="off")):
            print(line, file=sys.stderr)
    layout = ArtifactLayout(args.artifacts)
    gens = {}
    for name, setting in engines:
        gens[f"{name} {setting}"] = Generator.from_engine(
            layout.ort_engine("cpu", SCHEMES[name]), args.model, exact=setting
        )
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    classes = sorted({r["class"] for r in rows})
    ref = next(iter(gens.values()))
    encoded = [(r["class"], encode(ref, r, args.chat)) for r in rows]
    peers = contextlib.ExitStack()
    servers = {}
    if args.llama_server:
        from llamacpp_peer import LlamaServer

        from specrt.export.gguf import gguf_origin

        gguf = args.gguf or gguf_origin(args.model)
        for mode in args.llama_modes.split(","):
            draft = args.llama_draft if mode == "draft-simple" else None
            servers[mode] = peers.enter_context(LlamaServer(args.llama_server, gguf, mode, draft=draft))
    llama = {m: {c: [] for c in classes} for m in servers}
    llama_decode = {m: {c: [] for c in classes} for m in servers}
    llama_drafts = {m: [0, 0] for m in servers}
    genai_dir = None
    if args.genai_python:
        genai_dir = build_genai_model(
            args.genai_python,
            args.genai_checkpoint or args.model,
            args.artifacts.with_name(f"{args.artifacts.name}-genai-int4-cpu"),
        )

    modes = (
        ("plain", "auto")
        + (("draft-model", "auto+draft-model") if args.draft_model else ())
        + (("head", "auto+head") if args.head else ())
    )
    accepted = {n: {m: [0, 0, 0] for m in modes[1:]} for n in gens}  # drafted, accepted, steps
    decode = {n: {m: {c: [] for c in classes} for m in modes} for n in gens}
    plain_decode = {n: {c: [] for c in classes} for n in gens}  # decode steps only (as genai's figure)
    per_step = {n: [] for n in gens}  # plain decoding's tokens per step
    equal_bench = {n: [0, 0] for n in gens}
    genai = {c: [] for c in classes}
    run = {n: runners(g) for n, g in gens.items()}
    for rep in range(args.repeats):
        print(f"repeat {rep + 1}/{args.repeats}", file=sys.stderr)
        for i, (cls, ids) in enumerate(encoded):
            sampling = SamplingParams(temperature=args.temperature, seed=1000 * rep + i)  # 0: greedy
            for name in gens:
                plain, tok_s = timed(run[name]["plain"], ids, args.new_tokens, sampling)
                decode[name]["plain"][cls].append(tok_s)
                plain_decode[name][cls].append(plain.decode_tokens_per_second)
                per_step[name].append(len(plain.token_ids) / (1 + len(plain.step_seconds)))
                # a fresh draft each time: the suffix index keeps earlier outputs, and a repeat of
                # this prompt would copy its own earlier answer
                fresh = runners(gens[name], args.draft_model, args.head)
                for mode in modes[1:]:
                    spec, tok_s = timed(fresh[mode], ids, args.new_tokens, sampling)
                    decode[name][mode][cls].append(tok_s)
                    if args.temperature == 0:
                        equal_bench[name][0] += spec.token_ids == plain.token_ids
                        equal_bench[name][1] += 1
                    m = spec.metrics
                    accepted[name][mode] = [
                        a + b for a, b in zip(accepted[name][mode], (m.drafted_tokens, m.accepted_tokens, m.steps))
                    ]
        for mode, server in servers.items():
            for i, (cls, ids) in enumerate(encoded):
                sample = (args.temperature, 1000 * rep + i)
                if mode == "plain":
                    r = server.complete(ids, args.new_tokens, *sample)
                else:  # a fresh server: its n-gram cache keeps earlier answers (a repeat would copy its own)
                    with LlamaServer(args.llama_server, gguf, mode, draft=server.draft) as fresh:
                        r = fresh.complete(ids, args.new_tokens, *sample)
                llama[mode][cls].append(r["tok_s"])
                llama_decode[mode][cls].append(r["decode_tok_s"])
                llama_drafts[mode][0] += r["drafted"]
                llama_drafts[mode][1] += r["accepted"]
        if genai_dir:
            got = genai_runs(args.genai_python, genai_dir, [ids for _, ids in encoded], args.new_tokens)
            for (cls, _), r in zip(encoded, got["runs"]):
                genai[cls].append(r["decode_tok_s"])

    made = build_prompt_set(
        max(counts.values(), default=0), seed=7, exclude=tuple(r["prompt"] for r in rows if "prompt" in r)
    )
    all_ids = [ref.encode_prompt(p.prompt, chat=args.chat) for p in made]
    for g in gens.values():
        g.eos_ids = frozenset()  # every exactness run generates its --exact-tokens
    exact = {}
    stopped = False  # Ctrl-C or `kill` ends the exactness runs; what they checked is still written
    # a job started in the background inherits SIGINT ignored: set both signals to raise here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    for name, count in counts.items():
        t0, same, done, first = time.perf_counter(), 0, 0, []
        try:
            for i, ids in enumerate(all_ids[args.exact_from : count], start=args.exact_from):
                plain = run[name]["plain"].generate_ids([ids], args.exact_tokens)[0].token_ids
                spec = run[name]["auto"].generate_ids([ids], args.exact_tokens)[0].token_ids
                same, done = same + (plain == spec), done + 1
                if plain != spec:
                    first.append([i, next(k for k, (a, b) in enumerate(zip(plain, spec)) if a != b)])
                print(f"exact {name}: prompt {i + 1}/{count}, {same}/{done} equal", file=sys.stderr, end="\r")
        except KeyboardInterrupt:
            stopped = True
        print(file=sys.stderr)
        exact[name] = {
            "equal": same,
            "prompts": done,
            "prompt_ids": [args.exact_from, args.exact_from + done],  # [first, end) of the seed-7 set
            "tokens": args.exact_tokens,
            "first_difference_at": first,  # [prompt id, token index]
            "seconds": round(time.perf_counter() - t0, 1),
        }
        if stopped:
            exact[name]["stopped_early"] = True
            break

    chi = None
    if args.chi_square:
        from sampled_check import two_token_check

        name = next(iter(gens))
        checked = "draft-model" if args.draft_model else "head" if args.head else "auto"
        story = next((ids for cls, ids in encoded if cls == "story"), encoded[0][1])
        print(f"chi-square: {checked} on {name}, {args.chi_square} rounds", file=sys.stderr)
        chi = {"engine": name, "draft": checked, "prompt_class": "story"}
        chi |= two_token_check(
            gens[name],
            runners(gens[name], args.draft_model, args.head)[checked],
            story,
            args.chi_square,
            8,  # rows a round: 48 grew the process past 24 GB here (ORT's arenas, not its caches)
            args.temperature or 0.7,
        )

    med = statistics.median
    result = {
        **envelope("onnxruntime", "onnx", threads="ORT default (one per physical core)"),
        "settings": {
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "temperature": args.temperature,
            "prompts": len(encoded),
            "exact_prompts": counts,
            "exact_tokens": args.exact_tokens,
            "exact_from": args.exact_from,
            "chat": args.chat,
            "model": str(args.model),
            "draft_model": str(args.draft_model) if args.draft_model else None,
            "head": str(args.head) if args.head else None,
        },
        "decode_tok_s": {
            n: {m: {c: round(med(v), 1) for c, v in by.items()} for m, by in ms.items()} for n, ms in decode.items()
        },
        # each mode's run over the plain run of the same repeat and prompt (run side by side: the
        # machine's state changes between repeats more than between neighbours), median [min, max]
        "over_plain_paired": {
            n: {m: {c: paired(v, ms["plain"][c]) for c, v in by.items()} for m, by in ms.items() if m != "plain"}
            for n, ms in decode.items()
        },
        "runs_tok_s": {
            n: {m: {c: [round(x, 2) for x in v] for c, v in by.items()} for m, by in ms.items()}
            for n, ms in decode.items()
        },
        "plain_decode_tok_s": {n: {c: round(med(v), 1) for c, v in by.items()} for n, by in plain_decode.items()},
        "plain_tokens_per_step": {n: round(med(v), 3) for n, v in per_step.items()},
        # drafted tokens the target accepted, and tokens a verification step yields (accepted + 1)
        "acceptance": {
            n: {
                m: {"rate": round(a / max(d, 1), 3), "tokens_per_step": round((a + s) / max(s, 1), 2)}
                for m, (d, a, s) in by.items()
            }
            for n, by in accepted.items()
        },
        "auto_equal_plain_bench_prompts": {n: f"{a}/{b}" for n, (a, b) in equal_bench.items()},
        "exact": exact,
        "chi_square": chi,
        "step_ms_at_build": {n: g.backend.caps.step_ms for n, g in gens.items() if n.endswith("bitwise")},
        "exactness": {n: g.session.exactness() for n, g in gens.items()},
    }
    peers.close()
    for mode in servers:
        result["decode_tok_s"][f"llama-server {mode}"] = {
            "plain": {c: round(med(v), 1) for c, v in llama[mode].items()}
        }
        result["plain_decode_tok_s"][f"llama-server {mode}"] = {
            c: round(med(v), 1) for c, v in llama_decode[mode].items()
        }
        result.setdefault("llama_server_drafts", {})[mode] = dict(zip(("drafted", "accepted"), llama_drafts[mode]))
    if servers:
        result["anchor_llama_server"] = {"binary": str(args.llama_server), "modes": list(servers)}
    if genai_dir:
        result["decode_tok_s"]["onnxruntime-genai int4"] = {"plain": {c: round(med(v), 1) for c, v in genai.items()}}
        result["anchor"] = {"onnxruntime_genai": got["version"], "peak_rss_mib": got.get("peak_rss_mib")}
    print_table(result, classes)
    print(f"wrote {write_result_json(result, args.out, 'exact')}")


def paired(runs: list[float], plain: list[float]) -> list[float]:
    """Run i over plain run i: the median and the extremes."""
    ratios = [a / b for a, b in zip(runs, plain)]
    return [round(statistics.median(ratios), 3), round(min(ratios), 3), round(max(ratios), 3)]


def print_table(result: dict, classes: list[str]) -> None:
    print(f"\n{'engine':24s} {'mode':11s} " + " ".join(f"{c:>13s}" for c in classes))
    for n, ms in result["decode_tok_s"].items():
        for m, by in ms.items():
            print(f"{n:24s} {m:11s} " + " ".join(f"{by.get(c, float('nan')):13.1f}" for c in classes))
    print("\nover plain, run by run beside it: median [min-max]")
    for n, ms in result.get("over_plain_paired", {}).items():
        for m, by in ms.items():
            cells = (f"{by[c][0]:.2f} [{by[c][1]:.2f}-{by[c][2]:.2f}]" if c in by else "-" for c in classes)
            print(f"{n:24s} {m:11s} " + " ".join(f"{x:>17s}" for x in cells))
    print("\nplain tokens per step (free guesses):", result["plain_tokens_per_step"])
    print("speculative == plain on the benchmark prompts:", result["auto_equal_plain_bench_prompts"])
    print("acceptance:", result["acceptance"])
    for n, e in result["exact"].items():
        lo, hi = e.get("prompt_ids", (0, e["prompts"]))
        print(
            f"exact {n:22s} {e['equal']}/{e['prompts']} prompts (ids {lo}-{hi - 1}) x {e['tokens']} tokens"
            " bitwise equal" + (" (stopped early)" if e.get("stopped_early") else "")
        )
    if result.get("chi_square"):
        c = result["chi_square"]
        print(
            f"chi-square ({c['draft']}, T={c['temperature']}): p = {c['p_value']:.3f} over {c['samples']} samples in "
            f"{c['cells']} cells, {c['accepted']}/{c['drafted']} drafted tokens accepted"
        )
    print("\nstep ms at build (positions: ms)")
    for n, s in result["step_ms_at_build"].items():
        print(f"{n:24s} " + "  ".join(f"{q}: {ms}" for q, ms in s.items()))


if __name__ == "__main__":
    main()
