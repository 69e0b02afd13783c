"""The backend contract: what a step returns, and what the runtime may rely on."""

from __future__ import annotations

import abc
import dataclasses

import numpy as np

from specrt.runtime.kv_cache import KVCache
from specrt.schema.config import ModelConfig
from specrt.schema.step_io import STEP_FLOOR

MAX_GRAPHS = 128  # captured step graphs kept per backend before they are dropped and captured again


@dataclasses.dataclass
class StepOutput:
    logits: np.ndarray | None  # (B, K, V) float32 at the positions logits_index asked for; None if not wanted
    hidden_states: np.ndarray | None  # (B, Kh, H*) float32 at the positions hidden_index asked for; None if not asked
    present: list[tuple[np.ndarray, np.ndarray]] | None  # per layer (key, value), each (B, Hkv, Q, D); None: in place
    top1: np.ndarray | None = None  # (B, K) int64 argmax of the logits, where the backend computed it

    def argmax(self) -> np.ndarray:
        """(B, K) the greedy token at every position logits were asked for."""
        return self.top1 if self.top1 is not None else self.logits.argmax(axis=-1)

    def at_row(self, b: int) -> "StepOutput":
        """A one-row output seen as row b of a batch (rows 0..b all read its one row; views, no
        copies): a row's prefill, computed on its own row of the cache, read by the code that
        reads a batched step."""

        def placed(a):
            return None if a is None else np.broadcast_to(a[:1], (b + 1, *a.shape[1:]))

        return StepOutput(placed(self.logits), placed(self.hidden_states), None, placed(self.top1))


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """Everything about a backend the runtime uses besides `step`; defaults are an unlimited host backend."""

    max_context: int | None = None  # longest context (prompt + output) it was built for; None: the model's
    max_step: int | None = None  # most new positions one step may have (prefill chunks are cut to it)
    max_verify: int | None = None  # most positions of a verification step (root + draft nodes)
    max_cache: int | None = None  # largest KV cache capacity it accepts
    max_batch: int | None = None  # most rows one step may have (an engine's profiles); None: any
    cache_device: str | None = None  # where KV caches live; None: host numpy arrays
    reuse_cache: bool = False  # it binds cache buffers (CUDA graphs): the session pools caches across generations
    cache_align: int = 1  # cache capacities are multiples of this (TensorRT: slices bound at aligned addresses)
    # a backend whose step writes the new positions into the cache itself (StepOutput.present
    # None), all Q of every row from its length on: caches get this many slots beyond their capacity
    cache_slack: int = 0
    batch_invariance: dict | None = None  # measured at build: how logits move between 1- and multi-position steps
    # the fewest positions per row its steps compute (schema/step_io.py STEP_FLOOR: a one-position
    # step is padded, so every step shape gives the same bits); 1: it takes one-position steps as
    # they are (SplitBackend exists to run them on an engine of their own)
    floor: int = STEP_FLOOR
    # the positions no step may span (schema/step_cuts.py), as the build probed them, continued
    # every cut_period positions past the probe's last (None: not continued)
    step_cuts: tuple[int, ...] = ()
    cut_period: int | None = None
    # and the multiple every step's positions per row are rounded up to, where a library's
    # products are bitwise row-invariant only in whole tiles of rows (the GPU check tries them)
    step_multiple: int = 1
    # measured at build: ms per step at batch 1 by the positions it computes ({1: .., 2: .., 17: ..})
    step_ms: dict[int, float] | None = None
    # what a draft head trained on this target must match (its features are these layers'
    # hidden states, at this precision, of this checkpoint); hash None: unknown (built in memory)
    hidden_layers: tuple[int, ...] = (-1,)  # the layers `hidden_states` carries, in order
    precision: str = "float32"  # "float32", or the quantization scheme of the engine
    checkpoint_hash: str | None = None
    vocab_size: int | None = None  # the ids its logits cover: a draft model must share them


class StepBackend(abc.ABC):
    """A target model that runs the step graph. Subclasses set `config`, `description` and `caps`.

    The runtime reads these fields of `config`: num_hidden_layers, num_key_value_heads and
    head_dim (the KV cache's shape), vocab_size (the logits' width, prompt checks),
    max_position_embeddings (the context, with caps.max_context) and eos_token_id (where a
    generation stops)."""

    config: ModelConfig
    description: str  # what runs, e.g. "onnxruntime 1.32.0 CPUExecutionProvider"
    caps: Capabilities

    @abc.abstractmethod
    def step(
        self,
        input_ids: np.ndarray,
        position_ids: np.ndarray,
        attention_mask: np.ndarray,
        logits_index: np.ndarray,
        cache: KVCache,
        hidden_index: np.ndarray | None = None,
        want_logits: bool = True,
    ) -> StepOutput:
        """One step over Q new positions per row; hidden states only at `hidden_index` (B, Kh).
        want_logits=False: only the argmax is needed (greedy), so a device backend computes it
        there and copies (B, K) tokens to the host instead of (B, K, V) logits (`top1`)."""


def gather_rows(x, index: np.ndarray):
    """x (B, Q, ...) at per-row positions index (B, K) -> (B, K, ...); numpy or torch."""
    rows = np.arange(index.shape[0])[:, None]
    if isinstance(x, np.ndarray):
        return x[rows, index]
    from specrt.runtime.transfer import to_device

    # staged through pinned memory: a plain copy from pageable memory would make the host wait
    # (one more host sync in every step that reads features; the GPU check's sync audit counts them)
    rows = np.broadcast_to(rows, index.shape).copy()  # a writable array (torch warns on a read-only view)
    return x[to_device(rows, x.device), to_device(index, x.device)]


def graphable(cuda_graphs: bool, q_len: int, logits_positions: int, max_graph_q: int) -> bool:
    """Whether a step of this shape runs through a CUDA graph: decode (Q = 1) and verification
    steps (logits at every one of their Q <= max_graph_q positions), not prefill chunks (logits at
    the last position only): those are one-off shapes, run eagerly rather than captured."""
    return cuda_graphs and q_len <= max_graph_q and (q_len == 1 or logits_positions == q_len)


def cache_key(cache) -> tuple:
    """What a CUDA graph captured on `cache` bakes in: both buffers' addresses, shapes and
    strides (so every layer's and row's slice address follows; a row view of a larger cache has
    other strides than a whole cache at the same address) and the capacity."""
    k, v = cache.keys, cache.values
    return (k.data_ptr(), v.data_ptr(), tuple(k.shape), tuple(k.stride()), tuple(v.stride()), cache.capacity)


def device_logits(logits, want_logits: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(logits, top1) on the host from a torch tensor of logits: the logits when wanted, else only
    their argmax, computed where the logits are."""
    if want_logits:
        return logits.float().cpu().numpy(), None
    return None, logits.argmax(dim=-1).cpu().numpy()
