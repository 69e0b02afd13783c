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

import numpy as np
import torch

from specrt.errors import UnsupportedArchitectureError
from specrt.export.graph_writer import GraphBuilder, export_written_graph, f32, rotary_tables, write_graph
from specrt.export.llama import LlamaModel
from specrt.schema.graph_files import DEFAULT_OPSET
from specrt.schema.step_io import StepIO

MS = "com.microsoft"
# the fused graph's layout (2: rotary tables past the context; 3: attention of one-position steps
# padded to two); another version is written again
FUSED_VERSION = 3
ATTENTION_ROWS = 2  # the fewest query positions GroupQueryAttention computes (_two_positions)


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

    def attention(self, g: GraphBuilder, cfg, i: int, qkv: str, io: StepIO, shared: dict, norms=None) -> str:
        """GroupQueryAttention over q|k|v packed: rotary inside (after the per-head q/k norms
        where the family has them), the past written in place. A sliding layer's window is in
        its bias (`window_bias`), not the operator's local_window_size, which counts slots: a
        tree's nodes sit at slots past their positions."""
        (past_k, past_v), (present_k, present_v) = io.past(i), io.present(i)
        if cfg.rotary_dims < cfg.head_dim and cfg.rotary_dims % 16:
            raise UnsupportedArchitectureError(
                f"a rotary over {cfg.rotary_dims} of {cfg.head_dim} dims: ONNX Runtime's GroupQueryAttention turns "
                "a multiple of 16; build this model with --graph portable."
            )
        cos, sin = rotary_tables(cfg, i, shared)
        given = dict(_two_positions(g, shared))
        if cfg.is_sliding(i):
            given["attention_bias"] = window_bias(g, cfg.sliding_window, shared)
        rows = [qkv, shared["pad_rows"]]  # a one-position step's copied once
        qkv = g.node("Pad", rows, [f"layers.{i}.attn/qkv2"], f"layers.{i}.attn/Pad", mode="edge")[0]
        given |= dict(query=qkv, past_key=past_k, past_value=past_v, cos_cache=cos, sin_cache=sin)
        if norms is not None:  # the CPU kernel has no q_norm_weight: the norms run before it
            given |= _normed_heads(g, cfg, i, qkv, norms, shared)
        out = f"layers.{i}.attn/out2"
        g.node(
            "GroupQueryAttention",
            [given.get(n, "") for n in GQA_INPUTS],  # key and value empty: the query is q|k|v packed
            [out, present_k, present_v],
            f"layers.{i}.attn",
            MS,
            num_heads=cfg.num_attention_heads,
            kv_num_heads=cfg.num_key_value_heads,
            do_rotary=1,
            rotary_interleaved=0,
            causal=1,
            scale=cfg.scale,
        )
        back = [out, shared["zero1"], shared["q_len"], shared["axis1"]]  # the step's own positions
        return g.node("Slice", back, [f"layers.{i}.attn/out"], f"layers.{i}.attn/Slice")[0]

    def gelu_tanh(self, g: GraphBuilder, x: str, name: str) -> str:
        """gelu with the tanh approximation (ORT's FastGelu)."""
        return g.node("FastGelu", [x], [f"{name}/out"], name, MS)[0]


