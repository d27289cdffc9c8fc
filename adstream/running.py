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
        lag = {}
        for topic in topics:
            keys = [k for k in ends if k[0] == topic]
            lag[topic] = sum(ends[k] - max(committed.get(k, -1), 0) for k in keys)
        out[group] = {"lag": lag, "committed": any(offset >= 0 for offset in committed.values())}
    return out
