"""The standard step graph: the portable graph's I/O, each layer in opset-23 operators.

    export_standard_graph(checkpoint, out_dir)   # model.onnx, model.onnx.data, manifest.json

Written node by node like the fused graph (export/fused_graph.py, whose builder it shares), but
only with operators of the ONNX standard, so that TensorRT's parser can take it:

    RMSNormalization                   after an Add of the residual (layer 0: the norm alone)
    MatMul q|k|v, Split                one product over the three weights
    RotaryEmbedding                    on q and k at the given positions
    Concat past|new, Attention         grouped KV heads, the mask as given
    MatMul o; MatMul gate|up, Split; Sigmoid, Mul, Mul; MatMul down

The I/O is step_io's portable contract (a boolean mask over past and new positions; the past
passed in, the Q new positions returned), so every backend that runs the portable graph runs
this one unchanged. TensorRT-RTX 1.7 parses the three operators and builds the graph on a
machine without a GPU (tests/test_standard_graph.py); its Attention takes one output only, so
the past is concatenated outside it, and it has no dedicated float32 attention kernel, so the
build marks the attention decomposable (engines/trt.py). Which flavour runs faster under
TensorRT is for a GPU to measure; build-engines records which one each engine was built from.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt.export.graph_writer import GraphBuilder, export_written_graph, rotary_tables
from specrt.schema.step_io import StepIO

STANDARD_OPSET = 23  # RMSNormalization, RotaryEmbedding and Attention are opset 23's
STANDARD_VERSION = 2  # the standard graph's layout (2: rotary tables past the context); another is written again


class StandardOps:
    """The standard flavour's norms, attention and I/O for export/graph_writer.write_graph."""

    flavour, io_flavour = "standard", "portable"

    def opset(self, asked: int) -> int:
        return max(asked, STANDARD_OPSET)

    def opsets(self, opset: int) -> list:
        from onnx import helper

        return [helper.make_opsetid("", opset)]

    def manifest(self) -> dict:
        return {
            "graph_flavour": "standard",
            "standard_version": STANDARD_VERSION,
            "exporter": "specrt standard graph builder",
        }

    def check(self, onnx_file: Path) -> None:
        import onnx

        onnx.checker.check_model(str(onnx_file), full_check=True)

    def norm(self, g: GraphBuilder, block: str | None, residual: str, weight, eps: float, name: str):
        """(normed, residual + block); the first layer normalizes the embedding alone."""
        if block is not None:
            residual = g.node("Add", [residual, block], [f"{name}/residual"], f"{name}/Add")[0]
        w = g.init(f"{name}.weight", weight.detach().float().numpy())
        return g.node("RMSNormalization", [residual, w], [f"{name}/out"], name, axis=-1, epsilon=eps)[0], residual

    def attention(self, g: GraphBuilder, cfg, i: int, qkv: str, io: StepIO, shared: dict, norms=None) -> str:
        p, H, Hkv, D = f"layers.{i}.attn", cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if "mask" not in shared:  # (B, 1, Q, P + Q): one mask for every head
            axis = g.init("axes.1", np.array([1], np.int64))
            shared["mask"] = g.node("Unsqueeze", ["attention_mask", axis], ["mask/b1qk"], "mask/Unsqueeze")[0]
            shared["qkv_split"] = g.init("attn.split", np.array([H * D, Hkv * D, Hkv * D], np.int64))
            shared["merge"] = g.init("attn.merge", np.array([0, 0, H * D], np.int64))
        q, k, v = g.node("Split", [qkv, shared["qkv_split"]], [f"{p}/{n}" for n in "qkv"], f"{p}/Split", axis=-1)
        (past_k, past_v), (present_k, present_v) = io.past(i), io.present(i)
        rope = [*rotary_tables(cfg, i, shared), "position_ids"]
        scales = {q: norms[0], k: norms[1]} if norms is not None else {}
        heads = {}
        for t, n, out in ((q, H, f"{p}/q_rot"), (k, Hkv, present_k), (v, Hkv, present_v)):
            shape = shared.get(f"heads.{n}") or g.init(f"attn.heads.{n}", np.array([0, 0, n, D], np.int64))
            shared[f"heads.{n}"] = shape
            bqhd = g.node("Reshape", [t, shape], [f"{t}/bqhd"], f"{t}/Reshape")[0]
            if t in scales:  # the per-head norm, over each head's D dims, before the rotary
                w = g.init(f"{t}.norm.weight", scales[t])
                eps = float(cfg.rms_norm_eps)
                bqhd = g.node("RMSNormalization", [bqhd, w], [f"{t}/normed"], f"{t}/Norm", axis=-1, epsilon=eps)[0]
            name = out if t == v else f"{t}/bhqd"
            bhqd = g.node("Transpose", [bqhd], [name], f"{t}/Transpose", perm=[0, 2, 1, 3])[0]
            dims = {} if cfg.rotary_dims == D else {"rotary_embedding_dim": cfg.rotary_dims}
            heads[t] = bhqd if t == v else g.node("RotaryEmbedding", [bhqd, *rope], [out], f"{t}/Rotary", **dims)[0]
        keys = g.node("Concat", [past_k, present_k], [f"{p}/keys"], f"{p}/keys", axis=2)[0]
        values = g.node("Concat", [past_v, present_v], [f"{p}/values"], f"{p}/values", axis=2)[0]
        mask = window_mask(g, cfg.sliding_window, shared) if cfg.is_sliding(i) else shared["mask"]
        out = g.node(
            "Attention",
            [heads[q], keys, values, mask],
            [f"{p}/bhqd"],
            p,
            q_num_heads=H,
            kv_num_heads=Hkv,
            scale=cfg.scale,
        )[0]
        bqhd = g.node("Transpose", [out], [f"{p}/bqhd"], f"{p}/Transpose", perm=[0, 2, 1, 3])[0]
        return g.node("Reshape", [bqhd, shared["merge"]], [f"{p}/out"], f"{p}/Merge")[0]

    def gelu_tanh(self, g: GraphBuilder, x: str, name: str) -> str:
        return g.node("Gelu", [x], [f"{name}/out"], name, approximate="tanh")[0]


