"""`--quantize gguf-k`: the fused step graph whose products read the GGUF file's blocks in place,
on specrt's own kernel (engines/kernels: specrt.GgufMatMul, specrt.GgufGather).

    fused_in_place(checkpoint, out_dir, gguf_path, hidden_layers)   # the graph, its manifest

Each product of weights stored in a block type the kernel takes is one GgufMatMul node naming
the file (by its path relative to the graph's folder, so a project folder moves with its models)
and the tensors' offsets: no codes, scales or floats of them are written. Weights the fused graph
multiplies side by side (a layer's q, k and v; gate and up) are one node where they share a block
type (measured: a 256-row k projection alone streamed at a third of the rate, and the Concat after
three products cost 0.6 ms a step), and q and k rows llama.cpp stored permuted are put back in the
checkpoint's order when the kernel packs them (the node's `order`). The kernel also adds the q, k
and v bias and applies the MLP's SwiGLU before a product's output leaves it (the node's `bias` and
`epilogue`; graph_writer's `biased` and `swiglu` hooks), so a layer is its products, two norms and
its attention. A weight stored as floats (or
in a block type the kernel does not take) is the float graph's product. The activations are
quantized to int8 per block inside the kernel (as gguf-a8's are in MatMulNBits), so the engine is
its own numeric class: its probe measures which step shapes agree.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError
from specrt.schema.checkpoint_files import file_digest

SCHEME = "gguf-k"
DOMAIN = "specrt"
RECIPE_VERSION = 3  # 2: a run of one block type's weights (q, k, v) in one product, q/k rows ordered in it;
# 3: the bias and SwiGLU applied by the kernel (GgufMatMul's bias, epilogue)
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}  # the kernel's (engines/kernels)


class KernelProducts:
    """The fused graph writer's products (export/graph_writer.py) as GgufMatMul nodes."""

    def __init__(self, gguf_path: Path, out_dir: Path, t0: float):
        self.gguf_path, self.t0 = Path(gguf_path), t0
        self.file = os.path.relpath(self.gguf_path.resolve(), Path(out_dir).resolve())
        self.counts: dict[str, int] = {}

    def opsets(self) -> list:
        from onnx import helper

        return [helper.make_opsetid(DOMAIN, 1)]

    def manifest(self) -> dict:
        return {
            "quantization": {
                "scheme": SCHEME,
                "method": "the GGUF's own blocks read in place by specrt's kernel (int8 activations per block)",
                "recipe_version": RECIPE_VERSION,
                "fused": True,
                "gguf": {"file": self.gguf_path.name, "sha256": file_digest(self.gguf_path), "relative": self.file},
                "kernel_products": dict(sorted(self.counts.items())),
                "seconds": round(time.perf_counter() - self.t0, 2),
            }
        }

    def _kind(self, weight) -> str | None:
        from specrt.export.gguf_model import GgufWeight

        if not isinstance(weight, GgufWeight):
            return None
        kind = weight.tensor.tensor_type.name
        return kind if kind in TYPES else None

    def _attrs(self, weight) -> dict:
        n, k = weight.shape
        return dict(
            file=self.file, offset=int(weight.tensor.data_offset), ggml_type=TYPES[self._kind(weight)], n=n, k=k
        )

    def lookup(self, g, embed, tied: bool) -> str:
        from specrt.export.graph_writer import FloatProducts

        if self._kind(embed) is None:
            return FloatProducts().lookup(g, embed, tied)
        self.counts["embedding"] = 1
        return g.node("GgufGather", ["input_ids"], ["embed/rows"], "embed/GgufGather", DOMAIN, **self._attrs(embed))[0]

    def _runs(self, weights: list) -> list[tuple[str | None, list]]:
        """The weights side by side as runs of one block type (None: a type the kernel does not take)."""
        runs: list[tuple[str | None, list]] = []
        for w in weights:
            kind = self._kind(w)
            if runs and kind is not None and kind == runs[-1][0]:
                runs[-1][1].append(w)
            else:
                runs.append((kind, [w]))
        return runs

    def product(self, g, x: str, weights: list, name: str, bias: np.ndarray | None = None) -> str:
        """One GgufMatMul for each run of weights of one block type side by side (a layer's q, k and
        v: x quantized once, one call), a float product for the others, joined by a Concat; with
        `bias` (every run the kernel's: `biased`), each node adds its part of it."""
        from specrt.export.graph_writer import FloatProducts

        runs, outs, start = self._runs(weights), [], 0
        for j, (kind, run) in enumerate(runs):
            part = name if len(runs) == 1 else f"{name}.{j}"
            if kind is None:
                outs.append(FloatProducts().product(g, x, run, part))
                continue
            more = {}
            if bias is not None:
                n = sum(w.shape[0] for w in run)
                more["bias"] = bias[start : start + n].astype(np.float32).tolist()
                start += n
            outs.append(self._kernel(g, x, kind, run, part, "kernel", **more))
        if len(outs) == 1:
            return outs[0]
        return g.node("Concat", outs, [f"{name}/out"], f"{name}/Concat", axis=-1)[0]

    def biased(self, g, x: str, weights: list, bias: np.ndarray, name: str) -> str | None:
        """x @ W^T + bias, the bias added by the kernel (graph_writer's hook: no Add node); None
        where a weight is not the kernel's (the writer adds it then)."""
        if any(kind is None for kind, _ in self._runs(weights)):
            return None
        return self.product(g, x, weights, name, bias)

    def swiglu(self, g, x: str, gate_up: list, name: str) -> str | None:
        """silu(x @ gate^T) * (x @ up^T) as one GgufMatMul (its `epilogue`: no Split, activation or
        Mul nodes), None where gate and up are not one run."""
        runs = self._runs(gate_up)
        if len(runs) != 1 or runs[0][0] is None:
            return None
        return self._kernel(g, x, runs[0][0], runs[0][1], name, "swiglu", epilogue="swiglu")

    def _kernel(self, g, x: str, kind: str, run: list, name: str, out: str, **more) -> str:
        """One GgufMatMul node over the run (its `_run` attributes and `more`), counted."""
        self.counts[kind] = self.counts.get(kind, 0) + len(run)
        attrs = self._run(run) | more
        return g.node("GgufMatMul", [x], [f"{name}/{out}"], f"{name}/GgufMatMul", DOMAIN, **attrs)[0]

    def _run(self, run: list) -> dict:
        """The attributes of one product of the weights `run` (one block type and k) side by side;
        q and k rows llama.cpp stored permuted put back in the checkpoint's order by `order`."""
        from specrt.export.gguf import unpermute_rows

        attrs = self._attrs(run[0])
        if len(run) > 1:
            attrs.update(n=int(sum(w.shape[0] for w in run)), parts_offset=[int(w.tensor.data_offset) for w in run],
                         parts_n=[int(w.shape[0]) for w in run])  # fmt: skip
        if any(w.heads is not None for w in run):
            order, start = [], 0
            for w in run:
                rows = np.arange(w.shape[0], dtype=np.int64)[:, None]
                order.append((unpermute_rows(rows, w.heads)[:, 0] if w.heads is not None else rows[:, 0]) + start)
                start += w.shape[0]
            attrs["order"] = np.concatenate(order).tolist()
        return attrs


def fused_in_place(checkpoint, out_dir, gguf_path, hidden_layers=None, opset: int = 17) -> Path:
    """The fused step graph of a checkpoint whose weights are the GGUF file's (a .gguf, or
    `convert --weights gguf`), its products on specrt's kernel; written to out_dir."""
    from specrt.export.checkpoint import gguf_weights
    from specrt.export.fused_graph import export_fused_graph

    source = gguf_weights(checkpoint)
    if source is None or not os.path.samefile(source, gguf_path):  # gguf_path may be a link to it
        raise SpecrtError(
            f"--quantize {SCHEME} reads the weights from the GGUF file in place: give a checkpoint that reads its "
            f"weights from {gguf_path} (specrt convert {gguf_path} --out DIR --weights gguf), or the .gguf itself"
        )
    products = KernelProducts(Path(gguf_path), Path(out_dir), time.perf_counter())
    return export_fused_graph(checkpoint, out_dir, hidden_layers, opset, products=products)
