"""The joiner's input partitions: what it holds of each in memory, and how its two inputs are read
in step (stream/join/joiner.py is the shell around them).

Event time moves per partition. A partition's watermark may pass a click only once every clicks
partition of the worker has read past it (a click for p may first arrive on q and be moved), an
impression likewise, and a record moved here from another partition holds it until read back
(`holds`). An impressions partition that ran more than the lateness allowance ahead of the unread
clicks is paused until they catch up (`align`), so the output follows event time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stream.errors import StreamError
from stream.join.policy import Cursor, JoinRules
from stream.join.state import PartitionState, PendingOutput
from stream.kafka.settings import KafkaSettings

NEVER = -(1 << 62)


@dataclass
class Partition:
    """One input partition's state, cursor and offsets (the joiner's mutable shell state)."""

    number: int  # the partition
    state: PartitionState
    cursor: Cursor
    impressions_offset: int
    clicks_offset: int
    touched: bool = False  # read from in this chunk
    newest_click: int = NEVER  # newest click time read (since start)
    # records moved here from another partition and not read back yet: the oldest one's event time
    # (the watermark waits for it) and, once their transaction committed, the offset by which this
    # partition's input (impressions or clicks) has read them all
    holds: dict[str, tuple[int, int]] = field(default_factory=dict)
    # how far the clicks that may label this partition's impressions are known to have come (event
    # time; None: all read): the worker's unread clicks partitions and clicks moved here (Inputs.align)
    clicks_frontier: int | None = NEVER
    # the input partitions paused because they ran ahead of the other in event time (Inputs.align)
    paused: dict[str, bool] = field(default_factory=lambda: {"impressions": False})
    outputs: list[PendingOutput] = field(default_factory=list)


def worker_partitions(consumer: Any, kafka: KafkaSettings, worker: int, workers: int) -> tuple[list[int], int, int]:
    """(this worker's input partitions, the inputs' partition count, the events topic's), from the
    broker's metadata: both inputs must exist and be co-partitioned."""
    topics = consumer.list_topics(timeout=30).topics
    counts = []
    for name in (kafka.impressions_topic, kafka.clicks_topic):
        if name not in topics or topics[name].error is not None:
            raise StreamError(f"join: no topic {name} at {kafka.bootstrap}; create it with `adstream up`")
        counts.append(len(topics[name].partitions))
    if counts[0] != counts[1]:
        raise StreamError(
            f"join: {kafka.impressions_topic} has {counts[0]} partitions, {kafka.clicks_topic} "
            f"{counts[1]}; the join needs them co-partitioned: give both the same count"
        )
    events = topics.get(kafka.events_topic)
    if events is None or events.error is not None:
        raise StreamError(f"join: no topic {kafka.events_topic} at {kafka.bootstrap}; run `adstream up`")
    return [p for p in range(counts[0]) if p % workers == worker], counts[0], len(events.partitions)


def assign_fetching(consumer: Any, assignment: list[Any]) -> None:
    """Assign `assignment` (TopicPartitions at their next offsets), every partition of it fetched.
    librdkafka keeps a partition's pause through a rebalance: one this worker paused (`Inputs.align`)
    and then lost and got back would never be fetched again, while the new `Partition` says it is not
    paused, so nothing resumes it (its watermark, and with it every window of the worker, would stop)."""
    consumer.assign(assignment)
    consumer.resume(assignment)


class Inputs:
    """The worker's impressions and clicks partitions as its consumer reads them."""

    def __init__(self, consumer: Any, kafka: KafkaSettings, rules: JoinRules, parts: dict[int, Partition]) -> None:
        self.consumer, self.kafka, self.rules, self.parts = consumer, kafka, rules, parts

    def move_frontiers(self, settled: bool = False) -> None:
        """Let each partition's watermark pass the clicks read so far, of every clicks partition of
        this worker (a click for p may first arrive on q and be moved), or go free once every click is
        read (each partition's high offset, as of the last fetch, reached); likewise never past the
        newest impression of an impressions partition not read to its end (an impression for p may
        first arrive on q), nor past a moved record not read back yet. Then run the timers it passed."""
        clicks: int | None = None
        impressions: int | None = None
        for p, part in self.parts.items():
            if not self.caught_up(self.kafka.clicks_topic, p, part.clicks_offset, settled):
                clicks = lowest(clicks, part.newest_click)
            if not self.caught_up(self.kafka.impressions_topic, p, part.impressions_offset, settled):
                impressions = lowest(impressions, NEVER if part.cursor.newest is None else part.cursor.newest)
        for part in self.parts.values():
            self._release_holds(part)
            part.clicks_frontier = lowest(clicks, part.holds.get("clicks", (None,))[0])
            held = lowest(impressions, part.holds.get("impressions", (None,))[0])
            part.cursor.frontier = lowest(part.clicks_frontier, held)
            if part.cursor.fire(part.cursor.watermark):
                part.touched = True  # its state changed: commit it with this chunk

    def topic(self, which: str) -> str:
        """The topic of an input ("impressions" or "clicks")."""
        return self.kafka.impressions_topic if which == "impressions" else self.kafka.clicks_topic

    def _release_holds(self, part: Partition) -> None:
        for which, (_, until) in list(part.holds.items()):
            offset = part.impressions_offset if which == "impressions" else part.clicks_offset
            if until >= 0 and offset >= until:
                del part.holds[which]

    def align(self, p: int, part: Partition) -> None:
        """Read the two inputs in step, in event time: while the clicks partition has unread clicks
        and the impressions are more than the lateness allowance ahead of its newest click, pause
        the impressions partition; resume it once the clicks caught up. So the joiner's output
        follows event time (a fake negative and its positive copy come about a click delay apart, as
        live), and the state does not grow with how far the impressions ran ahead. (Clicks that ran
        ahead of their impressions are held as early clicks instead: pausing the clicks too, whose
        fetches reach much further in time than the impression bundles', costs more in refetches
        than the early clicks' slow path.)"""
        cursor, frontier = part.cursor, part.clicks_frontier  # (impressions moved here are read on, not waited for)
        ahead = (
            frontier is not None
            and cursor.newest is not None
            and cursor.newest > frontier + self.rules.allowed_lateness_ms
        )
        self._pause(p, part, "impressions", ahead, part.impressions_offset)

    def caught_up(self, topic: str, p: int, offset: int, settled: bool = False, fresh: bool = False) -> bool:
        """Whether the partition's next offset to read (-1: none read yet) reached its end, as of the
        last fetch (an empty partition is caught up from the start). `settled`: every record the
        consumer returned is processed, so its position counts too: a partition written in
        transactions (records moved there) ends with a commit marker no record stands for, which
        the position passes and our next offset never reaches. `fresh`: the end asked of the broker now."""
        from confluent_kafka import TopicPartition

        tp = TopicPartition(topic, p)
        low, high = self.consumer.get_watermark_offsets(tp, **({"timeout": 30} if fresh else {"cached": True}))
        if high is None or high < 0:
            return False  # not fetched yet
        at = offset if offset >= 0 else max(low or 0, 0)
        if at < high and settled and at >= high - 16:  # (a few markers at most: don't ask otherwise)
            at = max(at, self.consumer.position([tp])[0].offset)
        return at >= high

    def _pause(self, p: int, part: Partition, which: str, pause: bool, offset: int) -> None:
        from confluent_kafka import TopicPartition

        if pause == part.paused[which]:
            return
        topic = self.topic(which)
        tp = [TopicPartition(topic, p, offset)]
        if pause:
            self.consumer.pause(tp)
        else:
            self.consumer.resume(tp)
            if offset >= 0:
                self.consumer.seek(tp[0])  # from the next record not yet read
        part.paused[which] = pause

    def at_end(self) -> bool:
        """Whether every input partition of this worker is read to its end (asked of the broker now)
        and no record moved to one of them is still unread."""
        return all(
            not part.holds
            and self.caught_up(self.kafka.impressions_topic, p, part.impressions_offset, settled=True, fresh=True)
            and self.caught_up(self.kafka.clicks_topic, p, part.clicks_offset, settled=True, fresh=True)
            for p, part in self.parts.items()
        )

    def note_moved(self) -> None:
        """Once the transaction with moved records committed: the offset by which each partition of
        this worker they went to will have read them (its end now; asked again next chunk if the
        broker does not answer)."""
        from confluent_kafka import KafkaException, TopicPartition

        for q, part in self.parts.items():
            for which, (ts, until) in list(part.holds.items()):
                if until >= 0:
                    continue
                topic = self.topic(which)
                try:
                    _, high = self.consumer.get_watermark_offsets(TopicPartition(topic, q), timeout=10, cached=False)
                except KafkaException:
                    continue
                part.holds[which] = (ts, high - 1)  # (the last record is the transaction's commit marker)


def lowest(a: int | None, b: int | None) -> int | None:
    """The lower of two frontiers, None standing for none."""
    return b if a is None else a if b is None else min(a, b)
