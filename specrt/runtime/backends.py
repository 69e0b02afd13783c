"""Step backends: one forward step of the target model, behind one small interface.

A backend runs the step graph contract of DESIGN.md on numpy arrays:
    step(input_ids (B, Q), position_ids (B, Q), attention_mask (B, Q, C+Q), cache) -> StepOutput
reading past KV straight from the cache's preallocated buffers (no copy) and returning the KV
of the Q new positions, which the caller commits with `cache.append`.

- OrtBackend: an ONNX Runtime session on a built engine (the deployment path).
- TorchBackend: our PyTorch model (the reference, and the path for GPUs without an engine).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from specrt.export.config import ModelConfig
from specrt.runtime.kv_cache import KVCache


@dataclasses.dataclass
class StepOutput:
    logits: np.ndarray  # (B, Q, V) float32
    hidden_states: np.ndarray  # (B, Q, C * len(hidden_layers)) float32
    present: list[tuple[np.ndarray, np.ndarray]]  # per layer (key, value), each (B, Hkv, Q, D)


class StepBackend(Protocol):
    config: ModelConfig
    description: str  # what runs, e.g. "onnxruntime 1.32.0 CPUExecutionProvider"

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: KVCache) -> StepOutput: ...


class OrtBackend:
    def __init__(self, session, config: ModelConfig, provider: str):
        import onnxruntime

        self.session = session
        self.config = config
        self.description = f"onnxruntime {onnxruntime.__version__} {provider}"
        L = config.num_hidden_layers
        self._past_names = [(f"past_key_values.{i}.key", f"past_key_values.{i}.value") for i in range(L)]
        self._output_names = [o.name for o in session.get_outputs()]

    def step(self, input_ids, position_ids, attention_mask, cache):
        feeds = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask}
        for i, (kname, vname) in enumerate(self._past_names):
            feeds[kname], feeds[vname] = cache.past(i)
        out = self.session.run(self._output_names, feeds)
        return StepOutput(out[0], out[1], list(zip(out[2::2], out[3::2])))


class TorchBackend:
    def __init__(self, model):
        import torch

        self.model = model.eval()
        self.config = model.cfg
        self.description = f"torch {torch.__version__} (reference, cpu)"

    def step(self, input_ids, position_ids, attention_mask, cache):
        import torch

        past = [tuple(torch.from_numpy(t) for t in cache.past(i)) for i in range(cache.num_layers)]
        with torch.inference_mode():
            logits, hidden, present = self.model(
                torch.from_numpy(input_ids), torch.from_numpy(position_ids), torch.from_numpy(attention_mask), past
            )
        return StepOutput(logits.numpy(), hidden.numpy(), [(k.numpy(), v.numpy()) for k, v in present])
