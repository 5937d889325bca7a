"""OpenTelemetry traces and metrics of one agent: a span per decision and per commit, four metrics.

Off by default (`[telemetry] enabled = false`): a no-op tracer and meter, nothing exported. When enabled,
the standard variables configure it:

- `OTEL_SDK_DISABLED=true` turns it off again;
- `OTEL_SERVICE_NAME` names the service (default `emoe-agent`); `OTEL_RESOURCE_ATTRIBUTES` adds to it;
- `OTEL_TRACES_EXPORTER`, `OTEL_METRICS_EXPORTER`: comma-separated `console`, `otlp` or `none`
  (default `otlp`, as the specification says). `otlp` needs `opentelemetry-exporter-otlp`; without it the
  agent logs a warning and exports nothing; `OTEL_EXPORTER_OTLP_*` configure that exporter;
- `OTEL_METRIC_EXPORT_INTERVAL` (ms, default 60000), `OTEL_TRACES_SAMPLER` and the other SDK variables.

Every `Telemetry` owns its TracerProvider and MeterProvider (nothing is registered globally), so many agents
in one process, as in the simulated-cluster tests, keep their telemetry apart. Call `shutdown()` on stop.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    InMemoryMetricReader,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

log = logging.getLogger(__name__)

SCOPE = "elasticmoe.agent"
_OTLP = {
    "traces": ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "OTLPSpanExporter"),
    "metrics": ("opentelemetry.exporter.otlp.proto.grpc.metric_exporter", "OTLPMetricExporter"),
}


def _exporter_names(env: Mapping[str, str], var: str) -> list[str]:
    raw = env.get(var, "otlp")
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    return [] if "none" in names else names


def _otlp(kind: str) -> Any | None:
    module, cls = _OTLP[kind]
    try:
        return getattr(importlib.import_module(module), cls)()
    except ImportError:
        log.warning("OTEL_%s_EXPORTER=otlp but %s is not installed (pip install opentelemetry-exporter-otlp);"
                    " %s are not exported", kind.upper(), module, kind)
        return None


def _span_processors(env: Mapping[str, str]) -> list[SpanProcessor]:
    out: list[SpanProcessor] = []
    for name in _exporter_names(env, "OTEL_TRACES_EXPORTER"):
        exporter: SpanExporter | None
        if name == "console":
            exporter = ConsoleSpanExporter(out=sys.stdout)
        elif name == "otlp":
            exporter = _otlp("traces")
        else:
            log.warning("OTEL_TRACES_EXPORTER: %r is not supported (console, otlp or none); ignored", name)
            continue
        if exporter is not None:
            out.append(BatchSpanProcessor(exporter))
    return out


def _metric_readers(env: Mapping[str, str]) -> list[MetricReader]:
    out: list[MetricReader] = []
    interval = env.get("OTEL_METRIC_EXPORT_INTERVAL")
    try:
        interval_ms = float(interval) if interval else None
    except ValueError:
        log.warning("OTEL_METRIC_EXPORT_INTERVAL = %r: expected milliseconds; using the default", interval)
        interval_ms = None
    for name in _exporter_names(env, "OTEL_METRICS_EXPORTER"):
        if name == "console":
            exporter: Any = ConsoleMetricExporter(out=sys.stdout)
        elif name == "otlp":
            exporter = _otlp("metrics")
        else:
            log.warning("OTEL_METRICS_EXPORTER: %r is not supported (console, otlp or none); ignored", name)
            continue
        if exporter is not None:
            out.append(PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms))
    return out


class Telemetry:
    """Spans and metrics for one agent. Disabled: every method is a cheap no-op."""

    def __init__(self, *, enabled: bool = True, service_name: str = "emoe-agent", node_id: str = "",
                 span_processors: Sequence[SpanProcessor] = (),
                 metric_readers: Sequence[MetricReader] = ()) -> None:
        self.enabled = enabled
        self._memory_spans: InMemorySpanExporter | None = None
        self._memory_metrics: InMemoryMetricReader | None = None
        self._tracer_provider: TracerProvider | None = None
        self._meter_provider: MeterProvider | None = None
        if not enabled:
            self._tracer: otel_trace.Tracer = otel_trace.NoOpTracer()
            meter: otel_metrics.Meter = otel_metrics.NoOpMeter(SCOPE)
        else:
            attrs: dict[str, str] = {"service.name": service_name}
            if node_id:
                attrs["service.instance.id"] = node_id
            # Resource.create also merges OTEL_RESOURCE_ATTRIBUTES; ours take precedence
            resource = Resource.create(attrs)
            self._tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
            for p in span_processors:
                self._tracer_provider.add_span_processor(p)
            self._meter_provider = MeterProvider(metric_readers=list(metric_readers), resource=resource,
                                                 shutdown_on_exit=False)
            self._tracer = self._tracer_provider.get_tracer(SCOPE)
            meter = self._meter_provider.get_meter(SCOPE)
        self._imbalance = meter.create_gauge(
            "emoe.step_imbalance", unit="1",
            description="step imbalance: sum over layers of the max rank load / sum of the mean rank load")
        self._version = meter.create_gauge(
            "emoe.committed_version", unit="{version}", description="latest committed routing-table version")
        self._gossip_bytes = meter.create_counter(
            "emoe.gossip.bytes", unit="By", description="bytes of load gossip sent and received")
        self._commit_latency = meter.create_histogram(
            "emoe.commit.latency", unit="ms", description="proposal to commit, per committed version")
        self._transitions = meter.create_counter(
            "emoe.decision.transitions", unit="{transition}",
            description="decision lifecycle moves (PROPOSED, COMMITTED, ACTIVE, DONE, ROLLED_BACK, ...) by plan kind")

    # ---- construction ------------------------------------------------------------------------------

    @classmethod
    def from_env(cls, enabled: bool, node_id: str = "", env: Mapping[str, str] | None = None) -> Telemetry:
        """From the `[telemetry] enabled` flag and the OTEL_* variables of `env` (default os.environ)."""
        env = os.environ if env is None else env
        if not enabled or env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls(enabled=False)
        return cls(enabled=True, service_name=env.get("OTEL_SERVICE_NAME") or "emoe-agent", node_id=node_id,
                   span_processors=_span_processors(env), metric_readers=_metric_readers(env))

    @classmethod
    def for_tests(cls, enabled: bool = True, node_id: str = "test") -> Telemetry:
        """Wired to in-memory exporters; read them with finished_spans() and metrics()."""
        spans = InMemorySpanExporter()
        reader = InMemoryMetricReader()
        tel = cls(enabled=enabled, node_id=node_id, span_processors=[SimpleSpanProcessor(spans)],
                  metric_readers=[reader])
        tel._memory_spans, tel._memory_metrics = spans, reader
        return tel

    def finished_spans(self) -> list[ReadableSpan]:
        """Spans ended so far (for_tests only)."""
        if self._memory_spans is None:
            raise RuntimeError("finished_spans() needs a Telemetry from for_tests()")
        return list(self._memory_spans.get_finished_spans())

    def metrics(self) -> dict[str, list[Any]]:
        """Metric name -> its data points (NumberDataPoint or HistogramDataPoint), collected now
        (for_tests only). Empty when disabled."""
        if self._memory_metrics is None:
            raise RuntimeError("metrics() needs a Telemetry from for_tests()")
        if not self.enabled:
            return {}
        data = self._memory_metrics.get_metrics_data()
        out: dict[str, list[Any]] = {}
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    out.setdefault(m.name, []).extend(m.data.data_points)
        return out

    def shutdown(self) -> None:
        """Flush and stop the exporters; idempotent."""
        tp, mp = self._tracer_provider, self._meter_provider
        self._tracer_provider = self._meter_provider = None
        if tp is not None:
            tp.shutdown()
        if mp is not None:
            mp.shutdown()

    # ---- spans -------------------------------------------------------------------------------------

    def decision_span(self, version: int, ops: list[str], estimated_gain: float, verified_gain: float,
                      cost: float, trigger: str, outcome: str) -> None:
        """One span `emoe.decision` for a planning decision (proposed, refused, committed, rolled back)."""
        if not self.enabled:
            return
        span = self._tracer.start_span("emoe.decision", attributes={
            "version": int(version), "operations": [str(o) for o in ops],
            "estimated_gain": float(estimated_gain), "verified_gain": float(verified_gain),
            "cost": float(cost), "trigger": str(trigger), "outcome": str(outcome)})
        span.end()

    def commit_span(self, version: int, parent: int, votes: int, latency_ms: float) -> None:
        """One span `emoe.commit` covering the `latency_ms` that version `version` took to commit."""
        if not self.enabled:
            return
        end = time.time_ns()
        start = end - max(0, int(latency_ms * 1e6))
        span = self._tracer.start_span("emoe.commit", start_time=start, attributes={
            "version": int(version), "parent": int(parent), "votes": int(votes),
            "latency_ms": float(latency_ms)})
        span.end(end_time=end)

    # ---- metrics -----------------------------------------------------------------------------------

    def record_imbalance(self, x: float) -> None:
        self._imbalance.set(float(x))

    def record_version(self, v: int) -> None:
        self._version.set(int(v))

    def add_gossip_bytes(self, n: int) -> None:
        if n > 0:
            self._gossip_bytes.add(int(n))

    def record_commit_latency(self, ms: float) -> None:
        self._commit_latency.record(float(ms))

    def record_transition(self, kind: str, state: str) -> None:
        self._transitions.add(1, {"kind": kind, "state": state})
