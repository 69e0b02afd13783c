"""The server's limits and defaults, in a module of their own so the CLI can show them in its
help without importing the runtime."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 1024  # per request; also the default when a request names none
    max_stop: int = 4
    max_queue: int = 8  # requests that may wait for a slot; more get a 503
    max_batch: int = 8  # requests generating together (continuous batching); 1: one at a time
    prefill_budget: int = 64  # prompt tokens per step while other requests decode
    request_timeout: float = 600.0  # seconds from arrival; a request still running then gets a 504
