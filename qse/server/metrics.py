"""Prometheus metrics in one registry per app (two apps in a process never share a counter).

Request-side figures are observed as they happen and carry the served model's name (`model_name`, as
vLLM's do, so one dashboard spans deployments); the conductor's figures (device time by role, the
reader's sessions in aggregate, the store's parks and restores) and the admission queue are read at
scrape time. No label names a session: sessions come and go, and a series each would grow without end.

A dashboard's figures (deploy/grafana/qse.json):
    decode loss        rate(qse_reader_ration_wall_seconds_total) / rate(qse_decode_seconds_total)
    the reader's share rate(qse_device_ms_total{role="reader_ration"}) / rate(qse_device_ms_total{role="served_decode"})
    freshness          rate(qse_shadow_turn_starts_total{fresh="true"}) / rate(qse_shadow_turn_starts_total)
    TTFT, ITL          histogram_quantile over qse_ttft_seconds_bucket, qse_itl_seconds_bucket
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..core.plan import is_fresh

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
_RATE_BUCKETS = (1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 200, 300, 500, 1000)
_BEHIND_BUCKETS = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class ConductorCollector:
    """Reads the conductor's status and the admission queue when scraped."""

    def __init__(self, status: Callable[[], dict[str, Any]], queue: Callable[[], tuple[int, int]], model_name: str):
        self._status = status
        self._queue = queue
        self._model = model_name

    def describe(self):
        return []

    def collect(self):
        running, waiting = self._queue()
        for name, doc, value in (("qse_requests_running", "requests admitted to run (prefilling or decoding)", running),
                                 ("qse_requests_waiting", "requests admitted that wait for a running slot", waiting)):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self._model], value)
            yield gauge
        status = self._status()
        device = CounterMetricFamily("qse_device_ms", "device time spent, by role (ms)", labels=["role"])
        for role, ms in status.get("ledger_ms", {}).items():
            device.add_metric([role], ms)
        yield device
        yield CounterMetricFamily("qse_turns", "served turns completed", value=status.get("turns", 0))
        yield CounterMetricFamily("qse_idle_bursts", "idle-window read bursts", value=status.get("idle_bursts", 0))
        sessions = status.get("sessions")
        if sessions is None:
            return
        # the reader's sessions in aggregate: how many, how many have no whole chunk left to read, how far behind
        yield GaugeMetricFamily("qse_shadow_sessions", "sessions the reader holds", value=len(sessions))
        yield GaugeMetricFamily("qse_shadow_sessions_caught_up", "sessions with no whole chunk left to read",
                                value=sum(1 for s in sessions if s["backlog"] == 0))
        yield GaugeMetricFamily("qse_shadow_backlog_tokens_sum", "whole-chunk ids not read yet, all sessions",
                                value=status.get("backlog", 0))
        yield GaugeMetricFamily("qse_shadow_behind_tokens_sum", "known ids not committed yet, all sessions",
                                value=sum(s["behind"] for s in sessions))
        yield GaugeMetricFamily("qse_shadow_behind_tokens_max", "known ids not committed yet, the session "
                                "furthest behind", value=max((s["behind"] for s in sessions), default=0))
        yield GaugeMetricFamily("qse_shadow_resident_bytes", "resident reader state",
                                value=status.get("resident_bytes", 0))
        router = status.get("router")
        if isinstance(router, dict):
            answers = CounterMetricFamily("qse_router_shadow_answers", "the router's class question asked of the "
                                          "reader: answered, compared with the router's own class, agreed",
                                          labels=["kind"])
            for kind, n in router.items():
                answers.add_metric([kind], n)
            yield answers
        store = status.get("store")
        if isinstance(store, dict):
            gauge = GaugeMetricFamily("qse_shadow_store", "the disk tier's figures (parks, restores, ...)",
                                      labels=["stat"])
            for key, value in store.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    gauge.add_metric([key], value)
            yield gauge


