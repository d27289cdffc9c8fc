"""Labelled rows -> the two streams an ad server logs: impressions, and clicks that come later. Pure.

`adstream replay --clicks` (synthetic or a labelled log such as Criteo) sends what this makes:
every row an impression without its label, in accelerated event time (`event_rate` impressions per
event-time second), and for each positive row a click whose delay is drawn from `ClickDelays`.
`interleave` orders the two streams by event time, as they would reach Kafka from a live system:
a click is sent once the impressions' time has passed it.

The default delays, a mixture of exponentials: 60% of clicks within ~30 s, 30% a tail of ~10 minutes,
10% ~2 hours (most of those past a 30-minute window: late clicks).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from stream.errors import StreamError
from stream.formats.clicks import click_record
from stream.kafka.partitioner import murmur2_partition
from stream.produce.replay import ReplayRecord, table_records
from stream.schema import Schema


@dataclass(frozen=True)
class ClickDelays:
    """The click delay distribution: a mixture of exponentials, in event-time seconds."""

    shares: tuple[float, ...] = (0.6, 0.3, 0.1)  # weight of each component (sums to 1)
    means_s: tuple[float, ...] = (30.0, 600.0, 7200.0)  # mean delay of each component

    def __post_init__(self) -> None:
        if len(self.shares) != len(self.means_s) or abs(sum(self.shares) - 1) > 1e-6 or min(self.means_s) <= 0:
            raise StreamError(f"click delays {self}: one positive mean per share, shares summing to 1")

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n delays in ms (int64)."""
        component = rng.choice(len(self.shares), size=n, p=np.asarray(self.shares))
        return (rng.exponential(1.0, n) * np.asarray(self.means_s)[component] * 1000).astype(np.int64)


@dataclass(frozen=True, eq=False)
class Split:
    """A labelled table as an ad server would log it."""

    impressions: pa.Table  # the bundle-layout rows without their label, ts in accelerated event time
    click_ids: list[str]  # the impression id of each click
    click_ts: np.ndarray  # int64 (clicks,): click time, ms


def split_clicks(
    table: pa.Table,
    schema: Schema,
    rng: np.random.Generator,
    delays: ClickDelays = ClickDelays(),
    event_rate: float | None = None,
    start_ms: int | None = None,
) -> Split:
    """Rows [0, n) of a labelled bundle-layout table -> impressions + clicks. With event_rate, row
    i's time becomes start_ms + i * 1000 / event_rate (start_ms: the first row's own time)."""
    ts = table.column(schema.timestamp).to_numpy().astype(np.int64)
    if event_rate is not None and len(ts):
        if event_rate <= 0:
            raise StreamError(f"replay --event-rate {event_rate}: impressions per event-time second, > 0")
        base = int(ts[0]) if start_ms is None else start_ms
        ts = base + (np.arange(len(ts)) * (1000.0 / event_rate)).astype(np.int64)
        table = table.set_column(table.column_names.index(schema.timestamp), schema.timestamp, pa.array(ts))
    labels = table.column(schema.label).to_numpy(zero_copy_only=False)
    clicked = np.nonzero(labels == 1)[0]
    ids = table.column(schema.event_id).cast(pa.string()).to_pylist()
    click_ts = ts[clicked] + delays.draw(len(clicked), rng)
    impressions = table.drop_columns([schema.label])
    return Split(impressions, [ids[i] for i in clicked.tolist()], click_ts)


def interleave(
    splits: Iterable[Split | ReplayRecord],
    schema: Schema,
    impressions_topic: str,
    clicks_topic: str,
    partitions: int,
    bundle: int = 1,
    fmt: str = "json",
    max_span_ms: int | None = None,
) -> Iterator[ReplayRecord]:
    """Impression records (bundled as replay bundles events) and click records (one click each, key =
    impression id), in event-time order: before an impression record of time T, every click at or
    before T; after the last impression, the clicks still to come. Each record goes to the partition
    of its impression id (murmur2_partition): a bundle holds the impressions of one partition only,
    so every click meets its impression in one joiner partition. With `max_span_ms` (the joiner's
    lateness allowance) no bundle spans more event time than that: a bundle's newest impression
    moves the joiner's watermark, and a click sent after the bundle must not come after the
    watermark passed its window. A ReplayRecord among the splits (a log's bad line, bound for the
    DLQ) passes through."""
    waiting: list[tuple[int, str]] = []  # a heap of (click time, impression id)

    def clicks_until(t: int) -> Iterator[ReplayRecord]:
        while waiting and waiting[0][0] <= t:
            ts, key = heapq.heappop(waiting)
            raw = key.encode()
            yield ReplayRecord(raw, click_record(key, ts), 1, None, clicks_topic, murmur2_partition(raw, partitions))

    for split in splits:
        if isinstance(split, ReplayRecord):
            yield split
            continue
        for t, key in zip(split.click_ts.tolist(), split.click_ids, strict=True):
            heapq.heappush(waiting, (t, key))
        for first, record in _by_partition(split.impressions, schema, partitions, bundle, fmt, max_span_ms):
            yield from clicks_until(first)
            yield record._replace(topic=impressions_topic)
    yield from clicks_until(1 << 62)


def _by_partition(
    table: pa.Table, schema: Schema, partitions: int, bundle: int, fmt: str, max_span_ms: int | None = None
) -> list[tuple[int, ReplayRecord]]:
    """The table's records, bundled within each partition (runs of at most `bundle` rows spanning at
    most `max_span_ms` of event time), as (first event time, record) in time order."""
    ids = table.column(schema.event_id).cast(pa.string()).to_pylist()
    of_row = np.array([murmur2_partition(i.encode(), partitions) for i in ids], dtype=np.int64)
    times = table.column(schema.timestamp).to_numpy()
    out = []
    for p in range(partitions):
        rows = np.nonzero(of_row == p)[0]
        for run in _runs(times[rows], bundle, max_span_ms):
            run_rows = rows[run]
            at = 0
            for record in table_records(table.take(run_rows), schema, bundle, fmt):
                out.append((int(times[run_rows[at]]), record._replace(partition=p)))
                at += record.events
    out.sort(key=lambda pair: pair[0])
    return out


def _runs(times: np.ndarray, bundle: int, max_span_ms: int | None) -> list[slice]:
    """Consecutive rows cut where a bundle would span more than `max_span_ms` of event time (one run
    of everything without a limit; table_records cuts the runs into bundles of `bundle`)."""
    if max_span_ms is None or bundle <= 1 or not len(times):
        return [slice(0, len(times))]
    runs, start = [], 0
    while start < len(times):
        end = min(start + bundle, len(times))
        # the rows within max_span_ms of the run's first (times are in order within a partition)
        end = min(end, int(np.searchsorted(times, times[start] + max_span_ms, side="right")))
        end = max(end, start + 1)
        runs.append(slice(start, end))
        start = end
    return runs