def _two_positions(g: GraphBuilder, shared: dict) -> dict:
    """GroupQueryAttention's step inputs for at least two query positions: a one-position step
    gets a copy of its position after it (its key written one slot further, where the next
    step writes again; causal order hides it from the real one). ORT's attention computes a
    one-row query in another order of float operations than two or more rows, which agree with
    each other, while its 4-bit and 8-bit products (MatMulNBits) give a row the same bits alone
    or beside others: so the int8-activation engines' one-position steps are bitwise their
    multi-position steps' rows (the build measures it: `unpadded` in its batch invariance) and
    plain decoding needs no second position through the weights. Steps of two or more
    positions are padded by nothing. Written once, shared by every layer."""
    if "two_positions" in shared:
        return shared["two_positions"]
    n = "two"
    shared["zero1"] = g.init(f"{n}.zero1", np.zeros(1, np.int64))
    shared["axis1"] = g.init(f"{n}.axis1", np.ones(1, np.int64))
    shared["q_len"] = g.node("Shape", ["position_ids"], [f"{n}/Q"], f"{n}/Q", start=1, end=2)[0]
    fewest = g.init(f"{n}.fewest", np.array([ATTENTION_ROWS], np.int64))
    short = g.node("Sub", [fewest, shared["q_len"]], [f"{n}/short"], f"{n}/Short")
    pad = g.node("Max", [short[0], shared["zero1"]], [f"{n}/pad"], f"{n}/Pad")[0]  # (1,): 1 or 0
    zeros = {k: g.init(f"{n}.zeros{k}", np.zeros(k, np.int64)) for k in (1, 3, 4, 6)}
    shared["pad_rows"] = g.node("Concat", [zeros[4], pad, zeros[1]], [f"{n}/pads3"], f"{n}/Pads3", axis=0)[0]
    pads2 = g.node("Concat", [zeros[3], pad], [f"{n}/pads2"], f"{n}/Pads2", axis=0)[0]
    pads4 = g.node("Concat", [zeros[6], pad, pad], [f"{n}/pads4"], f"{n}/Pads4", axis=0)[0]
    pad32 = g.node("Cast", [pad], [f"{n}/pad32"], f"{n}/Pad32", to=6)[0]  # INT32
    given = {
        "position_ids": g.node("Pad", ["position_ids", pads2], [f"{n}/position_ids"], f"{n}/Positions", mode="edge")[0],
        "attention_bias": g.node("Pad", ["attention_bias", pads4], [f"{n}/bias"], f"{n}/Bias")[0],
    }
    for name in ("seqlens_k", "total_sequence_length", "query_seqlens"):
        given[name] = g.node("Add", [name, pad32], [f"{n}/{name}"], f"{n}/{name}")[0]
    shared["two_positions"] = given
    return given


def _normed_heads(g: GraphBuilder, cfg, i: int, qkv: str, norms, shared: dict) -> dict:
    """query, key and value for GroupQueryAttention, q and k normed over each head's dims."""
    p, H, Hkv, D = f"layers.{i}.attn", cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if "qkv_split" not in shared:
        shared["qkv_split"] = g.init("attn.split", np.array([H * D, Hkv * D, Hkv * D], np.int64))
        shared["heads"] = g.init("attn.heads", np.array([0, 0, -1, D], np.int64))
        shared["merge"] = g.init("attn.merge", np.array([0, 0, -1], np.int64))
    q, k, v = g.node("Split", [qkv, shared["qkv_split"]], [f"{p}/{n}" for n in "qkv"], f"{p}/Split", axis=-1)
    out = {"value": v}
    for t, w, role in ((q, norms[0], "query"), (k, norms[1], "key")):
        heads = g.node("Reshape", [t, shared["heads"]], [f"{t}/heads"], f"{t}/Heads")[0]
        w = g.init(f"{p}.{role}_norm.weight", w)
        eps = float(cfg.rms_norm_eps)
        normed = g.node("SimplifiedLayerNormalization", [heads, w], [f"{t}/normed"], f"{t}/Norm", axis=-1, epsilon=eps)
        out[role] = g.node("Reshape", [normed[0], shared["merge"]], [f"{t}/merged"], f"{t}/Merge")[0]
    return out


