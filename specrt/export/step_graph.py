"""Export the target step graph to ONNX: one graph for prefill, decode and (tree) verification.

Inputs:  input_ids [B, Q] int64, position_ids [B, Q] int64, attention_mask [B, Q, P+Q] bool,
         logits_index [B, K] int64 (positions whose logits are computed: all Q to verify, the
         last one to prefill), past_key_values.{i}.key / .value [B, Hkv, P, D] float32
Outputs: logits [B, K, V] float32, hidden_states [B, Q, C*k] float32,
         present.{i}.key / .value [B, Hkv, Q, D] float32 (the Q new positions only)

The directory written holds model.onnx, model.onnx.data (external weights) and manifest.json.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specrt.artifacts import (
    atomic_dir,
    write_manifest,
)
from specrt.errors import SpecrtError
from specrt.export.checkpoint import checkpoint_hash, load_model
from specrt.export.llama import LlamaModel, causal_mask
from specrt.schema.config import ModelConfig
from specrt.schema.graph_files import (
    DEFAULT_OPSET,
    ONNX_FILE,
    ONNX_KIND,
    graph_manifest,
    save_graph,
)
from specrt.schema.step_io import StepIO

MIN_OPSET = 9  # the graph's Where needs 9 (the exporter fails below); the newest is torch's own limit


def check_opset(opset: int) -> None:
    """Refuse an opset torch's exporter cannot write, before anything is traced."""
    from torch.onnx import _constants

    newest = getattr(_constants, "ONNX_MAX_OPSET", DEFAULT_OPSET)
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= newest:
        raise SpecrtError(
            f"ONNX opset {opset!r} cannot be exported here: torch {torch.__version__} writes opsets {MIN_OPSET} to "
            f"{newest}; give --opset in that range (default {DEFAULT_OPSET})"
        )


# the compute dtypes an export may have (`--quantize fp16|bf16` asks for the 16-bit ones)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class StepGraph(nn.Module):
    """Flat-argument wrapper of LlamaModel.forward for the exporter."""

    def __init__(self, model: LlamaModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask, logits_index, *past_flat):
        past = list(zip(past_flat[0::2], past_flat[1::2]))
        logits, hidden, present = self.model(input_ids, position_ids, attention_mask, past, logits_index)
        return (logits, hidden, *[t for kv in present for t in kv])


def example_inputs(cfg: ModelConfig, batch=2, q=3, past=4):
    """Inputs used for tracing; every dynamic axis > 1 so none is specialised away."""
    ids = torch.randint(0, cfg.vocab_size, (batch, q))
    pos = torch.arange(past, past + q).unsqueeze(0).expand(batch, q).contiguous()
    mask = causal_mask(batch, q, past)
    index = torch.tensor([[q - 2, q - 1]] * batch)  # K = 2 != Q, so neither is specialised to the other
    kv = torch.zeros(batch, cfg.num_key_value_heads, past, cfg.head_dim)
    return (ids, pos, mask, index, *[kv.clone() for _ in range(2 * cfg.num_hidden_layers)])


def share_tied_embedding(proto, embed_name: str = "model.embed_tokens.weight") -> bool:
    """Store a tied embedding once. The TorchScript exporter folds the LM head's transpose into a
    second constant W^T [C, V] next to the embedding W [V, C] (+113 MB for SmolLM2); the lookup
    becomes Gather(W^T, ids, axis=1) -> [C, B, Q], transposed to [B, Q, C], and W is dropped.
    Returns False (graph untouched) unless exactly that pattern, with W^T equal to W.T, is found."""
    import onnx
    from onnx import numpy_helper

    graph = proto.graph
    inits = {i.name: i for i in graph.initializer}
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] == embed_name]
    heads = [n for n in graph.node if n.op_type == "MatMul" and "lm_head" in n.name and n.input[1] in inits]
    if embed_name not in inits or len(gathers) != 1 or len(heads) != 1:
        return False
    w, wt = numpy_helper.to_array(inits[embed_name]), numpy_helper.to_array(inits[heads[0].input[1]])
    if wt.shape != w.T.shape or not np.array_equal(wt, w.T):
        return False
    gather = gathers[0]
    if any(a.name == "axis" and a.i != 0 for a in gather.attribute):
        return False
    out = gather.output[0]
    gather.input[0] = heads[0].input[1]
    del gather.attribute[:]
    gather.attribute.append(onnx.helper.make_attribute("axis", 1))
    gather.output[0] = out + "/hidden_first"
    transpose = onnx.helper.make_node(
        "Transpose", [gather.output[0]], [out], name=gather.name + "/to_bqc", perm=[1, 2, 0]
    )
    position = list(graph.node).index(gather) + 1
    graph.node.insert(position, transpose)
    graph.initializer.remove(inits[embed_name])
    return True


