"""The graph writer: a step graph written node by node from a checkpoint's weights, its norms,
attention and I/O from an `ops` object, its matrix products from a `products` object.

    proto = write_graph(model, FusedOps(), products)         # an onnx ModelProto
    export_written_graph(checkpoint, out_dir, ops)           # model.onnx, its data, manifest.json

Two flavours use it: the fused graph (export/fused_graph.py `FusedOps`: ORT's fused operators,
the KV cache written in place) and the standard graph (export/standard_graph.py `StandardOps`:
opset-23 operators for TensorRT). A products object writes x @ W^T: `FloatProducts` as MatMuls
over the float weights; a 4-bit recipe's (calibration/blocks.py) as MatMulNBits over their blocks.
A products object may also take a product's bias (`biased`) and an MLP's SwiGLU (`swiglu`) into
the product itself (calibration/gguf_kernel.py: specrt's kernel); where it does not, they are
graph nodes.
Each layer is: input norm, q|k|v product, attention, o product, post-attention norm, gate|up
product, act(gate) * up, down product; the final norm, the features and the head. A family's
facts (schema/arch/base.py) add: a scaled embedding, norms after attention and after the MLP,
per-head q/k norms, the gelu, a sliding window and its rotary on some layers (`local` below).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

from specrt.artifacts import atomic_dir, write_manifest
from specrt.export.checkpoint import checkpoint_hash, load_model
from specrt.export.llama import LlamaModel, rotary
from specrt.export.step_graph import check_opset
from specrt.schema.graph_files import DEFAULT_OPSET, ONNX_DATA, ONNX_FILE, ONNX_KIND, graph_manifest, save_graph
from specrt.schema.step_io import HIDDEN, LOGITS, STEP_ROOM, StepIO


class GraphBuilder:
    """Nodes and initializers of one graph; names are the tensors'.

    With `data` (a file path), every initializer over 1 KiB is written there as it is made and
    the graph keeps only its place (ONNX external data): a graph of a billion weights is then
    never whole in memory; `close` it, then save the graph (graph_files.save_graph) beside `data`."""

    def __init__(self, data: Path | None = None):
        self.nodes, self.inits = [], []
        self._names: set[str] = set()
        self._data = open(data, "wb") if data is not None else None  # noqa: SIM115 (closed by close())
        self._location = None if data is None else Path(data).name

    def init(self, name: str, array: np.ndarray) -> str:
        from onnx import TensorProto, helper, numpy_helper

        array = np.ascontiguousarray(array)
        if self._data is None or array.nbytes <= EXTERNAL_MIN_BYTES:
            return self._keep(numpy_helper.from_array(array, name))
        # the bytes go to the file straight from the array: a TensorProto that held them would
        # keep them in its protobuf arena after they are cleared
        offset = -self._data.tell() % EXTERNAL_ALIGN + self._data.tell()  # page-aligned: ORT can map it
        self._data.seek(offset)
        self._data.write(memoryview(array).cast("B"))
        tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self._location), ("offset", offset), ("length", array.nbytes)):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
        return self._keep(tensor)

    def _keep(self, tensor) -> str:
        self.inits.append(tensor)
        self._names.add(tensor.name)
        return tensor.name

    def close(self) -> None:
        """Flush the external data file to disk."""
        if self._data is not None:
            self._data.flush()
            os.fsync(self._data.fileno())
            self._data.close()
            self._data = None

    def has(self, name: str) -> bool:
        return name in self._names

    def node(self, op: str, inputs: list[str], outputs: list[str], name: str, domain: str = "", **attrs) -> list[str]:
        from onnx import helper

        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs


EXTERNAL_MIN_BYTES = 1024  # as save_graph: smaller tensors stay inside model.onnx
EXTERNAL_ALIGN = 4096


class FloatProducts:
    """The products x @ W^T of the float graph: one MatMul over weights side by side (q/k/v and
    gate/up each run as one product). A 4-bit recipe gives its own (calibration/blocks.py
    BlockProducts: the same products on MatMulNBits), with the same `product` call."""

    scheme = "none"

    def manifest(self) -> dict:
        return {}

    def lookup(self, g: GraphBuilder, embed, tied: bool) -> str:
        """The embedding of input_ids (B, Q, C) from the float table; a tied table is stored
        once, as the head's W^T (C, V)."""
        if tied:
            table = g.init("lm_head.weight_t", f32(embed).T)
            cbq = g.node("Gather", [table, "input_ids"], ["embed/cbq"], "embed/Gather", axis=1)[0]
            return g.node("Transpose", [cbq], ["embed/out"], "embed/to_bqc", perm=[1, 2, 0])[0]
        table = g.init("embed_tokens.weight", f32(embed))
        return g.node("Gather", [table, "input_ids"], ["embed/out"], "embed/Gather")[0]

    def product(self, g: GraphBuilder, x: str, weights: list, name: str) -> str:
        """The name of x @ [W_1; W_2; ...]^T (outputs of the weights (N_i, K) concatenated)."""
        table = f"{name}.weight_t"
        if not g.has(table):  # (a tied head's W^T is the embedding's table, written already)
            g.init(table, np.concatenate([f32(w) for w in weights], axis=0).T)  # (K, sum N_i)
        return g.node("MatMul", [x, table], [f"{name}/out"], name)[0]


