"""An ONNX Runtime session on a built engine as a step backend.

Two graph flavours (step_io): the portable graph takes the cache's past as inputs and returns
the new positions (appended by the session); the fused graph writes them into the cache buffers
itself (engines/ort_inplace.py binds them in place), so its caches carry room for a whole
verification step beyond their capacity (`STEP_ROOM`).
"""

from __future__ import annotations

import numpy as np

from specrt.engines.ort_measure import floor_of
from specrt.runtime.backends.base import Capabilities, StepBackend, StepOutput, gather_rows
from specrt.schema.config import ModelConfig
from specrt.schema.step_io import HIDDEN, LOGITS, STEP_INPUTS, STEP_ROOM, StepIO, fused_inputs

# most positions a verification step of the fused graph has: its attention op writes all Q of
# every row (padding included) from the row's length on, so a cache holds this many slots past
# its capacity (for a row near its end beside a row verifying a long draft)


class OrtBackend(StepBackend):
    def __init__(
        self,
        session,
        config: ModelConfig,
        provider: str,
        batch_invariance: dict | None = None,
        step_ms: dict | None = None,
        hidden_layers=(-1,),
        precision: str = "float32",
        checkpoint_hash: str | None = None,
        flavour: str = "portable",
        step_cuts: dict | None = None,
    ):
        import onnxruntime

        self.session = session
        self.config = config
        self.flavour = flavour
        fused = flavour == "fused"
        self.description = f"onnxruntime {onnxruntime.__version__} {provider}" + (", fused graph" if fused else "")
        self.caps = Capabilities(
            max_verify=STEP_ROOM if fused else None,
            batch_invariance=batch_invariance,
            step_ms={int(q): float(ms) for q, ms in step_ms.items()} if step_ms else None,
            hidden_layers=tuple(hidden_layers),
            precision=precision,
            checkpoint_hash=checkpoint_hash,
            vocab_size=config.vocab_size,
            cache_slack=STEP_ROOM if fused else 0,
            floor=floor_of(batch_invariance),
            step_cuts=tuple((step_cuts or {}).get("cuts", ())),
            cut_period=(step_cuts or {}).get("period"),
        )
        self._io = StepIO(config.num_hidden_layers)
        # fetching hidden_states only when asked saves its host copy on every other step
        self._fetch = [LOGITS, *self._io.present_names]
        self._fetch_hidden = [LOGITS, *self._io.present_names, HIDDEN]
        if fused:
            from specrt.engines.ort_inplace import InPlaceRunner

            self._runner = InPlaceRunner(session, config.num_hidden_layers)

    @classmethod
    def from_manifest(cls, session, manifest: dict, provider: str) -> "OrtBackend":
        """The backend of a loaded engine, its facts read from the engine's manifest."""
        return cls(
            session,
            ModelConfig.from_dict(manifest["config"]),
            provider,
            batch_invariance=manifest.get("batch_invariance"),  # measured at build (engines/ort_measure.py)
            step_ms=manifest.get("step_ms"),  # engines built before it was measured have none
            hidden_layers=manifest["hidden_layers"],
            precision=manifest.get("precision", "float32"),
            checkpoint_hash=manifest["checkpoint"]["hash"],
            flavour=manifest.get("graph_flavour", "portable"),
            step_cuts=manifest.get("step_cuts"),  # probed at build (engines/ort_measure.py)
        )

    def step(self, input_ids, position_ids, attention_mask, logits_index, cache, hidden_index=None, want_logits=True):
        # the logits are host arrays already: returned whether wanted or not
        if self.flavour == "fused":
            return self._fused_step(input_ids, position_ids, attention_mask, logits_index, cache, hidden_index)
        feeds = dict(zip(STEP_INPUTS, (input_ids, position_ids, attention_mask, logits_index)))
        for i in range(cache.num_layers):
            feeds.update(zip(self._io.past(i), cache.past(i)))
        out = self.session.run(self._fetch if hidden_index is None else self._fetch_hidden, feeds)
        L = self.config.num_hidden_layers
        present = list(zip(out[1 : 2 * L + 1 : 2], out[2 : 2 * L + 1 : 2]))
        hidden = None if hidden_index is None else np.ascontiguousarray(gather_rows(out[-1], hidden_index))
        return StepOutput(out[0], hidden, present)

    def _fused_step(self, input_ids, position_ids, attention_mask, logits_index, cache, hidden_index):
        """The new positions go into the cache's buffers at each row's length (not committed:
        the session commits each row's count); StepOutput.present is None."""
        Q = input_ids.shape[1]
        if int(cache.lengths.max()) + Q > cache.keys.shape[3]:
            raise ValueError(
                f"a step of {Q} positions does not fit the cache's buffers ({cache.keys.shape[3]} slots) after "
                f"{int(cache.lengths.max())} committed positions; give the cache room for it (Capabilities.cache_slack)"
            )
        feeds = {"input_ids": input_ids, "position_ids": position_ids, "logits_index": logits_index}
        feeds |= fused_inputs(cache.lengths, attention_mask)
        logits, hidden = self._runner.run(feeds, cache.keys, cache.values, want_hidden=hidden_index is not None)
        if hidden is not None:
            hidden = np.ascontiguousarray(gather_rows(hidden, hidden_index))
        return StepOutput(logits, hidden, None)