class ServerMetrics:
    """The request-side series; every one carries `model_name` (bound here, so callers never pass it)."""

    def __init__(self, status: Callable[[], dict[str, Any]], queue: Callable[[], tuple[int, int]],
                 model_name: str):
        self.registry = CollectorRegistry()
        r = self.registry
        self.model_name = model_name
        m = ["model_name"]
        self._request_seconds = Histogram("qse_request_seconds", "request latency, to the last byte",
                                          m + ["route", "status"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("qse_ttft_seconds", "arrival to the first token", m,
                                      buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl_seconds = Histogram("qse_itl_seconds", "time between two output tokens of a turn, as the server "
                                     "hands them to the client", m, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.decode_tokens_per_second = Histogram("qse_decode_tokens_per_second", "decode rate of a turn", m,
                                                  buckets=_RATE_BUCKETS, registry=r).labels(model_name)
        self.reader_share = Histogram("qse_reader_share", "reader ration time / served decode time, per turn", m,
                                      buckets=(0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2),
                                      registry=r).labels(model_name)
        self.decode_seconds = Counter("qse_decode_seconds", "wall time of turns from the first token to the end",
                                      m, registry=r).labels(model_name)
        self.reader_ration_wall_seconds = Counter(
            "qse_reader_ration_wall_seconds", "wall time decoding waited on the reader's slices (what the served "
            "model loses to the ration)", m, registry=r).labels(model_name)
        self.behind_at_turn_start = Histogram(
            "qse_shadow_behind_at_turn_start_tokens", "ids of the session's kept prefix the reader had not read "
            "when a follow-up turn started", m, buckets=_BEHIND_BUCKETS, registry=r).labels(model_name)
        self._turn_starts = Counter("qse_shadow_turn_starts", "follow-up turn starts, fresh: the reader less than "
                                    "one grid chunk behind", m + ["fresh"], registry=r)
        for fresh in ("true", "false"):  # both series from the start, so a rate over them is defined
            self._turn_starts.labels(model_name, fresh)
        self.prompt_tokens = Counter("qse_prompt_tokens", "prompt tokens served", m, registry=r).labels(model_name)
        self.output_tokens = Counter("qse_output_tokens", "output tokens served", m, registry=r).labels(model_name)
        self._finished = Counter("qse_turns_finished", "turns by finish reason", m + ["reason"], registry=r)
        self.prefix_cache_queries = Counter("qse_prefix_cache_queries_tokens", "prompt tokens looked up in the served "
                                            "sessions' cache", m, registry=r).labels(model_name)
        self.prefix_cache_hits = Counter("qse_prefix_cache_hits_tokens", "prompt tokens whose served state was reused",
                                         m, registry=r).labels(model_name)
        # speculative decoding (QSE_SPECULATE): vLLM's spec_decode draft and accepted counts, under qse's names
        self.spec_draft_tokens = Counter("qse_spec_decode_draft_tokens", "ids drafted for verification",
                                         m, registry=r).labels(model_name)
        self.spec_accepted_tokens = Counter("qse_spec_decode_accepted_tokens", "drafted ids a verify kept",
                                            m, registry=r).labels(model_name)
        self._prefix_cache_tier_hits = Counter("qse_prefix_cache_tier_hits", "turns that reused served state, by the "
                                               "tier it came from", m + ["tier"], registry=r)
        self.asks = Counter("qse_shadow_asks", "questions asked of the reader over HTTP", registry=r)
        self.narrations = Counter("qse_narrations", "narrator summaries written", registry=r)
        r.register(ConductorCollector(status, queue, model_name))

    def observe_request(self, route: str, status: int | str, seconds: float) -> None:
        self._request_seconds.labels(self.model_name, route, str(status)).observe(seconds)

    def note_cache_hit(self, tier: str) -> None:
        self._prefix_cache_tier_hits.labels(self.model_name, tier).inc()

    def note_finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def note_turn_start(self, behind_tokens: int, grid: int) -> None:
        self.behind_at_turn_start.observe(behind_tokens)
        self._turn_starts.labels(self.model_name, "true" if is_fresh(behind_tokens, grid) else "false").inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
