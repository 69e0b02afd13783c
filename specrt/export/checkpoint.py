"""Loading checkpoints: a Hugging Face directory (config.json + safetensors, never pickle) or GGUF.

`load_model(path)` returns our LlamaModel in float32 with the checkpoint's weights.
`checkpoint_hash(path)` is the fingerprint every artifact manifest records (schema/checkpoint_files.py:
torch-free, so opening an engine loads no torch).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specrt.errors import CheckpointError
from specrt.export.llama import LlamaModel
from specrt.schema.checkpoint_files import checkpoint_hash, gguf_weights, require_checkpoint_dir, weight_files
from specrt.schema.config import ModelConfig

__all__ = ["checkpoint_hash", "gguf_weights", "load_config", "load_model", "require_checkpoint_dir", "weight_files"]


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if path.suffix == ".gguf":
        from specrt.export.gguf import read_gguf

        return read_gguf(path)[0]
    require_checkpoint_dir(path)
    return ModelConfig.from_json_file(path / "config.json")


def read_state_dict(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state = {}
    for f in weight_files(ckpt_dir):
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(
                f"{f} is not a readable safetensors file ({e}); re-download or re-convert it."
            ) from None
    return state


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], source: str, hidden_layers=None) -> LlamaModel:
    """Our model from a transformers-named state dict ('model.' prefixes optional). hidden_layers:
    the features `hidden_states` carries (default: what the step graph exports, every draft
    head's layers)."""
    if hidden_layers is None:
        from specrt.schema.head_io import default_target_layers

        hidden_layers = default_target_layers(cfg.num_hidden_layers)
    from specrt.schema.arch import FAMILIES

    state = {k.removeprefix("model."): v.to(torch.float32) for k, v in state.items()}
    state = FAMILIES[cfg.architecture].weights(state)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = LlamaModel(cfg, hidden_layers=hidden_layers)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(
            f"{source} lacks {len(missing)} weights the config asks for (first: {missing[0]}); "
            "the checkpoint is incomplete or its config.json belongs to another model."
        )
    for k, shape in expected.items():
        if tuple(state[k].shape) != tuple(shape):
            raise CheckpointError(
                f"{source}: weight {k} has shape {tuple(state[k].shape)}, the config implies {tuple(shape)}; "
                "config.json does not match the weights."
            )
    model.load_state_dict({k: state[k] for k in expected}, strict=False)
    return model.eval()


def load_model(path: str | Path, hidden_layers=None, streamed: bool = False) -> LlamaModel:
    """Our float32 model from a HF checkpoint directory, a .gguf file, or a directory converted
    from a GGUF file whose weights stay in it (`specrt convert --weights gguf`). streamed: where
    the weights are a GGUF file's, leave its matrices there (export/gguf_model.py: the graph
    writers read one at a time); else every weight is read now, as float32."""
    path = Path(path)
    gguf = gguf_weights(path)
    if gguf is not None:
        from specrt.export.gguf import read_gguf
        from specrt.export.gguf_model import streamable, streamed_model

        if streamed and streamable(gguf):
            return streamed_model(gguf, hidden_layers)
        cfg, state, _ = read_gguf(gguf)
        return build_model(cfg, state, str(path), hidden_layers)
    cfg = load_config(path)
    return build_model(cfg, read_state_dict(path), str(path), hidden_layers)
