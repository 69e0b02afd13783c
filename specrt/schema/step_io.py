"""The step graph's I/O: the one definition of its tensor names, dtypes and dynamic axes.

The portable graph (export/step_graph.py, every backend):

    inputs   input_ids [B, Q] int64, position_ids [B, Q] int64, attention_mask [B, Q, P+Q] bool,
             logits_index [B, K] int64, past_key_values.{i}.key/value [B, Hkv, P, D] float32
    outputs  logits [B, K, V] float32, hidden_states [B, Q, H*] float32,
             present.{i}.key/value [B, Hkv, Q, D] float32 (the Q new positions only)

The fused graph (export/fused_graph.py, ONNX Runtime) takes the cache's bookkeeping instead of
the mask and writes the new positions into the cache buffer itself (past and present are one
buffer of capacity C, bound to both):

    inputs   input_ids, position_ids, logits_index as above; attention_bias [B or 1, 1, Q, T]
             float32 (0 / -inf: the tree among the new positions, T = longest row + Q),
             seqlens_k [B] int32 (each row's length after the step - 1), total_sequence_length []
             int32 (T), query_seqlens [B] int32 (new positions per row),
             past_key_values.{i}.key/value [B, Hkv, C, D] float32
    outputs  logits, hidden_states as above; present.{i}.key/value [B, Hkv, C, D]: the same
             buffers, with row b's Q new positions written at [length_b, length_b + Q)

The exporter, every step backend, the TensorRT profiles and the tests' TensorRT stand-in derive
their names from `StepIO`; nothing else spells them. No heavy imports: backends and engine
builders read it without torch.

How callers pass the past is part of the contract too (`attention_mask`): a preallocated buffer
of fixed capacity per row, whose slots past each row's committed length the mask hides. So is
the step floor: a step computes at least STEP_FLOOR positions per row.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# the four per-step inputs, in the graph's order (the past KV follows them)
STEP_INPUTS = ("input_ids", "position_ids", "attention_mask", "logits_index")
# the fused graph's, in its order
FUSED_INPUTS = (
    "input_ids",
    "position_ids",
    "attention_bias",
    "seqlens_k",
    "total_sequence_length",
    "query_seqlens",
    "logits_index",
)
LOGITS, HIDDEN = "logits", "hidden_states"
# the fewest positions per row a step computes (runtime/session.py pads a one-position step with
# one more, computed and left uncommitted). ONNX Runtime's CPU kernels compute a product of one
# row in another numeric class than a product of two or more (MatMulNBits, SGEMM, attention),
# and all products of two or more agree bitwise: with the floor, a position's logits are the
# same bits whether plain decoding, a verification step, a split step or a batch computes it
STEP_FLOOR = 2
# a backend that writes a step's positions into the cache in place (the fused ONNX graph, PyTorch)
# gives caches this many slots past their capacity for a step's padding, and verifies at most this
# many; the graphs' rotary tables reach this far past the model's context, since a dense step pads
# a row at the context's end to the longest row's positions (computed, never committed)
STEP_ROOM = 64
INPUT_DTYPES = {
    "input_ids": "int64",
    "position_ids": "int64",
    "attention_mask": "bool",
    "logits_index": "int64",
    "attention_bias": "float32",
    "seqlens_k": "int32",
    "total_sequence_length": "int32",
    "query_seqlens": "int32",
}
# the standard graph (export/standard_graph.py: opset-23 operators, for TensorRT) has the
# portable I/O: StepIO's flavour is the I/O contract, "fused" or any other
GRAPH_FLAVOURS = ("portable", "fused", "standard")


@dataclasses.dataclass(frozen=True)
class StepIO:
    """Names and dynamic axes of the step graph of a model with `num_layers` layers."""

    num_layers: int
    flavour: str = "portable"  # or "fused"

    @property
    def step_inputs(self) -> tuple[str, ...]:
        return FUSED_INPUTS if self.flavour == "fused" else STEP_INPUTS

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
        return [*self.step_inputs, *self.past_names]

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
            "logits_index": {0: "batch", 1: "n_logits"},
            LOGITS: {0: "batch", 1: "n_logits"},
            HIDDEN: {0: "batch", 1: "q_len"},
        }
        if self.flavour == "fused":
            axes.update(
                {
                    "attention_bias": {0: "bias_batch", 2: "q_len", 3: "total_len"},
                    "seqlens_k": {0: "batch"},
                    "query_seqlens": {0: "batch"},
                }
            )
            axes.update({n: {0: "batch", 2: "capacity"} for n in (*self.past_names, *self.present_names)})
            return axes
        axes["attention_mask"] = {0: "batch", 1: "q_len", 2: "kv_len"}
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


def in_place(lengths: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mask (B, Q, C), slots (B, Q)) of a step whose portable mask is `attention_mask`
    (B, Q, C + Q), for a backend that writes the new positions into the cache's C slots first
    (row b's at [lengths[b], lengths[b] + Q): `slots`) and attends over those C slots alone. A
    key then sits at its own slot whatever step computes it, and every step reduces over the same
    C slots: the order of a position's sums does not depend on the step's shape."""
    lengths = np.asarray(lengths, dtype=np.int64)
    B, Q, width = attention_mask.shape
    C = width - Q
    mask = attention_mask[:, :, :C].copy()
    slots = lengths[:, None] + np.arange(Q, dtype=np.int64)[None, :]
    mask[np.arange(B)[:, None, None], np.arange(Q)[None, :, None], slots[:, None, :]] = attention_mask[:, :, C:]
    return mask, slots


def fused_inputs(lengths: np.ndarray, attention_mask: np.ndarray) -> dict[str, np.ndarray]:
    """The fused graph's attention inputs for a step whose portable mask is `attention_mask`
    (B, Q, C + Q) over rows of `lengths` committed positions: the past is each row's first
    `lengths[b]` slots (as `attention_mask` builds it), the new positions go to
    [lengths[b], lengths[b] + Q) and see each other as the mask's last Q columns say. A chain is
    the graph's own causal order (a zero bias); a tree adds -inf where a node may not look."""
    lengths = np.asarray(lengths, dtype=np.int64)
    B, Q, width = attention_mask.shape
    new = attention_mask[:, :, width - Q :]
    T = int(lengths.max()) + Q
    if np.array_equal(new, np.broadcast_to(np.tri(Q, dtype=bool), new.shape)):
        bias = np.zeros((1, 1, Q, T), np.float32)  # every row causal
    else:
        bias = np.zeros((B, 1, Q, T), np.float32)
        cols = lengths[:, None, None] + np.arange(Q)[None, None, :]  # (B, 1, Q): the new slots
        rows = np.arange(B)[:, None, None], np.arange(Q)[None, :, None]
        bias[rows[0], 0, rows[1], cols] = np.where(new, 0.0, -np.inf)
    return {
        "attention_bias": bias,
        "seqlens_k": (lengths + Q - 1).astype(np.int32),
        "total_sequence_length": np.array(T, np.int32),
        "query_seqlens": np.full(B, Q, np.int32),
    }
