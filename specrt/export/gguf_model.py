"""A GGUF file's model as the graph writers read it: one weight at a time, never all of it.

    model = streamed_model(Path("model.gguf"))     # a LlamaModel; its matrices are GgufWeights
    w = model.layers[0].mlp.up_proj.weight          # a GgufWeight: nothing read yet
    w.float32()                                     # (N, K) float32, the conversion's exact values
    w.tensor                                        # the file's tensor: a 4-bit recipe reads its blocks
    materialize(model, ("lm_head",))                # these modules' matrices read, as float32

A Q4_K_M file of a 1.5B model is 1.1 GB; its float32 dequantization is 6.2 GB, and a graph writer
that held it (with the graph it writes) needed more than this machine's 24 GB for a 1.5B model.
Here the model is built on torch's meta device (no memory), its norms and biases (vectors: a few
hundred kilobytes) are read as they are, and every matrix is a `GgufWeight` the writer reads when
it writes that product: from the file's blocks (calibration/gguf_blocks.py) or as float32, one
tensor resident at a time (the file itself is memory-mapped).

Families whose weights load through a transformation of the whole state dict (Phi-3's fused
q|k|v split into three) are not streamed: `streamable` says which are.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from specrt.export.gguf import GgufTensors, gguf_model_facts, open_gguf
from specrt.export.llama import LlamaModel, inv_freq
from specrt.schema.arch import FAMILIES
from specrt.schema.arch.base import _same


class GgufWeight:
    """One matrix of a GGUF file (N outputs, K inputs), read when it is asked for."""

    def __init__(self, tensor, tensors: GgufTensors):
        self.tensor, self.tensors = tensor, tensors
        self.shape = tuple(int(d) for d in reversed(tensor.shape))
        self.ndim = len(self.shape)

    @property
    def name(self) -> str:
        return self.tensor.name

    @property
    def heads(self) -> int | None:
        """The heads whose rows the conversion unpermutes (None: rows as stored)."""
        return self.tensors.heads(self.tensor)

    def float32(self) -> np.ndarray:
        return self.tensors.float32(self.tensor)

    def __repr__(self) -> str:
        return f"GgufWeight({self.name}, {self.tensor.tensor_type.name}, {self.shape})"


def streamable(path: Path) -> bool:
    """Whether the GGUF file's family loads weight by weight (its state needs no transformation)."""
    from specrt.export.gguf import gguf_family

    family = gguf_family(open_gguf(Path(path)), Path(path))
    return FAMILIES[family.architecture].weights is _same


def streamed_model(path: Path, hidden_layers: tuple[int, ...] | None = None) -> LlamaModel:
    """The model of GGUF file `path` with its matrices left in the file (module docstring)."""
    from specrt.schema.head_io import default_target_layers

    path = Path(path)
    reader = open_gguf(path)
    cfg, tensors = gguf_model_facts(reader, path)
    if hidden_layers is None:
        hidden_layers = default_target_layers(cfg.num_hidden_layers)
    with torch.device("meta"):
        model = LlamaModel(cfg, hidden_layers=hidden_layers)
    model.inv_freq = inv_freq(cfg)  # the buffers the writers read, computed (not loaded)
    if cfg.rope_local_theta:
        model.local_inv_freq = inv_freq(cfg, local=True)
    if cfg.embed_scale is not None:
        model.embed_scale = torch.tensor(cfg.embed_scale, dtype=torch.float32)
    for t in reader.tensors:
        owner, leaf = _module_of(model, tensors.hf_name(t).removeprefix("model."))
        if len(t.shape) == 2:
            owner._parameters.pop(leaf, None)
            object.__setattr__(owner, leaf, GgufWeight(t, tensors))
        else:
            owner._parameters[leaf] = nn.Parameter(torch.from_numpy(tensors.float32(t)), requires_grad=False)
    if cfg.tie_word_embeddings:
        model.lm_head._parameters.pop("weight", None)
        object.__setattr__(model.lm_head, "weight", model.embed_tokens.weight)
    _require_complete(model, path)
    return model.eval()


def materialize(model: LlamaModel, prefixes: tuple[str, ...]) -> LlamaModel:
    """Read the matrices of a streamed model under the named modules (e.g. "embed_tokens",
    "lm_head", "layers.27") as float32 parameters, in place; the rest stay in the file. What a
    draft head's trainer copies from its target (embedding, output head, last layer): 2 GB of
    the 1.5B's 6.2 GB of float32. A weight two modules share (a tied head) is read once."""
    read: dict[int, nn.Parameter] = {}
    for prefix in prefixes:
        owner = model.get_submodule(prefix)
        for module in owner.modules():
            for leaf, value in list(vars(module).items()):
                if isinstance(value, GgufWeight):
                    if id(value) not in read:
                        read[id(value)] = nn.Parameter(torch.from_numpy(value.float32()), requires_grad=False)
                    delattr(module, leaf)
                    module._parameters[leaf] = read[id(value)]
    return model


def _module_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    *path, leaf = name.split(".")
    module = model
    for part in path:
        module = getattr(module, part)
    return module, leaf


def _require_complete(model: LlamaModel, path: Path) -> None:
    """Refuse a file that left a weight of the model unread (still on the meta device)."""
    from specrt.errors import CheckpointError

    missing = sorted(k for k, p in model.named_parameters() if p.is_meta)
    if missing:
        raise CheckpointError(
            f"{path} lacks {len(missing)} weights its model has (first: {missing[0]}); the file is incomplete or of "
            "another model."
        )