def export_step_graph(
    checkpoint: str | Path,
    out_dir: str | Path,
    opset: int = DEFAULT_OPSET,
    hidden_layers: tuple[int, ...] | None = None,
    progress: bool = True,
    dtype: str = "float32",
    manifest_extra: dict | None = None,
) -> Path:
    """Export `checkpoint` (HF dir or .gguf) to `out_dir`; returns out_dir. hidden_layers: the
    layers `hidden_states` returns (default: every draft head's, draft_head.default_target_layers).
    dtype: the weights' and the compute's (a key of DTYPES; the I/O stays float32).
    manifest_extra: fields added to the manifest (a 16-bit export names its scheme there)."""
    import onnx
    from tqdm import tqdm

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    check_opset(opset)
    steps = tqdm(total=5, desc="export", unit="step", disable=not progress)
    steps.set_postfix_str("hash checkpoint")
    ckpt_hash = checkpoint_hash(checkpoint)
    steps.update()
    steps.set_postfix_str("load weights")
    if hidden_layers is None:
        from specrt.export.checkpoint import load_config
        from specrt.schema.head_io import default_target_layers

        hidden_layers = default_target_layers(load_config(checkpoint).num_hidden_layers)
    model = load_model(checkpoint, hidden_layers=hidden_layers)
    if dtype != "float32":
        model.to_dtype(DTYPES[dtype])
    cfg = model.cfg
    io = StepIO(cfg.num_hidden_layers)
    steps.update()
    with atomic_dir(out_dir) as tmp:
        steps.set_postfix_str("trace to ONNX")
        t0 = time.perf_counter()
        traced_path = tmp / "traced.onnx"
        with torch.no_grad(), warnings.catch_warnings():
            # the TorchScript exporter is deprecated in favour of dynamo, which takes ~5x longer
            # on this graph (measured here); it is chosen on purpose
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.filterwarnings("ignore", message=".*Converting a tensor to a Python.*")
            torch.onnx.export(
                StepGraph(model),
                example_inputs(cfg),
                str(traced_path),
                input_names=io.input_names,
                output_names=io.output_names,
                dynamic_axes=io.dynamic_axes,
                opset_version=opset,
                do_constant_folding=True,
                dynamo=False,
            )
        steps.update()
        steps.set_postfix_str("save with external data")
        proto = onnx.load(str(traced_path))
        shared = cfg.tie_word_embeddings and share_tied_embedding(proto)
        for p in tmp.iterdir():
            p.unlink()
        save_graph(proto, tmp)
        del proto
        steps.update()
        steps.set_postfix_str("onnx.checker full check")
        onnx.checker.check_model(str(tmp / ONNX_FILE), full_check=True)
        export_s = time.perf_counter() - t0
        body = graph_manifest(tmp, checkpoint, ckpt_hash, cfg, hidden_layers, io, opset, export_s)
        body |= {"exporter": "torch.onnx (TorchScript)", "tied_embedding_shared": bool(shared), "compute_dtype": dtype}
        write_manifest(tmp, ONNX_KIND, body | (manifest_extra or {}))
        steps.update()
    steps.close()
    return out_dir
