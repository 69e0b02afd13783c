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


def _staged(array: np.ndarray, dtype, device) -> tuple:
    """(the array as a host tensor of `dtype`, pinned when `device` is a CUDA device; whether it is).
    The dtype is converted on the host: a conversion inside the copy would stage through pageable
    memory again."""
    import torch

    host = torch.from_numpy(np.ascontiguousarray(array))
    if dtype is not None:
        host = host.to(dtype)
    cuda = torch.device(device).type == "cuda"
    return (host.pin_memory() if cuda else host), cuda


def to_device(array: np.ndarray, device, dtype=None):
    """`array` as a torch tensor on `device` (of `dtype` where given); from a CUDA device's view
    the copy is asynchronous (pinned staging); on the host it shares the array where it can."""
    host, cuda = _staged(array, dtype, device)
    return host.to(device, non_blocking=cuda)


def copy_into(dst, array: np.ndarray) -> None:
    """Write a host array into an existing device tensor (a CUDA graph's static input), asynchronously
    on a CUDA device, as `to_device` does."""
    host, cuda = _staged(array, dst.dtype, dst.device)
    dst.copy_(host, non_blocking=cuda)
