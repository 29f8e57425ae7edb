"""/metrics in Prometheus' text format: requests by route and status, latency, batch sizes, queue depth."""

from __future__ import annotations

import threading

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Histogram:
    def __init__(self, buckets: tuple):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        for k, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[k] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        pairs = zip(self.buckets, self.counts, strict=True)
        out = [f'{name}_bucket{{{labels}{sep}le="{b:g}"}} {c}' for b, c in pairs]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        tail = f"{{{labels}}}" if labels else ""
        return [*out, f"{name}_sum{tail} {self.sum:g}", f"{name}_count{tail} {self.count}"]


class Metrics:
    """Prometheus text format, kept by hand: a handful of series needs no client library."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str, int], int] = {}
        self.latency: dict[str, Histogram] = {}
        self.batches = Histogram(BATCH_BUCKETS)
        self.queue_depth = 0

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        with self.lock:
            key = (method, route, status)
            self.requests[key] = self.requests.get(key, 0) + 1
            self.latency.setdefault(route, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def observe_batch(self, lines: int) -> None:
        with self.lock:
            self.batches.observe(lines)

    def render(self) -> str:
        with self.lock:
            out = [
                "# HELP nmt_requests_total HTTP requests answered, by method, route and status.",
                "# TYPE nmt_requests_total counter",
                *(
                    f'nmt_requests_total{{method="{m}",route="{r}",status="{s}"}} {n}'
                    for (m, r, s), n in sorted(self.requests.items())
                ),
                "# HELP nmt_request_seconds Time from a request's arrival to its answer, by route.",
                "# TYPE nmt_request_seconds histogram",
            ]
            for route, h in sorted(self.latency.items()):
                out += h.lines("nmt_request_seconds", f'route="{route}"')
            out += [
                "# HELP nmt_batch_lines Source lines in each batch the model translated.",
                "# TYPE nmt_batch_lines histogram",
                *self.batches.lines("nmt_batch_lines"),
                "# HELP nmt_queue_lines Source lines waiting for the model.",
                "# TYPE nmt_queue_lines gauge",
                f"nmt_queue_lines {self.queue_depth}",
            ]
        return "\n".join(out) + "\n"
