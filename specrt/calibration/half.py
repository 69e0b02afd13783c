"""16-bit step graphs for GPU engines: float16 and bfloat16 weights and compute.

TensorRT 11 and TensorRT-RTX build strongly typed networks: a layer runs in 16 bits only where
the graph's own types say so, so the 16-bit graph is exported as such rather than asked for with
a builder flag. It is traced from the model cast to the 16-bit type (the same PyTorch module the
float32 export traces), not converted from the float32 graph: the trace keeps exactly the
float32 islands the module declares, which a graph-level converter has to guess.

Kept in float32 (`kept_in_float32` in the manifest):
  - RMSNorm's statistics: a residual channel of the default model reaches ~25,000, whose square
    overflows float16 (max 65,504);
  - the rotary angles (position x frequency: positions in the thousands need the mantissa);
  - the graph's I/O: past KV in, logits, hidden states and new KV out, so the runtime's one
    float32 contract holds (a 16-bit KV cache would halve its memory; not done yet).

  fp16  float16: 10 mantissa bits, range 65,504. Measured on the default model (PyTorch, 300
        tokens of text): perplexity +0.06 %, top-1 agreement with float32 99 %.
  bf16  bfloat16: float32's range, 7 mantissa bits: +0.5 %, 97 %.

ONNX Runtime's CPU provider runs the fp16 graph (slowly: it is meant for GPUs) and has no
bfloat16 kernels at all, so bf16 builds only a TensorRT engine; the tests check its numbers
with ONNX's reference evaluator.
"""

from __future__ import annotations

from pathlib import Path

from specrt.calibration import HALF_SCHEMES
from specrt.calibration.blocks import float_source

# scheme -> the export's dtype (export.step_graph.DTYPES)
DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
assert set(DTYPES) == set(HALF_SCHEMES)
# the ORT CPU provider has no bfloat16 kernels: these build a TensorRT engine only
NO_ORT = ("bf16",)
HALF_VERSION = 1  # bumped whenever the export writes another graph
KEPT_IN_FLOAT32 = ["rmsnorm statistics", "rotary angles", "graph inputs and outputs"]


def export_half(checkpoint: str | Path, onnx_dir: str | Path, out_dir: str | Path, scheme: str) -> Path:
    """The step graph of `checkpoint` in the 16-bit type of `scheme`, written to `out_dir` with
    the float32 export in `onnx_dir` as its recorded source (its opset and hidden layers)."""
    from specrt.export.step_graph import export_step_graph

    source = float_source(onnx_dir)
    quantization = {
        "scheme": scheme,
        "recipe_version": HALF_VERSION,
        "compute_dtype": DTYPES[scheme],
        "kept_in_float32": KEPT_IN_FLOAT32,
    }
    extra = {
        "quantization": quantization,
        "source_onnx": {"path": str(Path(onnx_dir).resolve()), "files": source["files"]},
    }
    export_step_graph(
        checkpoint,
        out_dir,
        opset=source["opset"],
        hidden_layers=tuple(source["hidden_layers"]),
        progress=False,
        dtype=DTYPES[scheme],
        manifest_extra=extra,
    )
    return Path(out_dir)
