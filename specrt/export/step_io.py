"""The step graph's I/O: the one definition of its tensor names, dtypes and dynamic axes.

    inputs   input_ids [B, Q] int64, position_ids [B, Q] int64, attention_mask [B, Q, P+Q] bool,
             logits_index [B, K] int64, past_key_values.{i}.key/value [B, Hkv, P, D] float32
    outputs  logits [B, K, V] float32, hidden_states [B, Q, H*] float32,
             present.{i}.key/value [B, Hkv, Q, D] float32 (the Q new positions only)

The exporter, every step backend, the TensorRT profiles and the tests' TensorRT stand-in derive
their names from `StepIO`; nothing else spells them. No heavy imports: backends and engine
builders read it without torch.

How callers pass the past is part of the contract too (`attention_mask`): a preallocated buffer
of fixed capacity per row, whose slots past each row's committed length the mask hides.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# the four per-step inputs, in the graph's order (the past KV follows them)
STEP_INPUTS = ("input_ids", "position_ids", "attention_mask", "logits_index")
LOGITS, HIDDEN = "logits", "hidden_states"
INPUT_DTYPES = {"input_ids": "int64", "position_ids": "int64", "attention_mask": "bool", "logits_index": "int64"}


@dataclasses.dataclass(frozen=True)
class StepIO:
    """Names and dynamic axes of the step graph of a model with `num_layers` layers."""

    num_layers: int

    def past(self, layer: int) -> tuple[str, str]:
        return f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"

    def present(self, layer: int) -> tuple[str, str]:
        return f"present.{layer}.key", f"present.{layer}.value"

    @property
    def past_names(self) -> list[str]:
        return [n for i in range(self.num_layers) for n in self.past(i)]

    @property
    def present_names(self) -> list[str]:
        return [n for i in range(self.num_layers) for n in self.present(i)]

    @property
    def input_names(self) -> list[str]:
        return [*STEP_INPUTS, *self.past_names]

    @property
    def output_names(self) -> list[str]:
        return [LOGITS, HIDDEN, *self.present_names]

    def dtype(self, name: str) -> str:
        """numpy/torch dtype name of a tensor (the KV and the outputs are float32)."""
        return INPUT_DTYPES.get(name, "float32")

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        axes = {
            "input_ids": {0: "batch", 1: "q_len"},
            "position_ids": {0: "batch", 1: "q_len"},
            "attention_mask": {0: "batch", 1: "q_len", 2: "kv_len"},
            "logits_index": {0: "batch", 1: "n_logits"},
            LOGITS: {0: "batch", 1: "n_logits"},
            HIDDEN: {0: "batch", 1: "q_len"},
        }
        axes.update({n: {0: "batch", 2: "past_len"} for n in self.past_names})
        axes.update({n: {0: "batch", 2: "q_len"} for n in self.present_names})
        return axes


def attention_mask(lengths: np.ndarray, capacity: int, q_len: int, new_mask: np.ndarray | None = None) -> np.ndarray:
    """(B, Q, C + Q) bool mask for a step of Q new positions over a past buffer of capacity C.

    Past part: row b sees slots [0, lengths[b]). New part: `new_mask` (Q, Q) or (B, Q, Q)
    (a tree: each position sees its ancestors and itself), causal by default."""
    lengths = np.asarray(lengths)
    mask = np.zeros((len(lengths), q_len, capacity + q_len), dtype=bool)
    mask[:, :, :capacity] = (np.arange(capacity)[None, :] < lengths[:, None])[:, None, :]
    mask[:, :, capacity:] = np.tril(np.ones((q_len, q_len), dtype=bool)) if new_mask is None else new_mask
    return mask
