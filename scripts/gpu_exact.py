"""The GPU check's exactness block: which step shapes give a position bitwise the same logits on
the PyTorch backend, and under which padding rule (runtime/step_shapes.py).

On the CPU every step shape is bitwise by construction (in-place attention, products in blocks
of 8 rows: tests/test_exact.py). A GPU library picks its matrix-product kernel by the product's
shape (cuBLAS: tile sizes, split-K), so a row's result may change with the row count in other
classes than on the CPU; this block finds them on the machine it runs on:

    rows     one product of the model's shape (hidden -> intermediate), float32 and bfloat16:
             the row counts M = 1..40 that give its first row bitwise the same result, grouped
    shapes   per dtype and mode (eager, CUDA graphs): bitwise verdicts of the padded, split,
             batch and capacity shapes under the backend's own rule and under RULES
"""

from __future__ import annotations

import torch

from specrt.export.llama import LlamaModel
from specrt.runtime.step_shapes import measure

RULES = ((2, 1), (1, 4), (1, 8), (1, 16), (1, 32))  # (floor, multiple) padding rules tried
MAX_ROWS = 40


def row_classes(n_in: int, n_out: int, dtype, device: str, rows: int = MAX_ROWS) -> list[list[int]]:
    """Row counts M = 1..rows of y = x W^T grouped by the bits of the first row's result, in order."""
    gen = torch.Generator().manual_seed(0)
    w = (0.05 * torch.randn(n_out, n_in, generator=gen)).to(device, dtype)
    x = torch.randn(rows, n_in, generator=gen).to(device, dtype)
    groups: dict[bytes, list[int]] = {}
    with torch.inference_mode():
        for m in range(1, rows + 1):
            first = torch.nn.functional.linear(x[:m], w)[0].float().cpu().numpy()
            groups.setdefault(first.tobytes(), []).append(m)
    return list(groups.values())


def _spans(groups: list[list[int]]) -> str:
    def span(g):
        return str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" if g == list(range(g[0], g[-1] + 1)) else str(g)

    return " | ".join(span(g) for g in groups)


def device_model(model: LlamaModel, dtype) -> LlamaModel:
    copy = LlamaModel(model.cfg).eval()
    copy.load_state_dict(model.state_dict())
    return copy if dtype == torch.float32 else copy.to_dtype(dtype)


def exact_block(model: LlamaModel, make_backend, device: str, modes: tuple[str, ...]):
    """make_backend(model, graphs) -> a TorchBackend on `device`. INFO: a finding, not a check,
    except that on the CPU the backend's own rule must be bitwise in every shape (FAIL if not)."""
    cfg = model.cfg
    dtypes = (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,)
    details: dict = {"rows": {}, "shapes": {}, "lines": []}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        groups = row_classes(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        details["rows"][name] = groups
        details["lines"].append(f"{name} {cfg.hidden_size}x{cfg.intermediate_size} row classes by M: {_spans(groups)}")
    own_ok = True
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for mode in modes:
            backend = make_backend(device_model(model, dtype), mode == "graphs")
            got = measure(backend, rules=RULES)
            key = f"{name} {mode}"
            details["shapes"][key] = got
            rule = f"floor {backend.caps.floor}, multiple {backend.caps.step_multiple}"
            own_ok &= all(got["bitwise"].values())
            details["lines"].append(
                f"{key}: own rule ({rule}) {_verdicts(got['bitwise'])}; unpadded bound {got['relative']:.1e}"
            )
            for r, v in got["rules"].items():
                details["lines"].append(f"    {r}: {_verdicts(v['bitwise'])} (max {v['relative']:.1e})")
    bitwise = [k for k, v in details["shapes"].items() if all(v["bitwise"].values())]
    details["bitwise_under_own_rule"] = bitwise
    if device == "cpu":
        return ("PASS" if own_ok else "FAIL"), details
    return "INFO", details


def _verdicts(v: dict) -> str:
    bad = [k for k, ok in v.items() if not ok]
    return "bitwise in every shape" if not bad else f"not bitwise: {', '.join(bad)}"


if __name__ == "__main__":  # the row classes of the model's three product shapes up to M = 512
    import json
    import sys

    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        for n_in, n_out in ((576, 1536), (1536, 576), (576, 49152)):
            groups = row_classes(n_in, n_out, dtype, device, rows=512)
            found[f"{dtype} {n_in}x{n_out}"] = groups
            print(f"{dtype} {n_in}x{n_out}: {_spans(groups)}", flush=True)
    print(json.dumps(found))
