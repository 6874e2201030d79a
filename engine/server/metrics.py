"""Prometheus metrics of one server (its own registry, so several apps in one process do not collide)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ninfer_requests", "Finished requests", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("ninfer_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("ninfer_cached_prompt_tokens", "Prompt tokens served from held sequences",
                                     registry=r)
        self.completion_tokens = Counter("ninfer_completion_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("ninfer_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.decode_rate = Histogram("ninfer_decode_tokens_per_second", "Decode rate per request", registry=r,
                                     buckets=(1, 5, 10, 20, 50, 100, 150, 200, 300, 500))
        self.running = Gauge("ninfer_running_requests", "Requests generating now", registry=r)
        self.pending = Gauge("ninfer_pending_requests", "Requests waiting in the queue", registry=r)
        self.held = Gauge("ninfer_held_sequences", "Finished conversations held for reuse", registry=r)
        self.kv_tokens = Gauge("ninfer_kv_tokens_in_use", "KV pool tokens in use (running + held)", registry=r)
        self.kv_free = Gauge("ninfer_kv_tokens_free", "KV pool tokens free", registry=r)
        self.batched = Gauge("ninfer_batched_steps", "Steps that ran several requests' rows at once", registry=r)
        self.drafted = Gauge("ninfer_spec_drafted_tokens", "Drafts verified since the engine loaded", registry=r)
        self.accepted = Gauge("ninfer_spec_accepted_tokens", "Drafts accepted since the engine loaded", registry=r)
        self.preempted = Gauge("ninfer_preemptions", "Running requests preempted to free KV blocks since the engine "
                               "loaded", registry=r)

    def render(self, engine) -> bytes:
        if engine is not None:
            stats = engine.stats()
            self.running.set(stats["running"])
            self.pending.set(stats["pending"])
            self.held.set(stats["held_sequences"])
            self.kv_tokens.set(stats["kv_tokens_in_use"])
            self.kv_free.set(stats["kv_tokens_free"])
            self.batched.set(stats["batched_steps"])
            self.drafted.set(stats["drafted_tokens"])
            self.accepted.set(stats["accepted_tokens"])
            self.preempted.set(stats["preemptions"])
        return generate_latest(self.registry)
