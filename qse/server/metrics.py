"""Prometheus metrics in one registry per app (two apps in a process never share a counter).

Request-side figures are observed as they happen; the conductor's figures (device time by role,
read positions, backlog, the store's parks and restores) are read from its status at scrape time.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_RATE_BUCKETS = (1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 200, 300, 500, 1000)


class ConductorCollector:
    """Reads the conductor's status when scraped."""

    def __init__(self, status: Callable[[], dict[str, Any]]):
        self._status = status

    def describe(self):
        return []

    def collect(self):
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
        yield GaugeMetricFamily("qse_shadow_sessions", "sessions the reader holds", value=len(sessions))
        yield GaugeMetricFamily("qse_shadow_backlog_tokens_sum", "whole-chunk ids not read yet, all sessions",
                                value=status.get("backlog", 0))
        yield GaugeMetricFamily("qse_shadow_resident_bytes", "resident reader state",
                                value=status.get("resident_bytes", 0))
        position = GaugeMetricFamily("qse_shadow_read_position_tokens", "rows the reader committed",
                                     labels=["session"])
        behind = GaugeMetricFamily("qse_shadow_behind_tokens", "known ids not committed yet", labels=["session"])
        backlog = GaugeMetricFamily("qse_shadow_backlog_tokens", "whole-chunk ids not read yet", labels=["session"])
        for s in sessions:
            position.add_metric([s["session"]], s["position"])
            behind.add_metric([s["session"]], s["behind"])
            backlog.add_metric([s["session"]], s["backlog"])
        yield position
        yield behind
        yield backlog
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
    def __init__(self, status: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_seconds = Histogram("qse_request_seconds", "request latency, to the last byte",
                                         ["route", "status"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("qse_ttft_seconds", "arrival to the first token", buckets=_LATENCY_BUCKETS,
                                      registry=r)
        self.decode_tokens_per_second = Histogram("qse_decode_tokens_per_second", "decode rate of a turn",
                                                  buckets=_RATE_BUCKETS, registry=r)
        self.reader_share = Histogram("qse_reader_share", "reader ration time / served decode time, per turn",
                                      buckets=(0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2), registry=r)
        self.prompt_tokens = Counter("qse_prompt_tokens", "prompt tokens served", registry=r)
        self.output_tokens = Counter("qse_output_tokens", "output tokens served", registry=r)
        self.finished = Counter("qse_turns_finished", "turns by finish reason", ["reason"], registry=r)
        self.asks = Counter("qse_shadow_asks", "questions asked of the reader over HTTP", registry=r)
        self.narrations = Counter("qse_narrations", "narrator summaries written", registry=r)
        r.register(ConductorCollector(status))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