def f32(t) -> np.ndarray:
    """A weight as float32: a tensor's values, or a streamed weight read now (export/gguf_model.py)."""
    if hasattr(t, "float32"):
        return t.float32()
    return t.detach().to(torch.float32).numpy()


def write_graph(model: LlamaModel, ops, products=None, opset: int = DEFAULT_OPSET, data: Path | None = None):
    """A step graph of `model` written node by node: `ops` gives its norms, attention and I/O
    (FusedOps in export/fused_graph.py, StandardOps in export/standard_graph.py), `products` its
    matrix products; with `data`, its initializers stream into that file as they are written
    (GraphBuilder), and the graph returned refers to it."""
    products = products or FloatProducts()
    io = StepIO(model.cfg.num_hidden_layers, ops.io_flavour)
    g = GraphBuilder(data)
    try:
        return _write_graph(g, model, ops, products, opset, io)
    finally:
        g.close()


def _write_graph(g: GraphBuilder, model: LlamaModel, ops, products, opset: int, io: StepIO):
    from onnx import TensorProto, helper

    cfg = model.cfg
    L, C = cfg.num_hidden_layers, cfg.hidden_size
    eps = float(cfg.rms_norm_eps)

    x = products.lookup(g, model.embed_tokens.weight, cfg.tie_word_embeddings)  # the embedding
    if cfg.embed_scale is not None:
        scale = g.init("embed.scale", np.array(cfg.embed_scale, np.float32))
        x = g.node("Mul", [x, scale], ["embed/scaled"], "embed/Scale")[0]

    # the rotary tables at every position the model takes, as the portable graph computes them,
    # and STEP_ROOM more: a step's padding past the context's end (ORT's attention refuses a step
    # whose slots pass its table)
    positions = torch.arange(cfg.max_position_embeddings + STEP_ROOM)[None]
    R = cfg.rotary_dims // 2
    cos, sin = (t[0, 0, :, :R].numpy() for t in rotary(positions, model.inv_freq))
    shared = {
        "cos_cache": g.init("rotary.cos", cos),
        "sin_cache": g.init("rotary.sin", sin),
    }
    if cfg.rope_local_theta:  # the sliding layers' own base
        cos, sin = (t[0, 0, :, :R].numpy() for t in rotary(positions, model.local_inv_freq))
        shared |= {
            "local_cos_cache": g.init("rotary.local_cos", cos),
            "local_sin_cache": g.init("rotary.local_sin", sin),
        }
    taps = {}  # layer index -> the residual stream after that layer (hidden_layers reads them)
    residual, pending = x, None  # pending: the last block's output, not yet added to the residual
    for i, layer in enumerate(model.layers):
        h, residual = ops.norm(g, pending, residual, layer.input_layernorm.scale(), eps, f"layers.{i}.input_norm")
        if i > 0:
            taps[i - 1] = residual
        pending, residual = _layer(g, ops, products, model, i, h, residual, io, shared)
    final, residual = ops.norm(g, pending, residual, model.norm.scale(), eps, "norm")
    taps[L - 1], taps[-1] = residual, final

    feats = [taps[j] for j in model.hidden_layers]
    if len(feats) > 1:
        g.node("Concat", feats, [HIDDEN], "hidden/Concat", axis=-1)
    else:
        g.node("Identity", feats, [HIDDEN], "hidden/Identity")
    index = g.node("Unsqueeze", ["logits_index", g.init("axes.2", np.array([2], np.int64))], ["index/bk1"], "index")[0]
    picked = g.node("GatherND", [final, index], ["head/in"], "head/GatherND", batch_dims=1)[0]
    if cfg.tie_word_embeddings and g.has("lm_head.weight_t"):  # the lookup's table is the head's W^T
        logits = g.node("MatMul", [picked, "lm_head.weight_t"], ["lm_head/out"], "lm_head")[0]
    else:
        logits = products.product(g, picked, [model.lm_head.weight], "lm_head")
    if cfg.output_vocab is not None:
        logits = _scatter_into_vocabulary(g, logits, model.output_ids.numpy(), cfg.vocab_size)
    g.node("Identity", [logits], [LOGITS], "logits")

    elem = {
        "float32": TensorProto.FLOAT,
        "bool": TensorProto.BOOL,
        "int32": TensorProto.INT32,
        "int64": TensorProto.INT64,
    }
    dims = _dims(io, cfg, C * len(model.hidden_layers))
    inputs = [helper.make_tensor_value_info(n, elem[io.dtype(n)], dims[n]) for n in io.input_names]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, dims[n]) for n in io.output_names]
    graph = helper.make_graph(g.nodes, f"specrt-{ops.flavour}-step", inputs, outputs, g.inits)
    extra = products.opsets() if hasattr(products, "opsets") else []  # a products' own operators' domain
    return helper.make_model(graph, opset_imports=ops.opsets(opset) + extra, producer_name="specrt")


