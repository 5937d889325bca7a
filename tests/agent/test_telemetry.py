"""agent/admin/telemetry: spans per decision and commit, metrics, OTEL_* configuration, off by default."""

from __future__ import annotations

import logging

import pytest

from agent.admin.telemetry import Telemetry


def _decide(tel: Telemetry) -> None:
    tel.decision_span(version=7, ops=["Replicate(l=3, e=12, dst=5)", "Migrate(l=1, e=4, 2->6)"],
                      estimated_gain=0.12, verified_gain=0.09, cost=0.4, trigger="imbalance>theta x2",
                      outcome="committed")


def test_decision_span_carries_version_operations_and_gain() -> None:
    tel = Telemetry.for_tests(node_id="node3")
    _decide(tel)
    (span,) = tel.finished_spans()
    assert span.name == "emoe.decision"
    a = span.attributes or {}
    assert a["version"] == 7
    assert list(a["operations"]) == ["Replicate(l=3, e=12, dst=5)", "Migrate(l=1, e=4, 2->6)"]
    assert a["estimated_gain"] == pytest.approx(0.12) and a["verified_gain"] == pytest.approx(0.09)
    assert (a["cost"], a["trigger"], a["outcome"]) == (pytest.approx(0.4), "imbalance>theta x2", "committed")
    assert span.resource.attributes["service.instance.id"] == "node3"
    tel.shutdown()


def test_commit_span_spans_the_latency() -> None:
    tel = Telemetry.for_tests()
    tel.commit_span(version=8, parent=7, votes=3, latency_ms=12.5)
    (span,) = tel.finished_spans()
    assert span.name == "emoe.commit"
    assert dict(span.attributes or {}) == {"version": 8, "parent": 7, "votes": 3, "latency_ms": 12.5}
    assert span.end_time is not None and span.start_time is not None
    assert span.end_time - span.start_time == 12_500_000


def test_metrics() -> None:
    tel = Telemetry.for_tests()
    tel.record_imbalance(1.3)
    tel.record_imbalance(1.1)
    tel.record_version(4)
    tel.add_gossip_bytes(1000)
    tel.add_gossip_bytes(24)
    for ms in (3.0, 5.0):
        tel.record_commit_latency(ms)
    m = tel.metrics()
    assert [p.value for p in m["emoe.step_imbalance"]] == [pytest.approx(1.1)]
    assert [p.value for p in m["emoe.committed_version"]] == [4]
    assert [p.value for p in m["emoe.gossip.bytes"]] == [1024]
    (h,) = m["emoe.commit.latency"]
    assert (h.count, h.sum) == (2, pytest.approx(8.0))


def test_disabled_records_nothing() -> None:
    tel = Telemetry.for_tests(enabled=False)
    _decide(tel)
    tel.commit_span(1, 0, 3, 1.0)
    tel.record_imbalance(2.0)
    tel.add_gossip_bytes(5)
    assert tel.finished_spans() == [] and tel.metrics() == {}


def test_from_env_is_off_by_default_and_honours_sdk_disabled() -> None:
    assert not Telemetry.from_env(False, env={"OTEL_TRACES_EXPORTER": "console"}).enabled
    assert not Telemetry.from_env(True, env={"OTEL_SDK_DISABLED": "true"}).enabled
    on = Telemetry.from_env(True, env={"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"})
    assert on.enabled
    with pytest.raises(RuntimeError, match="for_tests"):
        on.finished_spans()
    on.shutdown()


def test_from_env_console_exporters(capsys: pytest.CaptureFixture[str]) -> None:
    tel = Telemetry.from_env(True, node_id="node1", env={
        "OTEL_SERVICE_NAME": "emoe-test", "OTEL_TRACES_EXPORTER": "console",
        "OTEL_METRICS_EXPORTER": "console", "OTEL_METRIC_EXPORT_INTERVAL": "600000"})
    _decide(tel)
    tel.record_version(7)
    tel.shutdown()  # flushes both exporters
    out = capsys.readouterr().out
    assert '"name": "emoe.decision"' in out and '"service.name": "emoe-test"' in out
    assert "emoe.committed_version" in out


def test_unavailable_or_unknown_exporter_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="agent.admin.telemetry")
    tel = Telemetry.from_env(True, env={"OTEL_TRACES_EXPORTER": "zipkin", "OTEL_METRICS_EXPORTER": "otlp"})
    text = caplog.text
    assert "OTEL_TRACES_EXPORTER: 'zipkin' is not supported" in text
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
    except ImportError:
        assert "pip install opentelemetry-exporter-otlp" in text
    _decide(tel)  # still works, exports nowhere
    tel.shutdown()
