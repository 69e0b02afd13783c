"""The KV cache: preallocated once per generation, appended to in place, rolled back by length.

Layout: keys and values are each [L, B, Hkv, C, D] float32 (C = capacity). Layer i's slice
`keys[i]` is contiguous [B, Hkv, C, D], so it is fed to the step graph as `past_key_values.i.key`
without a copy: the graph always sees the full capacity and the attention mask hides the slots
past each row's length. A step writes only its new positions (`append`); rejecting draft tokens
is `rollback` (a length change, nothing is moved).

The buffers are numpy arrays for the CPU engines, or torch tensors on a device (`device="cuda"`)
for the PyTorch-CUDA backend, so the cache never leaves the GPU there; indexing is the same.
"""

from __future__ import annotations

import numpy as np

from specrt.runtime.transfer import to_device
from specrt.schema.step_io import attention_mask


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype=np.float32,
        device: str | None = None,
        slack: int = 0,
    ):
        """slack: slots the buffers hold beyond `capacity`, which rows never commit into (a
        backend that writes each row's whole padded step in place needs them: Capabilities)."""
        shape = (num_layers, batch, kv_heads, capacity + slack, head_dim)
        if device is None:
            self.keys = np.zeros(shape, dtype=dtype)
            self.values = np.zeros(shape, dtype=dtype)
        else:
            self.keys = aligned_zeros(shape, device)
            self.values = aligned_zeros(shape, device)
        self.device = device
        self.lengths = np.zeros(batch, dtype=np.int64)  # committed positions per row
        self.capacity = capacity
        self.in_use = False  # pooled caches: held by a running generation (StepSession.new_cache)

    def reset(self) -> None:
        """Empty every row (a pooled cache starting a new generation); buffers are kept, not cleared:
        the attention mask hides every slot past a row's length."""
        self.lengths[:] = 0

    def rows(self, start: int, stop: int) -> "KVCache":
        """Rows start..stop-1 as a cache of their own, sharing the buffers and the lengths (no
        copy). Each layer's slice of a row range is still contiguous ([rows, Hkv, C, D] inside
        [B, Hkv, C, D]), so a step can run on part of a batch: continuous batching prefills one
        newcomer on its own row while the others wait, and steps only as many rows as are in use."""
        view = object.__new__(KVCache)
        view.keys, view.values = self.keys[:, start:stop], self.values[:, start:stop]
        view.lengths = self.lengths[start:stop]
        view.device, view.capacity, view.in_use = self.device, self.capacity, self.in_use
        return view

    @property
    def batch(self) -> int:
        return self.keys.shape[1]

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    def past(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Full-capacity views (B, Hkv, C, D) of one layer (C + slack where there is slack); no copy."""
        return self.keys[layer], self.values[layer]

    def commit(self, counts: np.ndarray) -> None:
        """The step wrote its new positions into the buffers itself (in place): commit the first
        counts[b] of each row."""
        end = self.lengths + np.asarray(counts, dtype=np.int64)
        if (end > self.capacity).any():
            raise ValueError(f"KV cache overflow: rows need {end.max()} positions, capacity is {self.capacity}")
        self.lengths[:] = end

    def append(self, present: list[tuple[np.ndarray, np.ndarray]], counts: np.ndarray) -> None:
        """Write the first counts[b] new positions of each row after its committed length and commit them.

        present: per layer (key, value), each (B, Hkv, Q, D) as the step graph returns them.
        """
        counts = np.asarray(counts, dtype=np.int64)
        end = self.lengths + counts
        if (end > self.capacity).any():
            raise ValueError(f"KV cache overflow: rows need {end.max()} positions, capacity is {self.capacity}")
        if self.device is None and (self.batch <= 2 or counts.max() > 1):
            # host arrays: slice copies are the fastest unless many rows append one position each
            # (measured, 30 layers: 16 rows x 17 positions 1.5 ms as slices, 8.4 ms as one scatter;
            # a 512-token chunk 1.2 ms and 12.7 ms)
            for layer, (k, v) in enumerate(present):
                for b in np.flatnonzero(counts):
                    n, start = int(counts[b]), int(self.lengths[b])
                    self.keys[layer, b, :, start : start + n] = k[b, :, :n]
                    self.values[layer, b, :, start : start + n] = v[b, :, :n]
        elif counts.any():
            # one scatter for all layers and rows (keys, then values), not 2 x layers x rows slice
            # copies: on a GPU each copy is a kernel launch, more than a decode step's own work;
            # on the host it pays for decode steps of a few rows (4 rows: 0.17 -> 0.05 ms)
            rows = np.repeat(np.arange(self.batch), counts)
            src = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)  # 0..n-1 per row
            dst = np.repeat(self.lengths, counts) + src
            if self.device is None:
                stack = np.stack
            else:
                import torch

                stack = torch.stack
                # one asynchronous copy of the three index arrays (pinned staging): a blocking copy
                # each would make the host wait for the GPU three times a step
                rows, src, dst = to_device(np.concatenate([rows, src, dst]), self.device).split(len(rows))
            for buffer, new in (
                (self.keys, stack([k for k, _ in present])),
                (self.values, stack([v for _, v in present])),
            ):
                buffer[:, rows, :, dst] = new[:, rows, :, src]  # [L, B, Hkv, Q, D] -> [L, B, Hkv, C, D]
        self.lengths[:] = end  # in place: views (`rows`) share the lengths

    def rollback(self, lengths: np.ndarray) -> None:
        """Forget everything past `lengths` (per row); slots are overwritten by later appends."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if (lengths > self.lengths).any() or (lengths < 0).any():
            raise ValueError(f"rollback to {lengths.tolist()} from {self.lengths.tolist()}: can only shorten")
        self.lengths[:] = lengths

    def keep(self, row: int, start: int, slots: list[int]) -> None:
        """Keep, of the positions from `start` on in `row`, only the given slots, moved to start,
        start+1, ... in order, and set the row's length after them (tree acceptance: the accepted
        path is compacted behind the committed prefix). Slots must be increasing."""
        for j, src in enumerate(slots):
            dst = start + j
            if src != dst:
                self.keys[:, row, :, dst] = self.keys[:, row, :, src]
                self.values[:, row, :, dst] = self.values[:, row, :, src]
        new_len = start + len(slots)
        if new_len > self.lengths[row]:
            raise ValueError(f"keep: row {row} has {self.lengths[row]} positions, asked to keep up to {new_len}")
        self.lengths[row] = new_len

    def keep_path(self, row: int, root: int, accepted: list[int]) -> None:
        """After a verification step whose root went to slot `root` and whose draft nodes followed
        it (node i at slot root + 1 + i): keep the root and the accepted nodes, in path order,
        and forget the rest of the step (for a chain that is a length change; for a tree the
        path is compacted behind the root)."""
        self.keep(row, root + 1, [root + 1 + i for i in accepted])

    def attention_mask(self, q_len: int, new_mask: np.ndarray | None = None) -> np.ndarray:
        """(B, Q, C + Q) bool mask for a step of Q new positions (step_io.attention_mask); C is
        the buffers' width (the capacity and any slack), as `past` gives them."""
        return attention_mask(self.lengths, self.keys.shape[3], q_len, new_mask)


def aligned_zeros(shape: tuple[int, ...], device: str):
    """A float32 torch tensor of zeros whose data starts at a 256-byte boundary (TensorRT binds the
    cache's slices in place and requires aligned addresses; CUDA allocations are aligned already,
    the CPU allocator only to 64 bytes, which the CPU stand-in of TensorRT would refuse)."""
    import torch

    n = int(np.prod(shape))
    buf = torch.zeros(n + 64, dtype=torch.float32, device=device)
    skip = (-buf.data_ptr() % 256) // 4
    return buf[skip : skip + n].view(shape)