def window_mask(g: GraphBuilder, window: int, shared: dict) -> str:
    """The sliding layers' mask (B, 1, Q, P + Q): attention_mask, and no key `window` or more
    positions behind the query. Key positions: slot s for the past (a row's committed positions
    sit at their slots), position_ids for the Q new ones. Written once for every sliding layer."""
    if "window_mask" in shared:
        return shared["window_mask"]
    n = "window"
    past = g.node("Shape", ["past_key_values.0.key"], [f"{n}/P1"], f"{n}/P1", start=2, end=3)[0]
    batch = g.node("Shape", ["position_ids"], [f"{n}/B"], f"{n}/B", end=1)[0]
    bp = g.node("Concat", [batch, past], [f"{n}/BP"], f"{n}/BP", axis=0)[0]
    zero, one = g.init(f"{n}.0", np.array(0, np.int64)), g.init(f"{n}.1", np.array(1, np.int64))
    p = g.node("Squeeze", [past], [f"{n}/P"], f"{n}/P")[0]
    slots = g.node("Range", [zero, p, one], [f"{n}/slots"], f"{n}/Slots")[0]
    slots = g.node("Expand", [slots, bp], [f"{n}/past_keys"], f"{n}/PastKeys")[0]
    keys = g.node("Concat", [slots, "position_ids"], [f"{n}/keys"], f"{n}/Keys", axis=1)[0]  # (B, P + Q)
    q = g.node("Unsqueeze", ["position_ids", g.init(f"{n}.axes2", np.array([2], np.int64))], [f"{n}/q"], f"{n}/Q3")[0]
    k = g.node("Unsqueeze", [keys, g.init(f"{n}.axes1", np.array([1], np.int64))], [f"{n}/k"], f"{n}/K3")[0]
    behind = g.node("Sub", [q, k], [f"{n}/behind"], f"{n}/Behind")[0]
    near = g.node("Less", [behind, g.init(f"{n}.size", np.array(window, np.int64))], [f"{n}/near"], f"{n}/Near")[0]
    both = g.node("And", ["attention_mask", near], [f"{n}/mask"], f"{n}/And")[0]
    shared["window_mask"] = g.node("Unsqueeze", [both, "axes.1"], [f"{n}/b1qk"], f"{n}/Unsqueeze")[0]
    return shared["window_mask"]


def export_standard_graph(
    checkpoint: str | Path, out_dir: str | Path, hidden_layers: tuple[int, ...] | None = None
) -> Path:
    """Write the standard step graph of `checkpoint` to `out_dir` (replaced atomically), with a
    manifest like the portable export's, its `graph_flavour` "standard"."""
    return export_written_graph(checkpoint, out_dir, StandardOps(), hidden_layers, STANDARD_OPSET)
