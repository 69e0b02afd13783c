"""The fused step graph: ONNX Runtime's fused operators, the KV cache written in place.

    export_fused_graph(checkpoint, out_dir)   # model.onnx, model.onnx.data, manifest.json

The same model as the portable step graph (export/step_graph.py), written node by node from the
checkpoint's weights rather than traced, so each layer is what ORT's CPU kernels run best:

    SkipSimplifiedLayerNormalization   norm and residual add in one (layer 0: the plain norm)
    MatMul q|k|v                       one product over the three weights, packed for the op
    GroupQueryAttention                rotary at the given positions, grouped KV heads, causal
                                       order plus a bias for trees; past and present are one
                                       buffer, so each row's new keys are written in place at
                                       its length and no step copies the cache
    MatMul o
    SkipSimplifiedLayerNormalization
    MatMul gate|up, Split; Sigmoid, Mul, Mul (SiLU(gate) * up); MatMul down

Every product goes through a `products` object: FloatProducts writes MatMuls over the float
weights; a 4-bit recipe passes its own (calibration/blocks.py), which writes MatMulNBits over
the same weights' blocks, so the fused 4-bit graph is written directly, not rewritten.

8 nodes a layer besides the products (the portable graph runs ~83 after ORT's own
optimizations). The I/O is step_io's fused flavour: the runtime passes its lengths rather than
a mask (step_io.fused_inputs converts one into the other) and binds each layer's cache buffer as
both past and present (engines/ort_inplace.py).

The graph writer (export/graph_writer.py `write_graph`) takes the layer's norms, attention and
I/O from an `ops` object (FusedOps here), so the standard graph (export/standard_graph.py:
opset-23 operators for TensorRT) is the same writer with other ops.

A tree needs only its bias: nodes come in topological order, so a node's ancestors stand before
it and causal order plus -inf on the non-ancestors is the tree mask. Ragged rows are the
attention op's own (seqlens_k, query_seqlens per row).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specrt.export.graph_files import DEFAULT_OPSET
from specrt.export.graph_writer import GraphBuilder, export_written_graph, f32, write_graph
from specrt.export.llama import LlamaModel
from specrt.export.step_io import StepIO

MS = "com.microsoft"
FUSED_VERSION = 1  # the fused graph's layout; a graph of another version is written again


# GroupQueryAttention's inputs in its order (ORT 1.32); the graph names the ones it gives
GQA_INPUTS = (
    "query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache",
    "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale", "v_scale", "q_norm_weight",
    "k_norm_weight", "query_seqlens",
)  # fmt: skip


def build_fused_graph(model: LlamaModel, products=None, opset: int = DEFAULT_OPSET):
    """The fused step graph of `model` (float32 weights) as an onnx ModelProto; `products`
    computes its matrix products (FloatProducts by default)."""
    return write_graph(model, FusedOps(), products, opset)


class FusedOps:
    """The fused flavour's norms, attention and I/O (ORT's com.microsoft operators)."""

    flavour = io_flavour = "fused"

    def opsets(self, opset: int) -> list:
        from onnx import helper

        return [helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)]

    def opset(self, asked: int) -> int:
        return asked

    def manifest(self) -> dict:
        return {"graph_flavour": "fused", "fused_version": FUSED_VERSION, "exporter": "specrt fused graph builder"}

    def check(self, onnx_file: Path) -> None:
        """No onnx.checker: ORT's SimplifiedLayerNormalization is in the default domain, which
        the checker refuses; the engine build loads the graph in ORT, the check that matters."""

    def norm(self, g: GraphBuilder, block: str | None, residual: str, weight, eps: float, name: str):
        return _norm(g, block, residual, weight, eps, name)

    def attention(self, g: GraphBuilder, cfg, i: int, qkv: str, io: StepIO, shared: dict) -> str:
        """GroupQueryAttention over q|k|v packed: rotary inside, the past written in place."""
        (past_k, past_v), (present_k, present_v) = io.past(i), io.present(i)
        given = dict(query=qkv, past_key=past_k, past_value=past_v, cos_cache=shared["cos_cache"])
        given |= dict(sin_cache=shared["sin_cache"], attention_bias="attention_bias", query_seqlens="query_seqlens")
        given |= {n: n for n in ("seqlens_k", "total_sequence_length", "position_ids")}
        return g.node(
            "GroupQueryAttention",
            [given.get(n, "") for n in GQA_INPUTS],  # key and value empty: the query is q|k|v packed
            [f"layers.{i}.attn/out", present_k, present_v],
            f"layers.{i}.attn",
            MS,
            num_heads=cfg.num_attention_heads,
            kv_num_heads=cfg.num_key_value_heads,
            do_rotary=1,
            rotary_interleaved=0,
            causal=1,
            scale=float(cfg.head_dim**-0.5),
        )[0]


def _norm(g: GraphBuilder, block: str | None, residual: str, weight: torch.Tensor, eps: float, name: str):
    """(normed, residual + block): one SkipSimplifiedLayerNormalization; the first layer, with
    no block before it, normalizes the embedding alone."""
    w = g.init(f"{name}.weight", f32(weight))
    if block is None:
        out = g.node("SimplifiedLayerNormalization", [residual, w], [f"{name}/out"], name, axis=-1, epsilon=eps)
        return out[0], residual
    outs = [f"{name}/out", "", "", f"{name}/residual"]
    out = g.node("SkipSimplifiedLayerNormalization", [block, residual, w], outs, name, MS, epsilon=eps)
    return out[0], out[3]


def export_fused_graph(
    checkpoint: str | Path,
    out_dir: str | Path,
    hidden_layers: tuple[int, ...] | None = None,
    opset: int = DEFAULT_OPSET,
    products=None,
) -> Path:
    """Write the fused step graph of `checkpoint` to `out_dir` (replaced atomically) with a
    manifest like the portable export's, its `graph_flavour` "fused"; `products` as in
    build_fused_graph (what its `manifest()` says goes into the manifest: a 4-bit recipe's
    quantization)."""
    return export_written_graph(checkpoint, out_dir, FusedOps(), hidden_layers, opset, products)
