"""The GPU check's real-size block: a random-weight model with Llama-3.1-8B's shapes in bfloat16,
made on the device from its config (no weights carried), its step time over batch x positions
(eager and CUDA graphs), and what speculation would gain there.

    step times   gpu_sweep.sweep over SCALE_BATCHES x SCALE_POSITIONS after 256 committed positions
    oracle       for each accepted length measured on the CPU (bench/results: the 1.5B target's
                 drafts, ACCEPTED), tokens a step x T(B, 1) / T(B, 1 + drafted a step): the
                 speedup a draft that costs nothing would give at batch B, from the measured
                 step times (positions between those measured: linear in between)
    predicted    the same from the runtime's cost model (runtime/policy.py CostModel) fitted to
                 the measured step times: 1 + alpha x paid positions (+ beta where a step may
                 have one position), the model the auto policy picks N with

In the CPU mode the same code runs on a tiny config (the 8B weights take 16 GB).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from specrt.export.llama import LlamaModel
from specrt.runtime.policy import CostModel
from specrt.schema.config import ModelConfig

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128009,
}
SCALE_BATCHES = (1, 4, 16, 64)
SCALE_POSITIONS = (1, 2, 3, 5, 9)
RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
# accepted lengths measured on the CPU (greedy, the 1.5B target, 8 prompt classes): file, method
ACCEPTED = (
    ("exact-2026-12-06-qwen2.5-coder-1.5b-draft-model.json", "draft-model"),
    ("exact-2026-12-06-qwen2.5-coder-1.5b-draft-model.json", "auto"),
    ("exact-2026-12-06-qwen2.5-coder-1.5b-medusa-900.json", "head"),
)


def random_model(config: dict, device: str, dtype=torch.bfloat16) -> LlamaModel:
    """The model of `config` with random weights, made where it runs (8B in bfloat16: 16 GB)."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in bfloat16: no float32 copy (32 GB) on the way
    try:
        with torch.device(device):
            model = LlamaModel(ModelConfig.from_hf_dict(config))
    finally:
        torch.set_default_dtype(default)
    return model.to_dtype(dtype).eval()  # the rotary frequencies back to float32


def accepted_lengths(results: Path | None = None) -> list[dict]:
    """Per ACCEPTED entry found: tokens a step and draft tokens verified a step (from the
    acceptance rate: (tokens a step - 1) / rate)."""
    out = []
    for name, method in ACCEPTED:
        path = (results or RESULTS) / name
        if not path.is_file():
            continue
        for setting, methods in (json.loads(path.read_text()).get("acceptance") or {}).items():
            got = methods.get(method)
            if got and got["rate"] > 0:
                drafted = (got["tokens_per_step"] - 1) / got["rate"]
                source = f"{name} {setting} {method}"
                out.append({"source": source, "tokens_per_step": got["tokens_per_step"], "drafted": drafted})
    return out


def step_time(cells: list[dict], batch: int, positions: float) -> float | None:
    """Median wall ms of a step of `positions` per row at `batch`, linear between measured ones."""
    got = sorted((c["positions"], c["wall_ms"]) for c in cells if c["batch"] == batch)
    if not got or positions > got[-1][0]:
        return None
    xs, ys = zip(*got)
    return float(np.interp(positions, xs, ys))


def oracle(cells: list[dict], lengths: list[dict], floor: int) -> list[dict]:
    """Measured and cost-model speedups per batch for each accepted length (a free draft)."""
    model = CostModel(max_draft=16, free=max(floor - 1, 0))
    for c in cells:
        model.observe_step(c["batch"] * c["positions"], c["batch"], c["wall_ms"] / 1e3)
    rows = []
    for L in lengths:
        for b in sorted({c["batch"] for c in cells}):
            one, many = step_time(cells, b, 1), step_time(cells, b, 1 + L["drafted"])
            cost = model.cost(b)
            predicted = None if cost is None else L["tokens_per_step"] / float(cost.relative(np.array(L["drafted"])))
            measured = None if one is None or many is None else L["tokens_per_step"] * one / many
            rows.append({**L, "batch": b, "measured": measured, "predicted": predicted})
    return rows


def oracle_lines(rows: list[dict]) -> list[str]:
    def fmt(v):
        return "   -" if v is None else f"{v:5.2f}x"

    head = "draft (accepted length measured on the CPU)"
    lines = [f"{head:<58}{'B':>4}{'tokens/step':>12}{'measured':>10}{'model':>8}"]
    for r in rows:
        lines.append(
            f"{r['source'][-58:]:<58}{r['batch']:>4}{r['tokens_per_step']:>12.2f}{fmt(r['measured']):>10}{fmt(r['predicted']):>8}"
        )
    return lines
