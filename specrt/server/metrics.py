"""The server's metrics in Prometheus's text format (prometheus_client), served on GET /metrics.

    specrt_requests_total{outcome}                 how each request ended: ok, invalid (400, 404,
                                                   413), cancelled (499: the client left), refused
                                                   (503: busy), timed_out (504), error (500)
    specrt_requests_started_total                  requests handed to the engine
    specrt_busy_seconds_total                      time the engine spent stepping
    specrt_queue_depth                             requests waiting for the engine
    specrt_batch_size                              rows in the engine's current step (0 when idle)
    specrt_prompt_tokens_total, specrt_completion_tokens_total
    specrt_time_to_first_token_seconds             histogram: request received -> first token out of
                                                   the engine (queueing and prefill included)
    specrt_inter_token_latency_seconds             histogram, one observation per output token after
                                                   the first: a step that emits k tokens after a gap t
                                                   counts k observations of t / k (the mean is the
                                                   mean time per output token, as clients see it)
    specrt_draft_tokens_total{method}              draft tokens verified, per draft method
    specrt_draft_accepted_tokens_total{method}     of them accepted
    specrt_speculative_steps_total{method}         verification steps
    specrt_prefix_cache_lookup_tokens_total        prompt tokens looked up in the prefix cache
    specrt_prefix_cache_hit_tokens_total           of them served from it (hit rate = hit / lookup)
    specrt_prefix_cache_evicted_blocks_total       blocks evicted to stay under --prefix-cache-mb
    specrt_prefix_cache_bytes                      the KV the cache holds now

Acceptance rate = accepted / draft tokens; mean accepted length (bonus included, as the runtime
reports it) = (accepted + steps) / steps; both per method, in PromQL over any window. Each
service has its own registry, so several in one process (the tests) do not collide.

GET /stats is the same counters as JSON (`counts`), read back from this registry: one source,
so the two views cannot disagree.
"""

from __future__ import annotations

from specrt.server.protocol import OUTCOMES

# seconds; TTFT spans prefill of up to a few thousand tokens on a CPU, ITL a step of 5-50 ms
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


class ServerMetrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("specrt_requests", "Requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:  # every series exists from the start, at 0
            self.requests.labels(outcome)
        self.started = Counter("specrt_requests_started", "Requests handed to the engine", registry=r)
        self.busy_seconds = Counter("specrt_busy_seconds", "Time the engine spent stepping", registry=r)
        self.queue_depth = Gauge("specrt_queue_depth", "Requests waiting for the engine", registry=r)
        self.batch_size = Gauge("specrt_batch_size", "Rows in the engine's current step", registry=r)
        self.prompt_tokens = Counter("specrt_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("specrt_completion_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "specrt_time_to_first_token_seconds",
            "Request received to first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "specrt_inter_token_latency_seconds",
            "Time per output token after the first",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.drafted = Counter("specrt_draft_tokens", "Draft tokens verified", ["method"], registry=r)
        self.accepted = Counter("specrt_draft_accepted_tokens", "Draft tokens accepted", ["method"], registry=r)
        self.spec_steps = Counter("specrt_speculative_steps", "Verification steps", ["method"], registry=r)

    def watch_prefix_cache(self, pool) -> None:
        """The prefix cache's counters (runtime/prefix_cache.py), read when /metrics is scraped."""
        self.registry.register(_PrefixCacheCollector(pool))

    def tokens_out(self, gap_seconds: float, count: int) -> None:
        """`count` tokens came out `gap_seconds` after the previous ones (see the module docstring)."""
        for _ in range(count):
            self.itl.observe(gap_seconds / count)

    def speculation(self, method: str, drafted: int, accepted: int, steps: int) -> None:
        self.drafted.labels(method).inc(drafted)
        self.accepted.labels(method).inc(accepted)
        self.spec_steps.labels(method).inc(steps)

    def counts(self) -> dict:
        """GET /stats: requests started, each outcome's count, the token counters and the busy
        time, read from the registry's samples."""
        values = {}
        for metric in self.registry.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    values[(sample.name, sample.labels.get("outcome"))] = sample.value
        out = {"requests": int(values[("specrt_requests_started_total", None)])}
        out |= {o: int(values[("specrt_requests_total", o)]) for o in OUTCOMES}
        for name in ("prompt_tokens", "completion_tokens"):
            out[name] = int(values[(f"specrt_{name}_total", None)])
        out["busy_seconds"] = round(values[("specrt_busy_seconds_total", None)], 3)
        return out

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the text exposition format."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _PrefixCacheCollector:
    """The pool counts for itself (the engine thread updates plain integers); a scrape reads them."""

    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p = self.pool
        yield CounterMetricFamily("specrt_prefix_cache_lookup_tokens", "Prompt tokens looked up", value=p.looked_up)
        yield CounterMetricFamily("specrt_prefix_cache_hit_tokens", "Prompt tokens served from the cache", value=p.hit)
        yield CounterMetricFamily("specrt_prefix_cache_evicted_blocks", "Blocks evicted", value=p.evicted)
        yield GaugeMetricFamily("specrt_prefix_cache_bytes", "KV bytes held", value=p.bytes)
