"""The server's Prometheus metrics (`GET /metrics`), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jlora.admission import AdapterStats
from jlora.scheduler import Request

__all__ = ["Metrics"]

# seconds; 1.3-1.7x apart from 5 ms to 1 s, where steps, inter-token times and adapter loads fall, so a quantile
# read from them (Prometheus' histogram_quantile, bench/tenancy.py) is off by at most the width of its bucket
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.35, 0.5,
                    0.75, 1, 1.5, 2.5, 5, 10, 30, 60)


class Metrics:
    """Requests by adapter and outcome, tokens, running and waiting requests, KV-cache blocks, step time and the
    interval between steps, time to first token; adapters registered, in slots, in the device cache and on the host,
    per-tier hits and misses, load latencies and waits, failed loads, runtime registrations and evictions."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("jlora_requests", "Finished requests", ["adapter", "outcome"], registry=r)
        self.prompt_tokens = Counter("jlora_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("jlora_generation_tokens", "Tokens the engine generated (a response "
                                         "leaves out those from a stop string on)", ["adapter"], registry=r)
        self.running = Gauge("jlora_requests_running", "Requests holding a cache row", registry=r)
        self.waiting = Gauge("jlora_requests_waiting", "Requests waiting for a row", registry=r)
        self.kv_blocks = Gauge("jlora_kv_cache_blocks", "Blocks of the KV cache", registry=r)
        self.kv_blocks_used = Gauge("jlora_kv_cache_blocks_used", "KV-cache blocks held by requests", registry=r)
        self.kv_blocks_cached = Gauge("jlora_kv_cache_blocks_cached", "KV-cache blocks holding a reusable prompt "
                                      "prefix", registry=r)
        self.prefix_hit_rate = Gauge("jlora_prefix_cache_hit_rate", "Share of the prompt tokens looked up in the "
                                     "prefix cache that were found there", registry=r)
        self.preemptions = Counter("jlora_preemptions", "Requests preempted when the KV cache's blocks ran out "
                                   "(resumed later with the same tokens)", registry=r)
        self.step_seconds = Histogram("jlora_step_seconds", "Host time of one engine step (prefill or decode)",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.step_interval_seconds = Histogram(
            "jlora_step_interval_seconds", "From one engine step's start to the next's while requests run: what "
            "each row a step decodes waits for its token (the inter-token latency, server side)",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("jlora_time_to_first_token_seconds", "From intake to the first token",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.adapter_loads = Counter("jlora_adapter_loads", "Adapters registered at runtime (load_lora_adapter)",
                                     registry=r)
        self.adapter_load_failures = Counter(
            "jlora_adapter_load_failures", "Adapter loads that failed (reading the files, the copy to the device or "
            "the slot write): the requests that waited end, and later ones fail at once for --adapter-retry-after "
            "seconds", registry=r)
        self.adapter_evictions = Counter("jlora_adapter_evictions", "Adapters evicted from device slots",
                                         registry=r)
        self.tier_hits = Counter("jlora_adapter_tier_hits", "Requests whose adapter was in the tier", ["tier"],
                                 registry=r)
        self.tier_misses = Counter("jlora_adapter_tier_misses", "Requests whose adapter was not in the tier",
                                   ["tier"], registry=r)
        self.load_seconds = Histogram("jlora_adapter_load_seconds", "Adapter loads: queued (waiting for a loader "
                                      "thread), disk_to_host (read, check, convert, in a reader process), "
                                      "host_to_device (the copy, on a loader thread), slot_wait (the copy waiting "
                                      "for a free slot) and slot_write (the engine loop's host time, between two "
                                      "steps)",
                                      ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.resident = Gauge("jlora_adapters_resident", "Adapters in device slots", registry=r)
        self.host_adapters = Gauge("jlora_adapters_host", "Adapters in the host tier", registry=r)
        self.host_bytes = Gauge("jlora_adapters_host_bytes", "Bytes of the host tier's adapters", registry=r)
        self.device_cache_adapters = Gauge("jlora_adapters_device_cache", "Adapters in the device cache (kept on the "
                                           "device beside the slots)", registry=r)
        self.device_cache_bytes = Gauge("jlora_adapters_device_cache_bytes", "Bytes of the device cache's adapters "
                                        "(all devices together)", registry=r)
        self.registered = Gauge("jlora_adapters_registered", "Adapters a request may name now (those GET "
                                "/v1/models lists)", registry=r)
        self.slot_bytes = Gauge("jlora_adapter_slots_bytes", "Device memory the adapter slots hold (all devices "
                                "together): the modules some adapter targets, grown when one first targets another",
                                registry=r)
        self._counted = AdapterStats()  # what the counters hold so far
        self._evictions = 0

    def adapters(self, stats: AdapterStats, engine) -> None:
        """Brings the adapter metrics up to `stats` (an `Admission`'s) and `engine`'s slots (on the engine's
        thread)."""
        seen = self._counted
        for tier in ("device", "device_cache", "host"):
            hits, misses = getattr(stats, f"{tier}_hits"), getattr(stats, f"{tier}_misses")
            self.tier_hits.labels(tier).inc(hits - getattr(seen, f"{tier}_hits"))
            self.tier_misses.labels(tier).inc(misses - getattr(seen, f"{tier}_misses"))
            setattr(seen, f"{tier}_hits", hits)
            setattr(seen, f"{tier}_misses", misses)
        while stats.load_failures:
            stats.load_failures.pop()
            self.adapter_load_failures.inc()
        for stage in AdapterStats.STAGES:
            times = getattr(stats, stage)
            while times:
                self.load_seconds.labels(stage).observe(times.pop())
        self.adapter_evictions.inc(engine.pool.evictions - self._evictions)
        self._evictions = engine.pool.evictions
        self.resident.set(len(engine.pool.names))
        self.slot_bytes.set(engine.pool.nbytes)

    def watch(self, engine) -> None:
        """Reads the registry's and the tiers' sizes from `engine` at each scrape: a runtime load registers on a
        request's thread and a loader thread fills the tiers, neither between two turns of the engine loop, which
        may be idle (their counters are read under no lock: one int each)."""
        # less a --lora-dir adapter whose directory is gone, with one added since: `available`, as /v1/models
        self.registered.set_function(lambda: len(engine.registry.available()))
        self.host_adapters.set_function(lambda: len(engine.tiers.host))
        self.host_bytes.set_function(lambda: engine.tiers.host.nbytes)
        self.device_cache_adapters.set_function(lambda: len(engine.tiers.device))
        self.device_cache_bytes.set_function(lambda: engine.tiers.device.nbytes)

    def finished(self, request: Request, adapter: str | None, arrival: float) -> None:
        """Counts a request that ended (called once, on the engine thread)."""
        label = adapter or "base"
        self.requests.labels(label, request.finish).inc()
        self.generation_tokens.labels(label).inc(len(request.out))
        if request.first_token_time is not None:
            self.ttft_seconds.observe(request.first_token_time - arrival)
