"""GET /metrics: Prometheus text with vLLM's metric meanings under a `cbjax:` prefix.

Gauges and the preemption counter are the engine's load when scraped (its client's `counts`).
Latency histograms are observed once per request, as it ends served."""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cbjax.report.metrics import SERVED, request_latencies
from cbjax.core.request import Request
from cbjax.serve.client import EngineClient

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds), so dashboards built for it read these unchanged
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class EngineCollector:
    """The scheduler's state at scrape time; with a host KV tier (`cache.host_pages`), its pages,
    hits and bytes moved (`page_bytes`: the K/V bytes of one page)."""

    def __init__(self, engine: EngineClient, model_name: str, page_bytes: int = 0):
        self.engine = engine
        self.labels = {"model_name": model_name}
        self.page_bytes = page_bytes

    def collect(self) -> Iterator[Metric]:
        load = self.engine.counts()
        names = list(self.labels)
        values = list(self.labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"cbjax:{name}", doc, labels=names)
            g.add_metric(values, value)
            return g

        yield gauge("num_requests_running", "Requests in the running batch (holding a slot).", load.running)
        yield gauge("num_requests_waiting", "Requests waiting for a slot (preempted ones included).", load.waiting)
        used, total = load.pages_used, load.pages_total
        yield gauge("kv_cache_pages_used", "KV pages held by requests (the null page excluded).", used)
        yield gauge("kv_cache_pages_total", "Usable KV pages (cache.num_pages - 1).", total)
        yield gauge("kv_cache_usage_perc", "Fraction of usable KV pages held (1 = full).", used / max(1, total))
        c = CounterMetricFamily("cbjax:num_preemptions", "Preemptions since start.", labels=names)
        c.add_metric(values, load.preemptions)
        yield c
        if load.host_pages_total:
            yield gauge("kv_host_pages_used", "Host KV pages the host tier holds.", load.host_pages_used)
            hits = CounterMetricFamily("cbjax:kv_host_hits", "Prompt tokens admissions found in the host tier.", labels=names)
            hits.add_metric(values, load.host_hit_tokens)
            yield hits
            moved = CounterMetricFamily(
                "cbjax:kv_host_bytes", "K/V bytes copied to the host tier (stored) and back (loaded).",
                labels=names + ["direction"],
            )  # fmt: skip
            moved.add_metric(values + ["stored"], load.host_pages_stored * self.page_bytes)
            moved.add_metric(values + ["loaded"], load.host_pages_loaded * self.page_bytes)
            yield moved


class ServerMetrics:
    """The server's registry (one per app, so tests may build many)."""

    def __init__(self, engine: EngineClient, model_name: str, page_bytes: int = 0):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name, page_bytes))
        labels = ["model_name"]
        self.model_name = model_name
        reg = self.registry
        self.ttft = Histogram("cbjax:time_to_first_token_seconds", "Time to first token (server side).", labels, registry=reg, buckets=TTFT_BUCKETS)
        self.tpot = Histogram("cbjax:request_time_per_output_token_seconds", "Mean time per output token after the first, per request.", labels, registry=reg, buckets=TPOT_BUCKETS)
        self.e2e = Histogram("cbjax:e2e_request_latency_seconds", "Arrival to last token.", labels, registry=reg, buckets=E2E_BUCKETS)
        self.queue = Histogram("cbjax:request_queue_time_seconds", "Arrival to first scheduled.", labels, registry=reg, buckets=E2E_BUCKETS)
        self.finished = Counter("cbjax:request_success", "Requests ended, by finish reason.", labels + ["finished_reason"], registry=reg)
        self.prompt_tokens = Counter("cbjax:prompt_tokens", "Prompt tokens of served requests.", labels, registry=reg)
        self.generation_tokens = Counter("cbjax:generation_tokens", "Tokens generated.", labels, registry=reg)
        self.rejected_http = Counter("cbjax:http_rejected", "Requests answered with an error before the engine saw them, by status.", labels + ["status"], registry=reg)

    def on_finish(self, req: Request) -> None:
        name = self.model_name
        reason = req.finish_reason.value if req.finish_reason else "unknown"
        self.finished.labels(name, reason).inc()
        self.generation_tokens.labels(name).inc(req.num_generated)
        if req.finish_reason not in SERVED:
            return
        self.prompt_tokens.labels(name).inc(req.prompt_len)
        lat = request_latencies(req)
        for hist, key in ((self.ttft, "ttft_s"), (self.tpot, "tpot_s"), (self.e2e, "e2e_s"), (self.queue, "queue_s")):
            if lat[key] is not None:
                hist.labels(name).observe(lat[key])

    def http_error(self, status: int) -> None:
        self.rejected_http.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
