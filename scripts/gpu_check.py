"""GPU check: the PyTorch-CUDA backend with and without CUDA graphs, in one short run.

    bash scripts/gpu_check.sh            (on a machine with an NVIDIA GPU and PyTorch)

Checks greedy speculative output == greedy plain output (with and without graphs, and against
the CPU reference), times one target step at Q = 1..16 and plain decoding tokens/s, with and
without graphs; then the same for a TensorRT engine (exported and built here) where tensorrt or
tensorrt_rtx is installed. Uses the default model when `models/SmolLM2-135M-Instruct` exists, else random
weights with its exact config (same shapes, so the same timings; token ids instead of text).
Prints a table and writes JSON to $OUT (or bench/results/).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specrt.artifacts import package_versions  # noqa: E402
from specrt.export.config import ModelConfig  # noqa: E402
from specrt.export.llama import LlamaModel  # noqa: E402
from specrt.runtime.backends import TorchBackend  # noqa: E402
from specrt.runtime.drafts import make_proposer  # noqa: E402
from specrt.runtime.generator import Generator  # noqa: E402
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


def load():
    ckpt = ROOT / "models" / "SmolLM2-135M-Instruct"
    if (ckpt / "config.json").is_file():
        from specrt.export.checkpoint import load_model

        return load_model(ckpt), "SmolLM2-135M-Instruct", ckpt
    torch.manual_seed(0)
    model = LlamaModel(ModelConfig.from_hf_dict(SMOLLM2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.05 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return model.eval(), "random weights, SmolLM2-135M config", None


def prompts(vocab):
    rng = np.random.default_rng(0)
    base = list(rng.integers(3, vocab, 40))
    return [base * 3, list(rng.integers(3, vocab, 64)), base[:20] * 4]


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def step_ms(gen, q, device, past=512, repeats=20):
    cache = gen.session.new_cache(1, 1024)
    gen.session.forward(cache, [list(range(3, 3 + past))])
    times = []
    for _ in range(repeats):
        cache.rollback(np.array([past]))
        sync(device)
        t = time.perf_counter()
        gen.session.forward(cache, [list(range(5, 5 + q))])
        sync(device)
        times.append(time.perf_counter() - t)
    gen.session.release(cache)
    return statistics.median(times[3:]) * 1e3


def check_tensorrt(model, ckpt, device, measure, batch: int) -> tuple[str, bool | None]:
    """Export, build and run the TensorRT engine (with and without graphs) where TensorRT is
    installed; returns (what happened, passed: None when not checked). The engine is built for
    `batch` rows: measure() runs that many prompts at once."""
    from specrt.engines.trt import available_flavours

    flavours = available_flavours()
    if not flavours or device != "cuda":
        return ("not installed: TensorRT path not checked" if not flavours else "skipped: needs --device cuda"), None
    import tempfile

    from safetensors.torch import save_file

    from specrt.engines.profiles import EngineShapes
    from specrt.engines.trt import TrtBuildSpec, build_trt_engine
    from specrt.export.step_graph import export_step_graph
    from specrt.runtime.backends import TrtBackend

    flavour = flavours[0]
    tmp = Path(tempfile.mkdtemp(prefix="specrt-gpu-check-"))
    if ckpt is None:  # random weights: write them as a checkpoint to export from
        ckpt = tmp / "ckpt"
        ckpt.mkdir()
        state = {k if k == "lm_head.weight" else "model." + k: v.contiguous() for k, v in model.state_dict().items()}
        if model.cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(ckpt / "model.safetensors"))
        (ckpt / "config.json").write_text(json.dumps(SMOLLM2))
    t0 = time.perf_counter()
    try:
        export_step_graph(ckpt, tmp / "onnx")
        caps = ("CURRENT",) if flavour == "tensorrt-rtx" else ()
        build_trt_engine(
            tmp / "onnx",
            tmp / "engine",
            TrtBuildSpec(
                flavour=flavour, shapes=EngineShapes(max_batch=batch, max_context=1024), compute_capabilities=caps
            ),
        )
    except Exception as e:  # report, count as a failure, and go on: the torch results above still stand
        return f"{flavour}: export or build failed: {type(e).__name__}: {e}", False
    built = f"{flavour}: exported and built in {time.perf_counter() - t0:.0f} s"
    for graphs in (False, True):
        try:
            measure(
                f"{flavour}{'+graphs' if graphs else ''}", TrtBackend(tmp / "engine", device="cuda", cuda_graphs=graphs)
            )
        except Exception as e:  # report, count as a failure, and go on
            return f"{built}; running it failed: {type(e).__name__}: {e}", False
    return built, True


def main():
    # --device cpu runs the same flow without graphs: a smoke test of this script on any machine
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible to torch; nothing to check")
        return 2
    model, what, ckpt = load()
    cpu_model = model
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "none (cpu smoke run)",
        "model": what,
        "versions": package_versions("torch", "numpy"),
        "checks": {},
        "step_ms": {},
        "decode_tok_s": {},
    }
    ps = prompts(model.cfg.vocab_size)
    ref = Generator(TorchBackend(cpu_model))
    ref.eos_ids = frozenset()
    expected = [r.token_ids for r in ref.generate_ids(ps[:1], 32)]
    gpu_model = LlamaModel(model.cfg).eval()
    gpu_model.load_state_dict(model.state_dict())

    def measure(name, backend):
        gen = Generator(backend)
        gen.eos_ids = frozenset()
        plain = [r.token_ids for r in gen.generate_ids(ps, 96)]
        spec = [
            r.token_ids
            for r in SpeculativeDecoder(gen, make_proposer("suffix"), make_policy("auto")).generate_ids(ps, 96)
        ]
        result["checks"][f"{name}: greedy speculative == plain"] = spec == plain
        result["checks"][f"{name}: first 32 tokens == CPU reference"] = [p[:32] for p in plain[:1]] == expected
        result["step_ms"][name] = {q: round(step_ms(gen, q, device), 3) for q in (1, 2, 4, 8, 12, 16)}
        runs = [gen.generate_ids([ps[1]], 128)[0].decode_tokens_per_second for _ in range(3)]
        result["decode_tok_s"][name] = round(statistics.median(runs), 1)

    for graphs in (False, True) if device == "cuda" else (False,):
        backend = TorchBackend(gpu_model, device=device, cuda_graphs=graphs)
        if device == "cpu":
            backend.caps = dataclasses.replace(backend.caps, cache_device="cpu")  # the device-cache path, as on a GPU
        measure(f"torch {device}{'+graphs' if graphs else ''}", backend)
    result["tensorrt"], trt_ok = check_tensorrt(model, ckpt, device, measure, batch=len(ps))
    if trt_ok is not None:  # an error while building or running the engine is a failed check, not a note
        result["checks"]["tensorrt: exported, built and ran"] = trt_ok

    print(f"GPU: {result['gpu']}   model: {what}")
    for k, v in result["checks"].items():
        print(f"  {'ok  ' if v else 'FAIL'} {k}")
    qs = list(next(iter(result["step_ms"].values())))
    print(f"{'step ms at past 512':<22}" + "".join(f"{'Q=' + str(q):>9}" for q in qs))
    for name, row in result["step_ms"].items():
        print(f"{name:<22}" + "".join(f"{row[q]:>9.2f}" for q in qs))
    for name, v in result["decode_tok_s"].items():
        print(f"decode tokens/s {name:<12} {v}")
    print(f"tensorrt: {result['tensorrt']}")
    out = Path(os.environ.get("OUT") or (ROOT / "bench" / "results" if device == "cuda" else "/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu-check-{datetime.date.today().isoformat()}.json").write_text(json.dumps(result, indent=2))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
