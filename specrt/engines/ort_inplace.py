"""Running the fused step graph on ONNX Runtime with the KV cache bound in place.

    runner = InPlaceRunner(session, num_layers)
    logits, hidden = runner.run(feeds, keys, values, want_hidden=True)

The fused graph's attention op writes each step's new keys and values into its cache buffer
when its past and present are the same tensor; through `session.run` they never are (ORT would
allocate a present and copy the whole past into it). So every layer's buffer is wrapped as an
OrtValue over the host array (no copy) and bound as both input and output, and only the logits
(and the hidden states when asked) are fetched.

Wrapping and binding 2 x layers buffers costs ~0.5 ms (30 layers), a tenth of a 4-bit decode
step, so both are kept: a binding keeps its cache bound while steps run on the same buffers, and
the OrtValues of the last two caches (with their row views) are remembered. Holding them keeps
those two caches' memory alive, no more.

Used by the runtime's ORT backend and by the engine build's batch-invariance measurement.
"""

from __future__ import annotations

import numpy as np

from specrt.schema.step_io import HIDDEN, LOGITS, StepIO

KEEP_CACHES = 2  # caches whose buffers stay wrapped (the running one and the one before)


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class InPlaceRunner:
    """One fused-graph session, its bindings and the OrtValues of the cache buffers it saw."""

    def __init__(self, session, num_layers: int):
        self.session = session
        self.io = StepIO(num_layers, "fused")
        self._wrapped: dict[int, tuple[np.ndarray, dict]] = {}  # id(root) -> (root, {view key: OrtValues})
        self._bindings: dict[bool, tuple] = {}  # want_hidden -> (IOBinding, the view keys bound)

    def _values(self, buffer: np.ndarray) -> tuple[tuple, list]:
        """(its key, per layer an OrtValue over buffer[layer]) for a (L, B, Hkv, C, D) host array."""
        import onnxruntime as ort

        root = _root(buffer)
        key = (buffer.__array_interface__["data"][0], buffer.shape, buffer.strides)
        # held here, a root stays alive, so its id names it alone
        entry = self._wrapped.pop(id(root), None) or (root, {})
        self._wrapped[id(root)] = entry  # most recent last
        while len(self._wrapped) > KEEP_CACHES:
            self._wrapped.pop(next(iter(self._wrapped)))
        views = entry[1]
        if key not in views:
            layers = [buffer[i] for i in range(buffer.shape[0])]
            if not all(a.flags.c_contiguous for a in layers):
                raise ValueError("the fused graph binds each layer's cache buffer in place; it must be C-contiguous")
            views[key] = [ort.OrtValue.ortvalue_from_numpy(a) for a in layers]
        return key, views[key]

    def run(
        self, feeds: dict[str, np.ndarray], keys: np.ndarray, values: np.ndarray, want_hidden: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """One step: `feeds` are the fused graph's step inputs (step_io.FUSED_INPUTS), keys and
        values the cache buffers (L, B, Hkv, C, D), written in place. Returns (logits, hidden
        states or None)."""
        (kkey, kvals), (vkey, vvals) = self._values(keys), self._values(values)
        binding, bound = self._bindings.get(want_hidden, (None, None))
        if binding is None or bound != (kkey, vkey):
            binding = self.session.io_binding()
            for i, (k, v) in enumerate(zip(kvals, vvals)):
                past_k, past_v = self.io.past(i)
                present_k, present_v = self.io.present(i)
                binding.bind_ortvalue_input(past_k, k)
                binding.bind_ortvalue_input(past_v, v)
                binding.bind_ortvalue_output(present_k, k)
                binding.bind_ortvalue_output(present_v, v)
            self._bindings[want_hidden] = (binding, (kkey, vkey))
        for name, array in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        binding.bind_output(LOGITS)  # again each step: a bound output keeps its last shape
        if want_hidden:
            binding.bind_output(HIDDEN)
        self.session.run_with_iobinding(binding)
        out = binding.get_outputs()
        n = 2 * self.io.num_layers  # the presents were bound first
        return out[n].numpy(), out[n + 1].numpy() if want_hidden else None