def window_bias(g: GraphBuilder, window: int, shared: dict) -> str:
    """The sliding layers' attention bias (B, 1, Q, T): attention_bias, and -inf on keys
    `window` or more positions behind the query. Key positions: slot s for the past (a row's
    committed positions sit at their slots), position_ids for the new ones at
    [length_b, length_b + Q). Written once, shared by every sliding layer."""
    if "window_bias" in shared:
        return shared["window_bias"]
    i64, n = 7, "window"  # TensorProto.INT64
    t = _two_positions(g, shared)  # the attention's own inputs: a one-position step's padded
    total = g.node("Cast", [t["total_sequence_length"]], [f"{n}/T64"], f"{n}/CastT", to=i64)[0]
    # the runtime passes T as a scalar or as one element: both become both
    t1 = g.node("Reshape", [total, g.init(f"{n}.shape1", np.array([1], np.int64))], [f"{n}/T1"], f"{n}/T1")[0]
    total = g.node("Reshape", [total, g.init(f"{n}.scalar", np.zeros(0, np.int64))], [f"{n}/T"], f"{n}/T")[0]
    zero, one = g.init(f"{n}.0", np.array(0, np.int64)), g.init(f"{n}.1", np.array(1, np.int64))
    slots = g.node("Range", [zero, total, one], [f"{n}/slots"], f"{n}/Slots")[0]  # (T,)
    batch = g.node("Shape", [t["position_ids"]], [f"{n}/B"], f"{n}/B", end=1)[0]
    q_len = g.node("Shape", [t["position_ids"]], [f"{n}/Q1"], f"{n}/Q1", start=1, end=2)[0]
    q_len = g.node("Squeeze", [q_len], [f"{n}/Q"], f"{n}/Q")[0]
    bt = g.node("Concat", [batch, t1], [f"{n}/BT"], f"{n}/BT", axis=0)[0]
    keys = g.node("Expand", [slots, bt], [f"{n}/keys_past"], f"{n}/KeysPast")[0]  # (B, T)
    # each row's length before the step: seqlens_k + 1 - query_seqlens
    seen = g.node("Sub", [t["seqlens_k"], t["query_seqlens"]], [f"{n}/seen32"], f"{n}/Seen")[0]
    seen = g.node("Cast", [seen], [f"{n}/seen64"], f"{n}/CastSeen", to=i64)[0]
    seen = g.node("Add", [seen, one], [f"{n}/length"], f"{n}/Length")[0]
    offsets = g.node("Range", [zero, q_len, one], [f"{n}/offsets"], f"{n}/Offsets")[0]  # (Q,)
    axes1 = g.init(f"{n}.axes1", np.array([1], np.int64))
    at = g.node("Unsqueeze", [seen, axes1], [f"{n}/length_b1"], f"{n}/LengthB1")[0]
    at = g.node("Add", [at, offsets], [f"{n}/new_slots"], f"{n}/NewSlots")[0]  # (B, Q)
    keys = g.node("ScatterElements", [keys, at, t["position_ids"]], [f"{n}/keys"], f"{n}/Keys", axis=1)[0]
    q = g.node("Unsqueeze", [t["position_ids"], g.init(f"{n}.axes2", np.array([2], np.int64))], [f"{n}/q"], f"{n}/Q3")[
        0
    ]
    k = g.node("Unsqueeze", [keys, axes1], [f"{n}/k"], f"{n}/K3")[0]
    behind = g.node("Sub", [q, k], [f"{n}/behind"], f"{n}/Behind")[0]  # (B, Q, T)
    near = g.node("Less", [behind, g.init(f"{n}.size", np.array(window, np.int64))], [f"{n}/near"], f"{n}/Near")[0]
    cut = g.node(
        "Where",
        [near, g.init(f"{n}.open", np.array(0.0, np.float32)), g.init(f"{n}.shut", np.array(-np.inf, np.float32))],
        [f"{n}/cut"],
        f"{n}/Cut",
    )[0]
    cut = g.node("Unsqueeze", [cut, axes1], [f"{n}/cut4"], f"{n}/Cut4")[0]  # (B, 1, Q, T)
    shared["window_bias"] = g.node("Add", [t["attention_bias"], cut], [f"{n}/bias"], f"{n}/Bias")[0]
    return shared["window_bias"]


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
