"""The server's limits and defaults, in a module of their own so the CLI can show them in its
help without importing the runtime."""

import dataclasses
import math

from specrt.errors import SpecrtError

SPEC_DECODE_METRICS = ("none", "summary", "detailed")


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 1024  # per request; also the default when a request names none
    max_stop: int = 4
    max_queue: int = 8  # requests that may wait for a slot; more get a 503
    max_batch: int = 8  # requests generating together (continuous batching); 1: one at a time
    prefill_budget: int = 64  # prompt tokens per step while other requests decode
    request_timeout: float = 600.0  # seconds from arrival; a request still running then gets a 504
    prefix_cache_mb: int = 256  # KV of earlier prompts' blocks kept for reuse (runtime/prefix_cache.py); 0: off
    # each answer's acceptance in its response, as vLLM's --per-request-spec-decode-metrics: none, summary, detailed
    spec_decode_metrics: str = "none"

    def __post_init__(self):
        if self.spec_decode_metrics not in SPEC_DECODE_METRICS:
            raise SpecrtError(
                f"spec_decode_metrics must be one of {', '.join(SPEC_DECODE_METRICS)}, got {self.spec_decode_metrics!r}"
            )
        for f in dataclasses.fields(self):
            if f.type is str:
                continue
            v, least = getattr(self, f.name), 0 if f.name in ("max_queue", "prefix_cache_mb") else 1
            if f.type is float:  # NaN passes every range check; infinity would mean never
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                    raise SpecrtError(f"server limit {f.name} must be a finite number of seconds > 0, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise SpecrtError(f"server limit {f.name} must be an integer >= {least}, got {v!r}")
