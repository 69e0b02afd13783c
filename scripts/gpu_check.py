"""GPU check: one short run that decides whether the GPU paths work, block by block.

    bash scripts/gpu_check.sh                   (an NVIDIA GPU, CUDA PyTorch; TensorRT optional)
    python scripts/gpu_check.py --device cpu    (the CPU fallback: the same blocks, no graphs)

Every block ends in one line, PASS, FAIL or SKIP (with the reason); an exception inside a block
is that block's FAIL (its message printed), never a pass; the exit status is 1 if any block
failed. Blocks:

    env         GPU, SM, driver, torch and CUDA, TensorRT / TensorRT-RTX (or absent), TF32 state
    accuracy    per backend x {eager, graphs}: max |logit difference| against the CPU float32
                reference at prefill and at Q = 1, 5, 17 after it (same cache state), the smallest
                top-1/top-2 margin of the reference, and top-1 agreement wherever that margin is
                over twice the difference seen (where rounding cannot decide, it is not counted)
    graphs      captures counted; a replay equals the eager step on identical inputs, again after
                another shape was captured, and after a switch to another cache (a new capture)
    speed       per step at Q = 1 and 17: GPU time (CUDA events) and wall time, eager and graphs;
                plain decoding tokens/s with and without graphs
    generation  greedy speculative output (suffix draft) == plain, and a continuous batch's
                answers == each prompt's answer alone, with graphs
    tensorrt    the same accuracy and graph blocks for a TensorRT engine exported and built here,
                where full TensorRT is installed (TensorRT-RTX does not run on SM80/SM90 GPUs)
    memory      peak GPU memory

Uses the default model when `models/SmolLM2-135M-Instruct` exists, else random weights with its
exact config (the same shapes and costs; token ids instead of text). Writes JSON to $OUT (else
bench/results/ on a GPU, /tmp on the CPU).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specrt.artifacts import package_versions  # noqa: E402
from specrt.export.config import ModelConfig  # noqa: E402
from specrt.export.llama import LlamaModel  # noqa: E402
from specrt.runtime.backends import TorchBackend  # noqa: E402
from specrt.runtime.batching import BatchEngine, Request  # noqa: E402
from specrt.runtime.drafts import make_proposer  # noqa: E402
from specrt.runtime.generator import Generator  # noqa: E402
from specrt.runtime.session import StepSession  # noqa: E402
from specrt.runtime.speculative import SpeculativeDecoder, make_policy  # noqa: E402

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
TOLERANCE = 2e-2  # max |logit difference| of a float32 GPU step (TF32 off) against float32 on the CPU
QS = (1, 5, 17)


def load():
    ckpt = ROOT / "models" / "SmolLM2-135M-Instruct"
    if (ckpt / "config.json").is_file():
        from specrt.export.checkpoint import load_model

        return load_model(ckpt), "SmolLM2-135M-Instruct", ckpt
    torch.manual_seed(0)
    model = LlamaModel(ModelConfig.from_hf_dict(SMOLLM2))
    with torch.no_grad():  # spread-out logits (margins well above rounding) from random weights
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.05 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return model.eval(), "random weights, SmolLM2-135M config", None


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    base = [int(t) for t in rng.integers(3, vocab, 40)]
    return [base * 3, [int(t) for t in rng.integers(3, vocab, 64)], base[:20] * 4]


class Report:
    """Blocks with one verdict each; a block that raises is a FAIL with its message."""

    def __init__(self):
        self.blocks: dict[str, dict] = {}

    def run(self, name: str, fn, *args):
        t0 = time.perf_counter()
        try:
            verdict, details = fn(*args)
        except Exception as e:  # noqa: BLE001 - an error is this block's failure, reported, not raised
            verdict = "FAIL"
            details = {"error": f"{type(e).__name__}: {e}", "where": traceback.format_exc().strip().splitlines()[-3:]}
        details["seconds"] = round(time.perf_counter() - t0, 1)
        self.blocks[name] = {"verdict": verdict, **details}
        reason = details.get("reason") or details.get("error") or ""
        print(f"[{verdict:<4}] {name}{': ' + reason if reason else ''}  ({details['seconds']} s)", flush=True)
        for line in details.get("lines", []):
            print(f"         {line}")
        return verdict, details

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
        info.update(gpu="none (CPU fallback)")
    lines = [", ".join(f"{k} {v}" for k, v in info.items())]
    return "PASS", {"info": info, "lines": lines}


def _version(flavour: str) -> str:
    import importlib

    try:
        return importlib.import_module({"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}[flavour]).__version__
    except Exception:  # noqa: BLE001
        return "?"


def _driver() -> str:
    try:
        import subprocess

        return subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "nvidia-smi not found"


# -- accuracy ---------------------------------------------------------------------------------------


def compare_steps(backend, reference, prompt: list[int]) -> list[dict]:
    """Logits of `backend` against `reference` at prefill (every prompt position) and at Q = 1, 5,
    17 new positions after it, each from the same committed cache."""
    a, b = StepSession(backend), StepSession(reference)
    ca, cb = a.new_cache(1, len(prompt) + 64), b.new_cache(1, len(prompt) + 64)
    rows = [_diff("prefill", a.forward(ca, [prompt]).logits, b.forward(cb, [prompt]).logits)]
    length = int(ca.lengths[0])
    for q in QS:
        new = [(7 * i + 11) % (backend.config.vocab_size - 3) + 3 for i in range(q)]
        rows.append(_diff(f"Q={q}", a.forward(ca, [new]).logits, b.forward(cb, [new]).logits))
        ca.rollback(np.array([length]))
        cb.rollback(np.array([length]))
    a.release(ca)
    return rows


def _diff(where: str, got: np.ndarray, ref: np.ndarray) -> dict:
    got, ref = got[0].astype(np.float64), ref[0].astype(np.float64)  # (positions, V)
    delta = float(np.abs(got - ref).max())
    top2 = np.sort(ref, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    decidable = margin > 2 * delta
    agree = got.argmax(-1) == ref.argmax(-1)
    return {
        "where": where,
        "max_abs_diff": delta,
        "min_margin": float(margin.min()),
        "decidable": int(decidable.sum()),
        "positions": int(len(ref)),
        "top1_agree_decidable": int((agree & decidable).sum()),
        "top1_agree_all": int(agree.sum()),
    }


def accuracy_block(backends: dict, reference, ps):
    rows, ok = {}, True
    lines = [f"{'backend':<16}{'step':<9}{'max |d|':>10}{'min margin':>12}{'top-1 (decidable)':>20}{'top-1 all':>11}"]
    for name, backend in backends.items():
        rows[name] = compare_steps(backend, reference, ps[1])
        for r in rows[name]:
            good = r["max_abs_diff"] < TOLERANCE and r["top1_agree_decidable"] == r["decidable"]
            ok &= good
            lines.append(
                f"{name:<16}{r['where']:<9}{r['max_abs_diff']:>10.2e}{r['min_margin']:>12.2e}"
                f"{r['top1_agree_decidable']:>11}/{r['decidable']:<8}{r['top1_agree_all']:>6}/{r['positions']:<4}"
                f"{'' if good else '  <- FAIL'}"
            )
    return ("PASS" if ok else "FAIL"), {"rows": rows, "lines": lines, "tolerance": TOLERANCE}


# -- graphs -----------------------------------------------------------------------------------------


def graphs_block(make_graphs, make_eager, ps):
    """A graph replay against the eager step on identical inputs: first capture, replay, after
    another shape was captured, and on another cache (which must be captured anew)."""
    g, e = make_graphs(), make_eager()
    sg, se = StepSession(g), StepSession(e)
    prompt = ps[0][:48]
    cg, ce = sg.new_cache(1, 128), se.new_cache(1, 128)
    sg.forward(cg, [prompt])
    se.forward(ce, [prompt])
    length = len(prompt)

    def step(session, cache, tokens):
        out = session.forward(cache, [tokens]).logits
        cache.rollback(np.array([length]))
        return out

    one, five = [11], [12, 13, 14, 15, 16]
    eager1, eager5 = step(se, ce, one), step(se, ce, five)
    checks, counts = {}, [len(g._graphs)]
    first = step(sg, cg, one)
    counts.append(len(g._graphs))
    checks["first capture == eager"] = _close(first, eager1)
    checks["replay == eager"] = _close(step(sg, cg, one), eager1)
    checks["other shape captured == eager"] = _close(step(sg, cg, five), eager5)
    checks["replay after another shape == eager"] = _close(step(sg, cg, one), eager1)
    counts.append(len(g._graphs))
    sg.release(cg)
    other = sg.new_cache(1, 512)  # another buffer: its graphs are captured anew
    sg.forward(other, [prompt])
    out = sg.forward(other, [one]).logits
    checks["another cache == eager"] = _close(out, eager1)
    counts.append(len(g._graphs))
    checks["captures: 1 per shape, again for another cache"] = counts[1] > counts[0] and counts[3] > counts[2]
    lines = [f"{'ok  ' if v else 'FAIL'} {k}" for k, v in checks.items()] + [f"graphs held after each stage: {counts}"]
    return ("PASS" if all(checks.values()) else "FAIL"), {"checks": checks, "graph_counts": counts, "lines": lines}


def _close(a: np.ndarray, b: np.ndarray, tol: float = 1e-3) -> bool:
    return bool(np.abs(a.astype(np.float64) - b.astype(np.float64)).max() < tol)


# -- speed ------------------------------------------------------------------------------------------


def step_times(backend, device: str, q: int, past: int = 512, repeats: int = 20) -> tuple[float, float]:
    """(GPU ms, wall ms) of a step of Q positions after `past` committed ones (medians)."""
    s = StepSession(backend)
    cache = s.new_cache(1, past + 64)
    s.forward(cache, [[(5 + i) % 1000 + 3 for i in range(past)]])
    gpu, wall = [], []
    for _ in range(repeats):
        cache.rollback(np.array([past]))
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        s.forward(cache, [list(range(5, 5 + q))])
        if device == "cuda":
            end.record()
            torch.cuda.synchronize()
            gpu.append(start.elapsed_time(end))
        wall.append((time.perf_counter() - t) * 1e3)
    s.release(cache)
    return (statistics.median(gpu[3:]) if gpu else float("nan")), statistics.median(wall[3:])


def speed_block(backends: dict, device: str, ps):
    rows, lines = {}, [f"{'backend':<16}" + "".join(f"{'Q=' + str(q) + ' gpu/wall ms':>22}" for q in (1, 17))]
    for name, backend in backends.items():
        times = {q: step_times(backend, device, q) for q in (1, 17)}
        gen = Generator(backend)
        gen.eos_ids = frozenset()
        tok_s = statistics.median(gen.generate_ids([ps[1]], 128)[0].decode_tokens_per_second for _ in range(3))
        rows[name] = {"step_ms": {q: {"gpu": g, "wall": w} for q, (g, w) in times.items()}, "decode_tok_s": tok_s}
        lines.append(
            f"{name:<16}" + "".join(f"{g:>12.2f} /{w:>7.2f}" for g, w in times.values()) + f"   {tok_s:.1f} tok/s"
        )
    return "PASS", {"rows": rows, "lines": lines}


# -- generation -------------------------------------------------------------------------------------


def generation_block(make_backend, ps):
    gen = Generator(make_backend())
    gen.eos_ids = frozenset()
    plain = [r.token_ids for r in gen.generate_ids(ps, 64)]
    spec = SpeculativeDecoder(gen, make_proposer("suffix"), make_policy(4))
    checks = {"greedy speculative == plain": [r.token_ids for r in spec.generate_ids(ps, 64)] == plain}
    alone = [gen.generate_ids([p], 24)[0].token_ids for p in ps]
    batched = BatchEngine(gen, max_batch=2).run([Request(p, 24) for p in ps], [0, 0, 3])
    checks["continuous batch == alone"] = [r.token_ids for r in batched] == alone
    lines = [f"{'ok  ' if v else 'FAIL'} {k}" for k, v in checks.items()]
    return ("PASS" if all(checks.values()) else "FAIL"), {"checks": checks, "lines": lines}


# -- TensorRT ---------------------------------------------------------------------------------------


def tensorrt_engine(model, ckpt, device: str) -> tuple[Path | None, str]:
    """(engine directory, note): exported and built here for this GPU; None with the reason."""
    from specrt.engines.trt import available_flavours

    if device != "cuda":
        return None, "needs a CUDA GPU"
    flavours = available_flavours()
    if not flavours:
        return None, "neither tensorrt nor tensorrt_rtx is installed"
    cap = torch.cuda.get_device_capability(0)
    if flavours == ["tensorrt-rtx"] and cap[0] * 10 + cap[1] in (80, 90):
        return None, f"only TensorRT-RTX is installed, which does not support SM{cap[0]}{cap[1]}; install tensorrt"
    import tempfile

    from safetensors.torch import save_file

    from specrt.engines.profiles import EngineShapes
    from specrt.engines.trt import TrtBuildSpec, build_trt_engine
    from specrt.export.step_graph import export_step_graph

    tmp = Path(tempfile.mkdtemp(prefix="specrt-gpu-check-"))
    if ckpt is None:  # random weights: write them as a checkpoint to export from
        ckpt = tmp / "ckpt"
        ckpt.mkdir()
        state = {k if k == "lm_head.weight" else "model." + k: v.contiguous() for k, v in model.state_dict().items()}
        if model.cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(ckpt / "model.safetensors"))
        (ckpt / "config.json").write_text(json.dumps(SMOLLM2))
    export_step_graph(ckpt, tmp / "onnx")
    flavour = flavours[0]
    caps = ("CURRENT",) if flavour == "tensorrt-rtx" else ()
    shapes = EngineShapes(max_batch=3, max_context=1024)
    build_trt_engine(
        tmp / "onnx", tmp / "engine", TrtBuildSpec(flavour=flavour, shapes=shapes, compute_capabilities=caps)
    )
    return tmp / "engine", flavour


# -- main -------------------------------------------------------------------------------------------


def main() -> int:
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible to torch (torch.cuda.is_available() is False); nothing to check")
        return 2
    report = Report()
    report.run("env", env_block, device)
    model, what, ckpt = load()
    print(f"model: {what}", flush=True)
    reference = TorchBackend(model)  # float32 on the CPU
    dev_model = LlamaModel(model.cfg).eval()
    dev_model.load_state_dict(model.state_dict())
    ps = prompts(model.cfg.vocab_size)

    def torch_backend(graphs: bool):
        backend = TorchBackend(dev_model, device=device, cuda_graphs=graphs)
        if device == "cpu":  # the device-resident cache path, as on a GPU
            backend.caps = dataclasses.replace(backend.caps, cache_device="cpu")
        return backend

    modes = (False, True) if device == "cuda" else (False,)
    backends = {f"torch{' graphs' if g else ''}": torch_backend(g) for g in modes}
    report.run("accuracy", accuracy_block, backends, reference, ps)
    if device == "cuda":
        report.run("graphs", graphs_block, lambda: torch_backend(True), lambda: torch_backend(False), ps)
    else:
        report.blocks["graphs"] = {"verdict": "SKIP", "reason": "CUDA graphs need a GPU"}
        print("[SKIP] graphs: CUDA graphs need a GPU")
    report.run("speed", speed_block, backends, device, ps)
    report.run("generation", generation_block, lambda: torch_backend(device == "cuda"), ps)

    def tensorrt():
        engine, note = tensorrt_engine(model, ckpt, device)
        if engine is None:
            return "SKIP", {"reason": note}
        from specrt.runtime.backends import TrtBackend

        trt_backends = {f"{note}{' graphs' if g else ''}": TrtBackend(engine, cuda_graphs=g) for g in (False, True)}
        verdict, details = accuracy_block(trt_backends, reference, ps)
        g_verdict, g_details = graphs_block(
            lambda: TrtBackend(engine, cuda_graphs=True), lambda: TrtBackend(engine, cuda_graphs=False), ps
        )
        s_verdict, s_details = speed_block(trt_backends, device, ps)
        capture_failures = [f for b in trt_backends.values() for f in b.capture_failures]
        lines = details["lines"] + g_details["lines"] + s_details["lines"]
        lines += [f"capture failures: {capture_failures}"] if capture_failures else []
        ok = verdict == g_verdict == "PASS"
        return ("PASS" if ok else "FAIL"), {"accuracy": details, "graphs": g_details, "lines": lines}

    report.run("tensorrt", tensorrt)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
        report.blocks["memory"] = {"verdict": "PASS", "peak_mib": round(peak, 1)}
        print(f"[PASS] memory: peak {peak:.0f} MiB allocated by torch")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "model": what,
        "versions": package_versions("torch", "numpy"),
        "blocks": report.blocks,
    }
    out = Path(os.environ.get("OUT") or (ROOT / "bench" / "results" if device == "cuda" else "/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu-check-{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"gpu_check.py: {'FAIL' if report.failed else 'PASS'} ({path})")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
