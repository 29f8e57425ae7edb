"""/metrics in Prometheus' text format, through prometheus_client (the exposition format, the process
collector and thread-safe series are its job): requests by method, route and status, latency, requests in
flight, the queue, batches, decode time apart from queueing, tokens and characters translated, and the
process (CPU, memory, open files).

Every label comes from a fixed set, so no request can add a series: an unknown method or route counts as
"other", a status outside those the server answers as its class ("4xx"). The registry is the server's own,
not the library's global one, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

import threading

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
STATUSES = frozenset({200, 204, 400, 404, 405, 408, 411, 413, 415, 422, 500, 503, 504})


def method_label(method: str) -> str:
    return method if method in METHODS else "other"


def status_label(status: int) -> str:
    return str(status) if status in STATUSES else f"{status // 100}xx"


class Metrics:
    """The server's series, in a registry of its own."""

    def __init__(self, routes: tuple[str, ...] = ()):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

        self.routes = frozenset(routes)
        self.lock = threading.Lock()
        self.queued: dict[object, int] = {}  # lines waiting, by worker
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, memory, open fds
        r = self.registry
        self.requests = Counter(
            "nmt_requests", "HTTP requests answered, by method, route and status.",
            ["method", "route", "status"], registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "nmt_request_seconds", "Time from a request's arrival to its answer, by route.",
            ["route"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.in_flight = Gauge("nmt_requests_in_flight", "Requests being handled.", registry=r)
        self.queue = Gauge("nmt_queue_lines", "Source lines waiting for the model.", registry=r)
        self.batches = Histogram(
            "nmt_batch_lines", "Source lines in each batch the model translated.",
            buckets=BATCH_BUCKETS, registry=r,
        )  # fmt: skip
        self.decode_seconds = Histogram(
            "nmt_decode_seconds", "Time the model took for each batch.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_seconds = Histogram(
            "nmt_queue_seconds", "Time a request waited for the model before its first batch.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter("nmt_source_tokens", "Source subwords given to the model.", registry=r)
        self.characters = Counter(
            "nmt_translated_characters", "Characters of the translations answered.", registry=r
        )

    def route_label(self, path: str) -> str:
        return path if path in self.routes else "other"

    def observe_request(self, method: str, path: str, status: int, seconds: float) -> None:
        route = self.route_label(path)
        self.requests.labels(method_label(method), route, status_label(status)).inc()
        self.latency.labels(route).observe(seconds)

    def set_queue(self, lines: int, worker: object = None) -> None:
        """The lines waiting for `worker` (a server of several models has a worker each): the gauge is
        their sum."""
        with self.lock:
            self.queued[worker] = lines
            self.queue.set(sum(self.queued.values()))

    def observe_batch(self, lines: int, seconds: float) -> None:
        self.batches.observe(lines)
        self.decode_seconds.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The exposition and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
