"""An ONNX Runtime session on a built engine as a step backend."""

from __future__ import annotations

import numpy as np

from specrt.export.config import ModelConfig
from specrt.export.step_io import HIDDEN, LOGITS, STEP_INPUTS, StepIO
from specrt.runtime.backends.base import Capabilities, StepBackend, StepOutput, gather_rows


class OrtBackend(StepBackend):
    def __init__(
        self,
        session,
        config: ModelConfig,
        provider: str,
        batch_invariance: dict | None = None,
        hidden_layers=(-1,),
        precision: str = "float32",
        checkpoint_hash: str | None = None,
    ):
        import onnxruntime

        self.session = session
        self.config = config
        self.description = f"onnxruntime {onnxruntime.__version__} {provider}"
        self.caps = Capabilities(
            batch_invariance=batch_invariance,
            hidden_layers=tuple(hidden_layers),
            precision=precision,
            checkpoint_hash=checkpoint_hash,
            vocab_size=config.vocab_size,
        )
        self._io = StepIO(config.num_hidden_layers)
        # fetching hidden_states only when asked saves its host copy on every other step
        self._fetch = [LOGITS, *self._io.present_names]
        self._fetch_hidden = [LOGITS, *self._io.present_names, HIDDEN]

    @classmethod
    def from_manifest(cls, session, manifest: dict, provider: str) -> "OrtBackend":
        """The backend of a loaded engine, its facts read from the engine's manifest."""
        return cls(
            session,
            ModelConfig.from_dict(manifest["config"]),
            provider,
            batch_invariance=manifest.get("batch_invariance"),  # measured at build (engines.ort.batch_invariance)
            hidden_layers=manifest["hidden_layers"],
            precision=manifest.get("precision", "float32"),
            checkpoint_hash=manifest["checkpoint"]["hash"],
        )

    def step(self, input_ids, position_ids, attention_mask, logits_index, cache, hidden_index=None, want_logits=True):
        # the logits are host arrays already: returned whether wanted or not
        feeds = dict(zip(STEP_INPUTS, (input_ids, position_ids, attention_mask, logits_index)))
        for i in range(cache.num_layers):
            feeds.update(zip(self._io.past(i), cache.past(i)))
        out = self.session.run(self._fetch if hidden_index is None else self._fetch_hidden, feeds)
        L = self.config.num_hidden_layers
        present = list(zip(out[1 : 2 * L + 1 : 2], out[2 : 2 * L + 1 : 2]))
        hidden = None if hidden_index is None else np.ascontiguousarray(gather_rows(out[-1], hidden_index))
        return StepOutput(out[0], hidden, present)