def _dims(io: StepIO, cfg, width: int) -> dict[str, list]:
    """Each I/O tensor's dimensions: the dynamic axes' names (step_io) and the model's sizes."""
    fixed = {"logits": cfg.vocab_size, "hidden_states": width}
    fixed |= {n: (cfg.num_key_value_heads, cfg.head_dim) for n in (*io.past_names, *io.present_names)}
    ranks = {"total_sequence_length": 0, "seqlens_k": 1, "query_seqlens": 1, "attention_bias": 4, "attention_mask": 3}
    dims = {}
    for n in (*io.input_names, *io.output_names):
        axes = io.dynamic_axes.get(n, {})
        if n in ranks:
            shape: list = [1] * ranks[n]
        elif n.startswith(("past", "present")):
            shape = [None, fixed[n][0], None, fixed[n][1]]
        else:
            shape = [None, None] if n not in fixed else [None, None, fixed[n]]
        dims[n] = [axes.get(a, d) for a, d in enumerate(shape)]
    return dims


def _layer(g: GraphBuilder, ops, products, model: LlamaModel, i: int, h: str, residual: str, io: StepIO, shared: dict):
    """Decoder layer i after its input norm `h`: attention, the second norm, the MLP. Returns
    (its MLP's output, the residual stream after attention); the next norm adds the two."""
    cfg, layer, p = model.cfg, model.layers[i], f"layers.{i}"
    att, mlp, eps = layer.self_attn, layer.mlp, float(cfg.rms_norm_eps)
    qkv_weights = [att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]
    if cfg.attention_bias:
        b = np.concatenate([f32(att.q_proj.bias), f32(att.k_proj.bias), f32(att.v_proj.bias)])
        qkv = _biased(g, products, h, qkv_weights, b, f"{p}.qkv_proj")
    else:
        qkv = products.product(g, h, qkv_weights, f"{p}.qkv_proj")
    norms = (f32(att.q_norm.scale()), f32(att.k_norm.scale())) if cfg.qk_norm else None
    a = ops.attention(g, cfg, i, qkv, io, shared, norms)
    o = products.product(g, a, [att.o_proj.weight], f"{p}.o_proj")
    if cfg.sandwich_norms:  # the attention's output normed before the residual takes it
        o = ops.norm(g, None, o, layer.post_attention_layernorm.scale(), eps, f"{p}.post_attn_norm")[0]
        mlp_norm = layer.pre_feedforward_layernorm
    else:
        mlp_norm = layer.post_attention_layernorm
    h, residual = ops.norm(g, o, residual, mlp_norm.scale(), eps, f"{p}.post_norm")
    prod = _gated(g, ops, products, cfg, h, [mlp.gate_proj.weight, mlp.up_proj.weight], shared, p)
    down = products.product(g, prod, [mlp.down_proj.weight], f"{p}.down_proj")
    if cfg.sandwich_norms:
        down = ops.norm(g, None, down, layer.post_feedforward_layernorm.scale(), eps, f"{p}.post_mlp_norm")[0]
    return down, residual


def _biased(g: GraphBuilder, products, x: str, weights: list, bias: np.ndarray, name: str) -> str:
    """x @ W^T + bias: the products' own where they add it inside the product (`biased`, None where
    they cannot), else an Add."""
    if hasattr(products, "biased"):
        out = products.biased(g, x, weights, bias, name)
        if out is not None:
            return out
    out = products.product(g, x, weights, name)
    return g.node("Add", [out, g.init(f"{name}.bias", bias)], [f"{name}/biased"], f"{name}/Add")[0]


