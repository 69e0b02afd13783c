"""GPU check: one short run that decides whether the GPU paths work and what they cost.

    bash scripts/gpu_check.sh                           the one command on a GPU machine
    python scripts/gpu_check.py --device cpu [--tiny]   the CPU mode: every block that needs no GPU
    python scripts/gpu_check.py --blocks greedy,generation  a rerun of chosen blocks (env always runs)

Each block ends in one verdict line: PASS or FAIL (a check that can fail), INFO (a measurement),
SKIP (with the reason). An exception inside a block is that block's FAIL, with its first
traceback printed whole; after a CUDA error that leaves the context unusable (a sticky error)
the remaining GPU blocks are skipped, not run into the same error. The JSON (`gpu-check.json`)
and the log (`gpu-check.log`) are written to the output folder (--out, else $OUT, else
bench/results/gpu-check-DATE on a GPU and a temporary folder on the CPU) after every block, so a
run cut short keeps what it measured. The exit status is 1 if a block failed.

Blocks, in order (the decisive ones first; the speed blocks stop at the time budget):

    env         INFO  GPU, SM, driver, torch and CUDA, TensorRT / TensorRT-RTX or absent, TF32
    accuracy    PASS/FAIL  logits against float64 on the CPU, float32 and bfloat16, eager and
                graphs, within 8x the CPU's own difference in that dtype (measured: a TF32 run
                fails it; gpu_blocks.py)
    exact       INFO  which step shapes give bitwise the same logits, float32 and bfloat16, eager
                and graphs, under the backend's rule and other padding rules, and the row counts
                a product of the model's shape agrees over (gpu_exact.py; on the CPU: PASS/FAIL)
    bitwise     PASS/FAIL  what the README claims: greedy output bitwise (tokens and log
                probabilities) batched (8 rows), speculative (suffix on repeated requests, n-gram;
                drafted, accepted and guessed tokens recorded; none accepted is a FAIL) and
                prefix-cached, bfloat16 eager and graphs (gpu_bitwise.py)
    graphs      PASS/FAIL  capture counts exactly [0, 1, 2, 3] (a short prefill chunk not
                captured), replays == eager, a first generation captures, a second nothing
    syncs       PASS/FAIL  host syncs of a decode, a verification, a sampled and a feature step,
                each exactly what it reads back (through graphs on a GPU; host reads counted in
                the CPU mode)
    greedy      PASS/FAIL  3 prompts x 48 greedy tokens against the CPU at batch 1 (eager,
                graphs) and batch 3 (graphs); a mismatch names its index and margin, and
                passes as a near tie only under twice the measured GPU-vs-CPU logit difference
    generation  PASS/FAIL  float32: greedy speculative == plain, continuous batch == alone (near
                ties under twice the backend's measured decode-vs-verification difference pass)
    scale       INFO  Llama-3.1-8B's shapes, random bfloat16 weights made on the device: step time
                over batch x positions, eager and graphs, and the speedup the accepted lengths
                measured on the CPU would give, measured and as the cost model predicts it
                (gpu_scale.py)
    decode      INFO  tokens/s and speedup over plain, plain / suffix / n-gram, batch 1, 4, 16, 64,
                eager and graphs, and where speculation stops paying; FAIL if a graph is captured
                while timing or speculative tokens differ from plain's
    sweep       INFO  wall / GPU / host ms per step, batch 1-16 x positions 1-33, eager and graphs,
                each timing the step the runtime runs (the floor's padding included)
    tensorrt    PASS/FAIL/SKIP  accuracy and graphs of a TensorRT engine built here, where installed
    memory      INFO  peak GPU memory

Uses the default model when `models/SmolLM2-135M-Instruct` exists, else random weights with its
exact config (the same shapes and costs; token ids instead of text), tilted to copy: the
embeddings large beside the layers, so a token tends to repeat and runs of one token switch
now and then (drafts are accepted and rejected). --tiny: a tiny config (CI). The JSON records
the commit (git, else $SPECRT_COMMIT) and the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_bitwise  # noqa: E402
import gpu_blocks as blocks  # noqa: E402
import gpu_exact  # noqa: E402
import gpu_scale  # noqa: E402
import gpu_sweep as speed  # noqa: E402
import gpu_trt  # noqa: E402

from specrt.artifacts import package_versions, source_commit  # noqa: E402
from specrt.export.llama import LlamaModel  # noqa: E402
from specrt.runtime.backends import TorchBackend  # noqa: E402
from specrt.schema.config import ModelConfig  # noqa: E402

SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TINY = {**SMOLLM2, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
TINY.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# random weights: layers and norms as below, embeddings this much larger (measured on the SmolLM2
# config: at 2.0 a position's argmax is its own token about 60 % of the time, greedy output runs of
# one token with switches; at 0.05 never, and no draft is accepted; at 4.0 always)
EMBED_STD = 2.0


def load(tiny: bool):
    ckpt = ROOT / "models" / "SmolLM2-135M-Instruct"
    if not tiny and (ckpt / "config.json").is_file():
        from specrt.export.checkpoint import load_model

        return load_model(ckpt), "SmolLM2-135M-Instruct", ckpt
    torch.manual_seed(0)
    model = LlamaModel(ModelConfig.from_hf_dict(TINY if tiny else SMOLLM2))
    with torch.no_grad():  # spread-out logits (margins well above rounding) from random weights
        for name, p in model.named_parameters():
            std = EMBED_STD if "embed" in name and not tiny else 0.05
            p.copy_(1.0 + 0.05 * torch.randn_like(p) if "norm" in name else std * torch.randn_like(p))
    return model.eval(), f"random weights, {'a tiny' if tiny else 'SmolLM2-135M'} config (copying)", None


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    base = [int(t) for t in rng.integers(3, vocab, 40)]
    return [base * 3, [int(t) for t in rng.integers(3, vocab, 64)], base[:20] * 4]


def cuda_broken() -> bool:
    """Whether the CUDA context is unusable (a sticky error: every later call fails the same way)."""
    try:
        torch.cuda.synchronize()
        return False
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return True


BLOCKS = (
    "env",
    "accuracy",
    "exact",
    "bitwise",
    "graphs",
    "syncs",
    "greedy",
    "generation",
    "scale",
    "decode",
    "sweep",
    "tensorrt",
    "memory",
)


class Report:
    """Blocks with one verdict each, saved (JSON and log) after every block; `only`: the blocks
    asked for (--blocks; the others are SKIP), None for all."""

    def __init__(self, out: Path, meta: dict, only: set[str] | None = None):
        self.out, self.meta, self.blocks, self.only = out, meta, {}, only
        self.sticky: str | None = None  # the block whose CUDA error broke the context
        self.traceback_shown = False
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "gpu-check.log", "a", buffering=1)

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")

    def run(self, name: str, fn, *args, gpu: bool = True):
        if self.only is not None and name not in self.only:
            return self.record(name, "SKIP", {"reason": "not asked for (--blocks)"})
        if gpu and self.sticky:
            return self.record(name, "SKIP", {"reason": f"skipped: the CUDA context broke in block {self.sticky}"})
        t0 = time.perf_counter()
        try:
            verdict, details = fn(*args)
        except Exception as e:  # noqa: BLE001 - an error is this block's failure, reported, not raised
            verdict, details = "FAIL", {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            if not self.traceback_shown:
                self.traceback_shown = True
                self.say(details["traceback"].rstrip())
            if torch.cuda.is_available() and cuda_broken():
                self.sticky = name
        details["seconds"] = round(time.perf_counter() - t0, 1)
        return self.record(name, verdict, details)

    def record(self, name: str, verdict: str, details: dict):
        self.blocks[name] = {"verdict": verdict, **details}
        reason = details.get("reason") or details.get("error") or ""
        took = f"  ({details['seconds']} s)" if "seconds" in details else ""
        self.say(f"[{verdict:<4}] {name}{': ' + reason if reason else ''}{took}")
        for line in details.get("lines", []):
            self.say(f"         {line}")
        self.save()
        return verdict, details

    def save(self, **extra) -> Path:
        path = self.out / "gpu-check.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({**self.meta, "blocks": self.blocks, **extra}, indent=2, default=str))
        os.replace(tmp, path)  # a reader never sees half a file
        return path

    @property
    def failed(self) -> bool:
        return any(b["verdict"] == "FAIL" for b in self.blocks.values())


def env_block(device: str):
    from specrt.engines.trt import available_flavours

    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "tensorrt": ", ".join(f"{f} {_version(f)}" for f in available_flavours()) or "absent",
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
    }
    if device == "cuda":
        cap = torch.cuda.get_device_capability(0)
        info.update(gpu=torch.cuda.get_device_name(0), sm=f"SM{cap[0]}{cap[1]}", driver=_driver())
    else:
        info.update(gpu="none (the CPU mode)")
    return "INFO", {"info": info, "lines": [", ".join(f"{k} {v}" for k, v in info.items())]}


def _version(flavour: str) -> str:
    import importlib

    try:
        return importlib.import_module({"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}[flavour]).__version__
    except Exception:  # noqa: BLE001
        return "?"


def _driver() -> str:
    import subprocess

    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "nvidia-smi not found"


def parse(argv):
    p = argparse.ArgumentParser(description="The GPU check (see the module docstring).")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny random model and a small sweep (CI)")
    p.add_argument("--out", help="output folder (default: $OUT, else bench/results/gpu-check-DATE)")
    p.add_argument("--budget", type=float, default=320.0, help="seconds; the speed blocks stop in time for it")
    p.add_argument(
        "--blocks",
        type=_blocks,
        default=None,
        help=f"comma-separated blocks to run (a rerun of a failed one; env always runs): {', '.join(BLOCKS)}",
    )
    return p.parse_args(argv)


def _blocks(value: str) -> set[str]:
    names = {b.strip() for b in value.split(",") if b.strip()}
    unknown = names - set(BLOCKS)
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown blocks {sorted(unknown)}; choose from {', '.join(BLOCKS)}")
    return names | {"env"}


def measured(result: dict) -> str:
    """A speed block's verdict: INFO with its cells, FAIL when it measured nothing (its time
    budget gone before its first cell: a table of nothing is not a measurement)."""
    return "INFO" if any(result["cells"].values()) else "FAIL"


def backend_of(device: str):
    """make_backend(model, graphs): a TorchBackend on `device` (on the CPU its device-resident
    cache path, as on a GPU)."""

    def make(m, graphs: bool):
        b = TorchBackend(m, device=device, cuda_graphs=graphs)
        if device == "cpu":
            b.caps = dataclasses.replace(b.caps, cache_device="cpu")
        return b

    return make


def main(argv=None) -> int:
    args = parse(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible to torch (torch.cuda.is_available() is False); nothing to check")
        return 2
    start = time.perf_counter()
    today = datetime.date.today().isoformat()
    default = ROOT / "bench" / "results" / f"gpu-check-{today}" if device == "cuda" else None
    out = Path(args.out or os.environ.get("OUT") or default or tempfile.mkdtemp(prefix="gpu-check-"))
    model, what, ckpt = load(args.tiny)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": source_commit(),
        "device": device,
        "model": what,
        "versions": package_versions("torch", "numpy"),
    }
    report = Report(out, meta, args.blocks)
    report.say(f"gpu_check: {what} on {device}; commit {meta['commit']}; results in {out}")
    _, env = report.run("env", env_block, device, gpu=False)
    report.meta["gpu"] = env.get("info", {}).get("gpu")
    ps = prompts(model.cfg.vocab_size)
    cuda = device == "cuda"
    modes = ("eager", "graphs") if cuda else ("eager",)

    on_device = backend_of(device)
    models = {}  # one copy of the model per dtype, shared by every backend of it (as one was before)

    def backend(graphs: bool, dtype=torch.float32):
        if dtype not in models:
            models[dtype] = gpu_exact.device_model(model, dtype)
        return on_device(models[dtype], graphs)

    reference = TorchBackend(model)  # float32 on the CPU
    checked = [f"torch {m}" for m in modes]
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}

    def accuracy():
        refs = {"float32": reference, "bfloat16": TorchBackend(gpu_exact.device_model(model, torch.bfloat16))}
        exact = blocks.float64_reference(model)
        runs = {f"torch {d} {m}": (backend(m == "graphs", t), d) for d, t in dtypes.items() for m in modes}
        return blocks.accuracy_block(runs, refs, exact, ps)

    report.run("accuracy", accuracy)
    report.run("exact", gpu_exact.exact_block, model, on_device, device, modes)

    def bitwise():
        # what the README claims: bfloat16, eager and graphs (float32 on a GPU it calls near-ties:
        # cuBLAS's float32 products change with the row count; the exact block measures them)
        runs = [("bfloat16", m) for m in modes]
        verdicts, details = [], {"checks": {}, "runs": {}, "lines": []}
        for d, m in runs:
            label = f"{d} {m}"
            tokens = 24 if args.tiny else gpu_bitwise.TOKENS
            v, got = gpu_bitwise.bitwise_block(lambda: backend(m == "graphs", dtypes[d]), ps, label, tokens=tokens)
            verdicts.append(v)
            details["checks"].update({f"{label}: {k}": ok for k, ok in got["checks"].items()})
            details["runs"][label] = got["runs"]
            details["lines"] += blocks.ok_lines({f"{label}: {k}": ok for k, ok in got["checks"].items() if not ok})
            details["lines"] += got["lines"]
        return ("PASS" if all(v == "PASS" for v in verdicts) else "FAIL"), details

    report.run("bitwise", bitwise)
    if cuda:
        report.run("graphs", blocks.graphs_block, lambda: backend(True), lambda: backend(False), ps)
    else:
        report.record("graphs", "SKIP", {"reason": "needs a CUDA GPU"})
    report.run("syncs", blocks.syncs_block, lambda: backend(cuda), ps)
    runs = [("batch 1, eager", False, 1)] + (
        [("batch 1, graphs", True, 1), ("batch 3, graphs", True, 3)] if cuda else []
    )
    report.run("greedy", blocks.greedy_block, reference, backend, ps, runs)
    report.run("generation", blocks.generation_block, lambda: backend(cuda), ps)
    # what the blocks after each speed block need of the budget
    after = {"scale": 150, "decode": 60, "sweep": 10} if not args.tiny else {"scale": 40, "decode": 20, "sweep": 5}
    least = {"scale": 60, "decode": 30, "sweep": 10}  # seconds each gets however late it starts

    def deadline(block: str) -> float:
        return max(start + args.budget - after[block], time.perf_counter() + least[block])

    def sweep():
        grid = ((1, 2), (1, 3, 9)) if args.tiny else (speed.BATCHES, speed.POSITIONS)
        result = speed.sweep(backend, modes, *grid, deadline=deadline("sweep"))
        return measured(result), {**result, "lines": speed.sweep_lines(result)}

    def decode():
        batches, tokens = ((1, 4), 24) if args.tiny else (speed.DECODE_BATCHES, 64)
        rows = speed.decode_speed(backend, modes, ps, batches, tokens, deadline=deadline("decode"))
        # a graph captured while timing is timed capture, not decoding: the warm-up must cover every shape
        recaptured = [r for r in rows if r["captured"]]
        differ = [r for r in rows if not r["equal"]]
        lines = speed.decode_lines(rows) + [f"captured while timing: {r}" for r in recaptured]
        lines += [f"speculative tokens differ from plain: {r}" for r in differ]
        verdict = "FAIL" if recaptured or differ else "INFO"
        return verdict, {"rows": rows, "crossings": speed.crossings(rows), "lines": lines}

    def scale():
        if not (cuda or args.tiny):
            why = "Llama-3.1-8B's shapes need a GPU (16 GB of bfloat16 weights); --tiny runs the code"
            return "SKIP", {"reason": why}
        config = gpu_scale.LLAMA_8B if cuda else TINY
        big = gpu_scale.random_model(config, device)

        def make(graphs: bool):
            return on_device(big, graphs)

        grid = (gpu_scale.SCALE_BATCHES, gpu_scale.SCALE_POSITIONS) if cuda else ((1, 4), (1, 3, 5))
        result = speed.sweep(make, modes, *grid, deadline=deadline("scale"))
        cells = result["cells"][modes[-1]]
        lengths = gpu_scale.accepted_lengths()
        rows = gpu_scale.oracle(cells, lengths, make(False).caps.floor)
        lines = [f"model: {'Llama-3.1-8B' if cuda else 'tiny'} shapes, random bfloat16 weights"]
        lines += speed.sweep_lines(result) + gpu_scale.oracle_lines(rows)
        if not lengths:
            lines.append(f"FAIL no accepted lengths found under {gpu_scale.RESULTS} ({gpu_scale.ACCEPTED})")
        verdict = measured(result) if lengths else "FAIL"
        return verdict, {**result, "oracle": rows, "lines": lines}

    # the real-size shapes first: what the issue of speed at scale is decided on
    report.run("scale", scale)
    report.run("decode", decode)
    report.run("sweep", sweep)
    if cuda:
        torch.cuda.empty_cache()  # the 8B model's 16 GB back
    flavour, note = gpu_trt.tensorrt_status(device)
    not_checked = {f: note for f in ("tensorrt", "tensorrt-rtx") if f != flavour}
    if flavour is None:
        report.record("tensorrt", "SKIP", {"reason": note})
    else:
        report.run(
            "tensorrt", gpu_trt.tensorrt_block, model, ckpt, TINY if args.tiny else SMOLLM2, flavour, reference, ps
        )
        checked.append(flavour)
        not_checked = {f: f"one flavour is checked, {flavour}" for f in not_checked}

    def memory():
        peak = torch.cuda.max_memory_allocated() / 2**20
        lines = [f"peak {peak:.0f} MiB allocated by torch (the scale block's 8B model included)"]
        return "INFO", {"peak_mib": round(peak, 1), "lines": lines}

    if cuda:
        report.run("memory", memory)
    verdict = "FAIL" if report.failed else "PASS"
    path = report.save(verdict=verdict, checked=checked, not_checked=not_checked)
    skipped = "; ".join(f"{f} ({why})" for f, why in not_checked.items())
    report.say(f"gpu_check.py: {verdict}; checked: {', '.join(checked)}; not checked: {skipped} ({path})")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
