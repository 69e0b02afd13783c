"""Every product in blocks of a fixed row count: PyTorch's CPU reference, bitwise by construction.

A CPU BLAS picks its kernel, and with it the order of a dot product's additions, by the shape of
the whole product: how many rows it has among them. Measured with torch 2.13 (MKL 2024.2): on an
AMD EPYC, M = 1, M = 2-3 and M >= 4 give a row three different results; on an Intel Xeon with
AVX-512 the boundary moves with the shape (M < 3 for K = 64, M < 16 for K = 576, M < 57 for
K = 1536 on two threads). No rule about the step's positions holds on every machine. So the
reference runs each matrix product as products of exactly `rows` rows of its left operand,
the last block padded with zeros: every row of every step then goes through the same kernel of
the same shape, whatever the step computes beside it, on any CPU. A row's result does not depend
on where it sits in a block (tests/test_exact.py checks it on the machine that runs it).

No library offers this (batch-invariant kernels exist for GPUs, not for PyTorch's CPU
products), and a TorchFunctionMode keeps it out of the model: the same module is traced to
ONNX, where each engine has its own kernels and its own rule.
"""

from __future__ import annotations

import functools

# rows per product. The price, SmolLM2-135M on a 2-core Xeon (against no blocks, interleaved,
# medians of 3): blocks of 2 / 4 / 8 / 16 rows: a decode step 1.3 / 1.7 / 1.9 / 2.0x, a 17-position
# verification 2.0 / 2.1 / 1.8 / 1.8x, a 150-token prefill 3.2 / 3.3 / 2.4 / 2.0x
ROWS = 8


def _blocks(a, rows: int, fn):
    """fn over blocks of `rows` rows of a (along dim -2), the last padded; the rows put back."""
    import torch

    m = a.shape[-2]
    if m == 0:
        return fn(a)
    pad = -m % rows
    if pad:
        a = torch.cat([a, a.new_zeros(*a.shape[:-2], pad, a.shape[-1])], dim=-2)
    out = torch.cat([fn(part) for part in a.split(rows, dim=-2)], dim=-2)
    return out[..., :m, :].contiguous()


def row_block_mode(rows: int = ROWS):
    """A context manager under which F.linear and matmul compute in blocks of `rows` rows."""
    return _mode_class()(rows)


@functools.cache
def _mode_class():
    """The TorchFunctionMode, defined once (torch is imported lazily, so not at module level)."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    matmuls = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}

    class RowBlocks(TorchFunctionMode):
        def __init__(self, rows: int):
            super().__init__()
            self.rows = rows

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.linear:
                x, weight, *rest = args
                bias = rest[0] if rest else kwargs.get("bias")
                return self._flat(x, lambda part: F.linear(part, weight, bias))
            if func in matmuls and not kwargs and args[0].dim() >= 2 and args[1].dim() >= 2:
                a, b = args
                if b.dim() == 2:  # one product whose rows are all of a's (as PyTorch folds it)
                    return self._flat(a, lambda part: torch.matmul(part, b))
                return _blocks(a, self.rows, lambda part: torch.matmul(part, b))  # one product per batch
            return func(*args, **kwargs)

        def _flat(self, x, fn):
            out = _blocks(x.reshape(-1, x.shape[-1]), self.rows, fn)
            return out.reshape(*x.shape[:-1], out.shape[-1])

    return RowBlocks
