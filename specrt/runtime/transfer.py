"""Host arrays to a torch device without making the host wait.

A plain `tensor.to("cuda")` from pageable host memory is a blocking copy: the host stops until
the GPU has taken the data, so every step's small index and input copies would cost a host sync
each (the KV append made three per step, the TensorRT input path four). Copies from pinned
(page-locked) memory can be asynchronous: the host stages each array in a pinned block from
PyTorch's caching host allocator and enqueues a non-blocking copy on the current stream. The
allocator records that stream's use of the block and hands it out again only after the copy has
run, so the host may drop its staging tensor at once.
"""

from __future__ import annotations

import numpy as np


def to_device(array: np.ndarray, device, dtype=None):
    """`array` as a torch tensor on `device` (of `dtype` where given); from a CUDA device's view
    the copy is asynchronous (pinned staging); on the host it shares the array where it can."""
    import torch

    host = torch.from_numpy(np.ascontiguousarray(array))
    if dtype is not None:
        host = host.to(dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_into(dst, array: np.ndarray) -> None:
    """Write a host array into an existing device tensor (a CUDA graph's static input), asynchronously
    on a CUDA device, as `to_device` does."""
    import torch

    host = torch.from_numpy(np.ascontiguousarray(array)).to(dst.dtype)  # converted here: pinned stays pinned
    if dst.device.type != "cuda":
        dst.copy_(host)
        return
    dst.copy_(host.pin_memory(), non_blocking=True)
