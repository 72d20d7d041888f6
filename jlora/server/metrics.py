"""The server's Prometheus metrics (`GET /metrics`), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jlora.scheduler import Request

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """Requests by adapter and outcome, tokens, running and waiting requests, step time, time to first
    token, adapter loads and evictions."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("jlora_requests", "Finished requests", ["adapter", "outcome"], registry=r)
        self.prompt_tokens = Counter("jlora_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("jlora_generation_tokens", "Generated tokens", ["adapter"], registry=r)
        self.running = Gauge("jlora_requests_running", "Requests holding a cache row", registry=r)
        self.waiting = Gauge("jlora_requests_waiting", "Requests waiting for a row", registry=r)
        self.step_seconds = Histogram("jlora_step_seconds", "Host time of one engine step (prefill or decode)",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("jlora_time_to_first_token_seconds", "From intake to the first token",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.adapter_loads = Counter("jlora_adapter_loads", "Adapters loaded", registry=r)
        self.adapter_evictions = Counter("jlora_adapter_evictions", "Adapters evicted to make room", registry=r)

    def finished(self, request: Request, adapter: str | None, arrival: float) -> None:
        """Counts a request that ended (called once, on the engine thread)."""
        label = adapter or "base"
        self.requests.labels(label, request.finish).inc()
        self.generation_tokens.labels(label).inc(len(request.out))
        if request.first_token_time is not None:
            self.ttft_seconds.observe(request.first_token_time - arrival)