def _gated(g: GraphBuilder, ops, products, cfg, x: str, gate_up: list, shared: dict, p: str) -> str:
    """The MLP's act(x @ gate^T) * (x @ up^T): the products' own where they apply SwiGLU inside the
    product (`swiglu`, None where they cannot), else one product, Split, the activation, Mul."""
    act_name = "gelu_tanh" if cfg.hidden_act == "gelu_tanh" else "silu"
    if act_name == "silu" and hasattr(products, "swiglu"):
        out = products.swiglu(g, x, gate_up, f"{p}.gate_up_proj")
        if out is not None:
            return out
    both = products.product(g, x, gate_up, f"{p}.gate_up_proj")
    halves = [f"{p}.mlp/gate", f"{p}.mlp/up"]
    if "mlp_split" not in shared:
        shared["mlp_split"] = g.init("mlp.split", np.array([cfg.intermediate_size] * 2, np.int64))
    gate, up = g.node("Split", [both, shared["mlp_split"]], halves, f"{p}.mlp/Split", axis=-1)
    if act_name == "gelu_tanh":
        act = ops.gelu_tanh(g, gate, f"{p}.mlp/Gelu")
    else:
        sig = g.node("Sigmoid", [gate], [f"{p}.mlp/sigmoid"], f"{p}.mlp/Sigmoid")[0]
        act = g.node("Mul", [gate, sig], [f"{p}.mlp/silu"], f"{p}.mlp/SiLU")[0]
    return g.node("Mul", [act, up], [f"{p}.mlp/gated"], f"{p}.mlp/Mul")[0]


def rotary_tables(cfg, i: int, shared: dict) -> tuple[str, str]:
    """Layer i's rotary cos and sin tables (a sliding layer's own where its base differs)."""
    if cfg.is_sliding(i) and "local_cos_cache" in shared:
        return shared["local_cos_cache"], shared["local_sin_cache"]
    return shared["cos_cache"], shared["sin_cache"]


def _scatter_into_vocabulary(g: GraphBuilder, logits: str, ids: np.ndarray, vocab: int) -> str:
    """A reduced head's logits (B, K, Vo) at their token ids in (B, K, V); every other token gets
    the most negative float (probability 0), as the portable graph does."""
    from onnx import TensorProto, helper

    shape = g.node("Shape", [logits], ["scatter/shape"], "scatter/Shape")[0]
    bk = g.node(
        "Slice",
        [shape, g.init("scatter.0", np.array([0])), g.init("scatter.2", np.array([2]))],
        ["scatter/bk"],
        "scatter/BK",
    )[0]
    full_shape = g.node("Concat", [bk, g.init("scatter.V", np.array([vocab]))], ["scatter/bkv"], "scatter/BKV", axis=0)[
        0
    ]
    low = helper.make_tensor("low", TensorProto.FLOAT, [1], [float(np.finfo(np.float32).min)])
    full = g.node("ConstantOfShape", [full_shape], ["scatter/full"], "scatter/Full", value=low)[0]
    index = g.node("Expand", [g.init("output_ids", ids.astype(np.int64)), shape], ["scatter/ids"], "scatter/Ids")[0]
    return g.node("ScatterElements", [full, index, logits], ["scatter/out"], "scatter/Scatter", axis=-1)[0]


def export_written_graph(
    checkpoint: str | Path,
    out_dir: str | Path,
    ops,
    hidden_layers: tuple[int, ...] | None = None,
    opset: int = DEFAULT_OPSET,
    products=None,
) -> Path:
    """Write the step graph `write_graph` makes with `ops` to `out_dir`, with its manifest."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    check_opset(opset)
    t0 = time.perf_counter()
    ckpt_hash = checkpoint_hash(checkpoint)
    if hidden_layers is None:
        from specrt.export.checkpoint import load_config
        from specrt.schema.head_io import default_target_layers

        hidden_layers = default_target_layers(load_config(checkpoint).num_hidden_layers)
    model = load_model(checkpoint, hidden_layers=hidden_layers, streamed=True)
    cfg = model.cfg
    io = StepIO(cfg.num_hidden_layers, ops.io_flavour)
    opset = ops.opset(opset)
    with atomic_dir(out_dir) as tmp:
        with torch.no_grad():
            products = products or FloatProducts()
            proto = write_graph(model, ops, products, opset, data=tmp / ONNX_DATA)
        save_graph(proto, tmp)
        del proto
        ops.check(tmp / ONNX_FILE)
        body = graph_manifest(tmp, checkpoint, ckpt_hash, cfg, hidden_layers, io, opset, time.perf_counter() - t0)
        body |= ops.manifest()
        write_manifest(tmp, ONNX_KIND, body | {"compute_dtype": "float32"} | products.manifest())
    return out_dir
