"""A stand-in for the TensorRT runtime API on the CPU, backed by our PyTorch model.

It lets the CPU suite test TrtBackend's glue: the profile chosen per step, the input shapes, the
tensor addresses (the KV cache bound in place), output allocation and dtypes. Every input is read
from the raw address the backend bound, with the shape it set, and every output is written to
the address it bound, so a wrong address, shape, dtype or profile gives wrong tokens or an error.
Shapes outside the active profile are refused, as TensorRT does (set_input_shape -> False), and
so are KV-cache addresses that are not 256-byte aligned (set_tensor_address -> False): TensorRT
requires every bound address to be; the runtime controls the KV slices' (offsets into one cache
buffer), while every other tensor is an allocation of its own, which CUDA aligns (on the CPU
torch aligns only to 64 bytes, so those are not checked here).
It is not TensorRT: real engines run only on a GPU (the tests marked gpu).
"""

from __future__ import annotations

import ctypes
import types

import numpy as np
import torch

from specrt.engines.profiles import ProfileSpec, Range
from specrt.schema.step_io import HIDDEN, LOGITS, STEP_INPUTS, StepIO


class _DataType:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"DataType.{self.name}"


FLOAT, INT64, BOOL = _DataType("FLOAT"), _DataType("INT64"), _DataType("BOOL")
_NUMPY = {"FLOAT": np.float32, "INT64": np.int64, "BOOL": np.bool_}


def _view(ptr: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype).reshape(shape)


class FakeEngine:
    def __init__(self, model, profiles: list[dict], drop: tuple[str, ...] = ()):
        self.model, cfg = model.eval(), model.cfg
        self.L, self.Hkv, self.D, self.V = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size
        self.profiles = [
            ProfileSpec(p["name"], *(Range(**p[k]) for k in ("batch", "q_len", "past_len"))) for p in profiles
        ]
        self.io = StepIO(self.L)
        self.inputs, self.outputs = self.io.input_names, self.io.output_names
        self.names = [n for n in self.inputs + self.outputs if n not in drop]
        self.executed_profiles: list[int] = []  # which profile ran each step

    num_io_tensors = property(lambda self: len(self.names))
    num_optimization_profiles = property(lambda self: len(self.profiles))

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_dtype(self, name):
        return {"int64": INT64, "bool": BOOL, "float32": FLOAT}[self.io.dtype(name)]

    def create_execution_context(self, runtime_config=None):
        return FakeContext(self)


class FakeContext:
    def __init__(self, engine: FakeEngine):
        self.engine, self.profile = engine, 0
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}

    def set_optimization_profile_async(self, index, stream):
        self.profile = index
        return True

    def set_input_shape(self, name, shape):
        e = self.engine
        ranges = e.profiles[self.profile].shapes(e.L, e.Hkv, e.D)[name]
        if not all(lo <= d <= hi for lo, d, hi in zip(ranges[0], shape, ranges[2])):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, ptr):
        if name in self.engine.io.past_names and ptr % 256:
            return False
        self.addresses[name] = ptr
        return True

    def get_tensor_shape(self, name):
        ids, _, _, index = STEP_INPUTS
        B, Q = self.shapes[ids]
        K = self.shapes[index][1]
        if name == LOGITS:
            return (B, K, self.engine.V)
        if name == HIDDEN:
            return (B, Q, self.engine.model.cfg.hidden_size * len(self.engine.model.hidden_layers))
        return (B, self.engine.Hkv, Q, self.engine.D)

    def _read(self, name):
        dtype = _NUMPY[self.engine.get_tensor_dtype(name).name]
        return torch.from_numpy(_view(self.addresses[name], self.shapes[name], dtype).copy())

    def execute_async_v3(self, stream_handle):
        e = self.engine
        ids, pos, mask, index = (self._read(n) for n in STEP_INPUTS)
        past = [tuple(self._read(n) for n in e.io.past(i)) for i in range(e.L)]
        with torch.inference_mode():
            logits, hidden, present = e.model(ids, pos, mask, past, index)
        outs = {LOGITS: logits, HIDDEN: hidden}
        for i, (k, v) in enumerate(present):
            outs.update(zip(e.io.present(i), (k, v)))
        for name, t in outs.items():
            _view(self.addresses[name], tuple(self.get_tensor_shape(name)), np.float32)[...] = t.numpy()
        e.executed_profiles.append(self.profile)
        return True


def fake_tensorrt(model, profiles: list[dict], drop: tuple[str, ...] = (), loadable: bool = True):
    """A module-like object with the parts of the TensorRT API that TrtBackend uses."""
    engine = FakeEngine(model, profiles, drop)

    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, blob):
            return engine if loadable and len(blob) > 0 else None

    return types.SimpleNamespace(Logger=Logger, Runtime=Runtime, engine=engine)
