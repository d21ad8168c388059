"""`ServerMetrics`: what the HTTP side adds to /metrics next to the engine's own registry: the
process (RSS, CPU, open files), requests in flight, and requests refused or ended early."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # process_resident_memory_bytes and friends: a leak shows here first (bench soak reads it).
        ProcessCollector(registry=r)
        self.in_flight = Gauge("fp4serve_http_requests_in_flight", "HTTP requests on /v1/* being served.", registry=r)
        self.rejected = Counter(
            "fp4serve_http_requests_rejected",
            "Requests refused before they started, by reason.",
            ["reason"],
            registry=r,
        )
        self.ended_early = Counter(
            "fp4serve_http_requests_ended_early",
            "Requests the server ended before they finished (request_timeout, server_stopping), by reason.",
            ["reason"],
            registry=r,
        )
