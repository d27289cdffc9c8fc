"""What the local stack runs, for `adstream status`: each adstream process announces itself, and
the stack's consumer groups, dead letters and served model are read from their own sources.

`announce(state_dir, command)` writes `<state_dir>/running/<command>-<pid>.json` (command, pid,
start time, argv) while a long-running command (stream, join, train, serve) runs, and removes it
when it ends; a file whose pid is gone (a SIGKILL) reads as "gone" and is cleared by `running`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from adstream.processes import alive


@dataclass(frozen=True)
class RunningProcess:
    command: str  # "stream", "join", "train", "serve"
    pid: int
    started_s: float  # unix seconds
    argv: tuple[str, ...]
    alive: bool


def _folder(state_dir: str) -> Path:
    return Path(state_dir).expanduser().resolve() / "running"


@contextlib.contextmanager
def announce(state_dir: str, command: str) -> Iterator[None]:
    """While the block runs, `adstream status` lists this process."""
    folder = _folder(state_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{command}-{os.getpid()}.json"
    path.write_bytes(
        orjson.dumps({"command": command, "pid": os.getpid(), "started_s": time.time(), "argv": sys.argv[1:]})
    )
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def running(state_dir: str) -> list[RunningProcess]:
    """The announced processes, oldest first; one whose pid is gone is listed once as not alive,
    and its file removed."""
    out = []
    for path in sorted(_folder(state_dir).glob("*.json")):
        try:
            info = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            continue
        running_now = alive(int(info["pid"]))
        if not running_now:
            path.unlink(missing_ok=True)
        out.append(
            RunningProcess(info["command"], int(info["pid"]), info["started_s"], tuple(info["argv"]), running_now)
        )
    return sorted(out, key=lambda p: p.started_s)


def consumer_lags(bootstrap: str, groups: dict[str, list[str]], timeout_s: float = 5.0) -> dict[str, dict[str, Any]]:
    """For each group (-> the topics it reads): its committed offsets' lag behind the topics' ends,
    summed per topic, and whether it has committed anything at all."""
    from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
    from confluent_kafka.admin import AdminClient, OffsetSpec

    admin = AdminClient({"bootstrap.servers": bootstrap})
    metadata = admin.list_topics(timeout=timeout_s)
    wanted = {t for topics in groups.values() for t in topics if t in metadata.topics}
    partitions = [TopicPartition(t, p) for t in sorted(wanted) for p in metadata.topics[t].partitions]
    ends: dict[tuple[str, int], int] = {}
    if partitions:
        futures = admin.list_offsets({tp: OffsetSpec.latest() for tp in partitions}, request_timeout=timeout_s)
        ends = {(tp.topic, tp.partition): f.result().offset for tp, f in futures.items()}
    out: dict[str, dict[str, Any]] = {}
    for group, topics in groups.items():
        request = [ConsumerGroupTopicPartitions(group, [tp for tp in partitions if tp.topic in topics])]
        result = admin.list_consumer_group_offsets(request, request_timeout=timeout_s)[group].result()
        committed = {(tp.topic, tp.partition): tp.offset for tp in result.topic_partitions or []}
        behind = {k: (max(committed.get(k, -1), 0), end) for k, end in ends.items() if k[0] in topics}
        readable = readable_records(bootstrap, {k: v for k, v in behind.items() if v[1] > v[0]}, timeout_s)
        lag = {}
        for topic in topics:
            lag[topic] = sum(readable.get(k, 0) for k in behind if k[0] == topic)
        out[group] = {"lag": lag, "committed": any(offset >= 0 for offset in committed.values())}
    return out


def readable_records(
    bootstrap: str, spans: dict[tuple[str, int], tuple[int, int]], timeout_s: float = 5.0, most: int = 10_000
) -> dict[tuple[str, int], int]:
    """How many records a read_committed consumer can still read in each (topic, partition) between a
    committed offset and the end: the end counts transaction markers (one per transaction) and aborted
    records, which no reader sees, so a group that read everything of a transactional topic is not 0
    behind by offsets. A span over `most` records is given by offsets (the markers in it are few)."""
    from confluent_kafka import Consumer, TopicPartition

    counts = {k: end - start for k, (start, end) in spans.items()}
    small = {k: v for k, v in spans.items() if v[1] - v[0] <= most}
    if not small:
        return counts
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "adstream-status",  # never commits: assign() and no offsets stored
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    try:
        consumer.assign([TopicPartition(t, p, start) for (t, p), (start, _) in small.items()])
        seen = dict.fromkeys(small, 0)
        left = set(small)
        deadline = time.monotonic() + timeout_s
        while left and time.monotonic() < deadline:
            for message in consumer.consume(1000, timeout=0.2):
                if message.error() is None and (message.topic(), message.partition()) in seen:
                    seen[(str(message.topic()), int(message.partition() or 0))] += 1
            for tp in consumer.position([TopicPartition(t, p) for t, p in left]):
                if tp.offset >= small[(tp.topic, tp.partition)][1]:
                    left.discard((tp.topic, tp.partition))
        counts.update({k: seen[k] for k in small if k not in left})
    finally:
        consumer.close()
    return counts


# what `adstream status` shows of each joiner worker: its Prometheus counters, by the words it prints
JOINER_COUNTERS = {
    "adstream_join_impressions_total": "impressions",
    "adstream_join_clicks_total": "clicks",
    "adstream_join_pending": "pending",
    "adstream_join_rerouted_total": "moved to their partition",
    "adstream_join_late_clicks_total": "late clicks",
    "adstream_join_forgotten_clicks_total": "clicks past memory",
    "adstream_join_orphan_clicks_total": "orphan clicks",
    "adstream_join_rejected_total": "rejected",
}


def joiner_counters(host: str, port: int, most_workers: int = 16) -> list[dict[str, float]]:
    """Each running joiner worker's counters (worker i serves its metrics on port + i), read until a
    port does not answer."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for i in range(most_workers):
        try:
            text = httpx.get(f"http://{host}:{port + i}/metrics", timeout=2).text
        except httpx.HTTPError:
            break
        counters = dict.fromkeys(JOINER_COUNTERS.values(), 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in JOINER_COUNTERS:
                    counters[JOINER_COUNTERS[sample.name]] += sample.value
        if not any(name.startswith("adstream_join") for name in text.split()):
            break  # another program's endpoint
        out.append(counters)
    return out
