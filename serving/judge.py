"""`adstream judge`: the served model's figures on live traffic, per served version (serving/live.py).

    adstream.events (read_committed, from its start) --outcomes_of--> LiveScores
        --every serving.judge.report_s--> Prometheus gauges adstream_live_metric{version, metric}
                                          MLflow: live_<metric> on the version's run (step = the
                                          version number) and as tags of the model version
                                          serving.judge.report_file (JSON: `adstream status`, simulate)

It reads the joiner's output, so a figure is there once the joiner emitted the impression (under the
window policy: when its window closed). Each start reads the topic from its beginning (its consumer
group is new each time), so a restarted judge recomputes what it knew.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from serving.live import LiveScores, outcomes_of
from serving.settings import JudgeSettings
from stream.kafka.settings import KafkaSettings
from stream.schema import Schema

log = logging.getLogger("adstream.judge")
EXPORTED_VERSIONS = 20  # versions with gauges (the newest); older ones stay in the report file


def run_judge(
    schema: Schema,
    kafka: KafkaSettings,
    settings: JudgeSettings,
    tracking_uri: str,
    model_name: str,
    policy: str,
    stop: Callable[[], bool] = lambda: False,
) -> dict[str, Any]:
    """Judge until stop() (or SIGINT); returns the last report."""
    from confluent_kafka import Consumer
    from prometheus_client import Gauge, start_http_server

    consumer = Consumer(
        {
            "bootstrap.servers": kafka.bootstrap,
            "group.id": f"{settings.app_id}-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",  # the joiner's committed transactions only
        }
    )
    consumer.subscribe([kafka.events_topic])
    gauge = Gauge("adstream_live_metric", "the served model on live traffic, per served version", ["version", "metric"])
    if settings.metrics_port:
        start_http_server(settings.metrics_port, settings.metrics_host)
    scores = LiveScores(settings.most_impressions)
    mlflow = _MlflowVersions(tracking_uri, model_name)
    changed: set[str] = set()
    exported: set[str] = set()
    report: dict[str, Any] = {}
    next_report = time.monotonic() + settings.report_s
    print(f"judge: reading {kafka.events_topic} for impressions serving logged (label: {policy} policy)", flush=True)
    try:
        while not stop():
            for message in consumer.consume(1000, timeout=0.2):
                if message.error() is None:
                    changed |= scores.add(outcomes_of(message.value() or b"", schema.label, schema.event_id))
            if time.monotonic() < next_report:
                continue
            next_report = time.monotonic() + settings.report_s
            report = _report(scores, policy)
            exported = _export(gauge, report["versions"], exported)
            _write(settings.report_file, report)
            mlflow.log({v: report["versions"][v] for v in changed if v in report["versions"]})
            changed = set()
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
    report = _report(scores, policy)
    _write(settings.report_file, report)
    return report


def topic_values(bootstrap: str, topic: str, timeout_s: float = 60.0) -> list[bytes]:
    """Every committed record's value on `topic` as it is now, partition by partition (the offline
    recomputation's input)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"adstream-judge-offline-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=timeout_s).topics[topic].partitions
        ends = {}
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
            if high > low:
                ends[p] = high
        consumer.assign([TopicPartition(topic, p, 0) for p in ends])
        values: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while ends and time.monotonic() < deadline:
            for message in consumer.consume(1000, timeout=0.5):
                if message.error() is not None:
                    continue
                values.append(message.value() or b"")
                if (message.offset() or 0) + 1 >= ends.get(message.partition() or 0, 0):
                    ends.pop(message.partition(), None)
            # a transaction's commit marker ends a partition too: the position reaches the end
            for tp in consumer.position([TopicPartition(topic, p) for p in list(ends)]):
                if tp.offset >= ends[tp.partition]:
                    ends.pop(tp.partition)
        return values
    finally:
        consumer.close()


def _report(scores: LiveScores, policy: str) -> dict[str, Any]:
    return {
        "time_ms": int(time.time() * 1000),
        "label": f"the highest label the joiner emitted for the impression ({policy} policy)",
        "forgotten_versions": scores.forgotten_versions,
        "versions": scores.report(),
    }


def _export(gauge: Any, versions: dict[str, dict[str, float]], before: set[str]) -> set[str]:
    """Gauges for the newest versions; the gauges of older ones removed."""
    newest = sorted(versions, key=lambda v: (len(v), v))[-EXPORTED_VERSIONS:]
    for version in before - set(newest):
        for metric in versions.get(version, {}):
            gauge.remove(version, metric)
    for version in newest:
        for metric, value in versions[version].items():
            gauge.labels(version, metric).set(value)
    return set(newest)


def _write(path: str, report: dict[str, Any]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_suffix(f".{os.getpid()}.tmp")
    temp.write_bytes(orjson.dumps(report, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_INDENT_2))
    temp.replace(target)  # a reader sees the old report or the new one, whole


class _MlflowVersions:
    """live_<metric> for each changed version: on the run that published it and as its tags."""

    def __init__(self, tracking_uri: str, model_name: str) -> None:
        self.uri, self.name = tracking_uri, model_name
        self._runs: dict[str, str] = {}

    def log(self, versions: dict[str, dict[str, float]]) -> None:
        if not versions:
            return
        try:
            from mlflow.entities import Metric
            from mlflow.tracking import MlflowClient

            client = MlflowClient(self.uri)
            now = int(time.time() * 1000)
            for version, figures in versions.items():
                if not version.isdigit():
                    continue
                run = self._runs.get(version) or client.get_model_version(self.name, version).run_id or ""
                self._runs[version] = run
                finite = {k: v for k, v in figures.items() if v == v}  # NaN: not measured yet
                client.log_batch(run, metrics=[Metric(f"live_{k}", v, now, int(version)) for k, v in finite.items()])
                for key in ("auc", "logloss", "calibration", "events"):
                    if key in finite:
                        client.set_model_version_tag(self.name, version, f"live_{key}", f"{finite[key]:.6g}")
        except Exception as exc:  # MLflow away: the next report tries again; the gauges and file go on
            log.warning("judge: MLflow not updated: %s", exc)
