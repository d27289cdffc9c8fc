"""The joiner (`adstream join`): impressions + clicks on Kafka -> labelled events, exactly once.

    adstream.impressions --+
                           +--> read_impressions / read_clicks --> Cursor (stream/join.py) --> adstream.events
    adstream.clicks -------+        (stream/join_input.py)          entries in RocksDB          (+ the DLQ)

A thin shell around the join's rules: it reads a chunk of records, moves each partition's Cursor
(whose entries live in that partition's RocksDB, stream/join_state.py), and writes what came out.

Exactly once, the design: each chunk ends in two commits, in this order:
1. RocksDB, one atomic write per partition: the changed entries, the next input offsets, and the
   chunk's outputs (the labelled bundles and dead letters it will send);
2. Kafka, one transaction: those outputs and the same offsets (send_offsets_to_transaction), under
   a transactional id per worker, so a restarted worker fences its predecessor's open transaction.
After a crash between the two, the database is one chunk ahead of the group's committed offsets;
at start the joiner sees that (per partition) and sends that chunk's stored outputs again in a new
transaction before reading on. A crash before 1 loses the chunk's work only: its input is read
again from the database's offsets. So no record is read into the state twice, none is skipped,
and an emitted event reaches `adstream.events` once for readers at isolation level read_committed
(the featurizer reads so). Why not Faust's exactly-once: its tables replay a changelog topic on
every start (minutes for a 30-minute window) and its transactions are per partition of one topic,
while a join reads two; this is one poll loop, one write and one transaction per chunk.

Partitions: impressions and clicks are keyed by impression id and have as many partitions, so
partition p of both holds every record of an id (produce both with one partitioner: `adstream
replay --clicks` does). Worker i of N takes the partitions p with p % N == i, and each partition
has its own database, so N can change between runs.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Counter, Gauge

from stream.clicks import click_record
from stream.join import Cursor, Emission, JoinRules, payload_kept_ms
from stream.join_input import ClickFields, read_clicks, read_impressions
from stream.join_output import event_records
from stream.join_state import PartitionState, PendingOutput, Progress
from stream.outputs import RECORD_OVERHEAD, dead_letter
from stream.prometheus import serve_metrics
from stream.records import RawRecord, Rejected
from stream.retry import is_transient
from stream.schema import Schema, load_schema
from stream.settings import KafkaSettings, StreamSettings

log = logging.getLogger("adstream.join")

IMPRESSIONS = Counter("adstream_join_impressions_total", "impressions read")
CLICKS = Counter("adstream_join_clicks_total", "clicks read")
EMITTED = Counter("adstream_join_emitted_total", "labelled events written", ["label"])
LATE = Counter("adstream_join_late_clicks_total", "clicks after their impression's window")
ORPHANS = Counter("adstream_join_orphan_clicks_total", "clicks no impression claimed (dead-lettered)")
DUPLICATE_CLICKS = Counter("adstream_join_duplicate_clicks_total", "second clicks of a clicked impression")
REJECTED = Counter("adstream_join_rejected_total", "impressions and clicks sent to the dead-letter topic")
PENDING = Gauge(
    "adstream_join_pending", "entries held (pending impressions, closed ones kept for late clicks, early clicks)"
)
STATE_BYTES = Gauge("adstream_join_state_bytes", "bytes of join state on disk and in memtables")
WATERMARK_LAG = Gauge("adstream_join_watermark_lag_seconds", "wall-clock time minus the lowest partition watermark")
EXIT_CANNOT_WRITE = 70


@dataclass
class _Partition:
    """One input partition's state, cursor and offsets (the joiner's mutable shell state)."""

    state: PartitionState
    cursor: Cursor
    impressions_offset: int
    clicks_offset: int
    touched: bool = False  # read from in this chunk
    newest_click: int = -(1 << 62)  # newest click time read (since start)
    # the input partitions paused because they ran ahead of the other in event time (Joiner._align)
    paused: dict[str, bool] = field(default_factory=lambda: {"impressions": False})
    outputs: list[PendingOutput] = field(default_factory=list)


class Joiner:
    """One joiner worker: its partitions' states, a read-committed consumer, a transactional producer."""

    def __init__(self, kafka: KafkaSettings, settings: StreamSettings, worker: int = 0, workers: int = 1) -> None:
        from confluent_kafka import Consumer, Producer

        self.kafka, self.settings, self.join = kafka, settings, settings.join
        self.schema: Schema = load_schema(settings.schema)
        self.rules: JoinRules = self.join.rules()
        self.fields = ClickFields(self.join.click_impression_id, self.join.click_time)
        self.consumer = Consumer(
            {
                "bootstrap.servers": kafka.bootstrap,
                "group.id": self.join.app_id,
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",
                "max.partition.fetch.bytes": kafka.max_message_bytes,
                "fetch.max.bytes": max(kafka.max_message_bytes, 50 << 20),
            }
        )
        self.producer = Producer(
            {
                "bootstrap.servers": kafka.bootstrap,
                "transactional.id": f"{self.join.app_id}-{worker}",
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 20,
                "compression.type": "lz4",
                "message.max.bytes": kafka.max_message_bytes,
                "transaction.timeout.ms": 60_000,
            }
        )
        self.partitions = self._my_partitions(worker, workers)
        self.parts: dict[int, _Partition] = {}

    def _my_partitions(self, worker: int, workers: int) -> list[int]:
        from stream.errors import StreamError

        topics = self.consumer.list_topics(timeout=30).topics
        counts = []
        for name in (self.kafka.impressions_topic, self.kafka.clicks_topic):
            if name not in topics or topics[name].error is not None:
                raise StreamError(f"join: no topic {name} at {self.kafka.bootstrap}; create it with `adstream up`")
            counts.append(len(topics[name].partitions))
        if counts[0] != counts[1]:
            raise StreamError(
                f"join: {self.kafka.impressions_topic} has {counts[0]} partitions, {self.kafka.clicks_topic} "
                f"{counts[1]}; the join needs them co-partitioned: give both the same count"
            )
        return [p for p in range(counts[0]) if p % workers == worker]

    def start(self) -> None:
        """Fence any earlier instance, finish what a crash left unsent, and assign the partitions."""
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        self.producer.init_transactions(60)  # aborts a predecessor's open transaction
        imp, clk = self.kafka.impressions_topic, self.kafka.clicks_topic
        committed = {
            (tp.topic, tp.partition): tp.offset
            for tp in self.consumer.committed(
                [TopicPartition(t, p) for p in self.partitions for t in (imp, clk)], timeout=60
            )
        }
        assignment = []
        for p in self.partitions:
            state = PartitionState(Path(self.join.state_dir) / f"{imp}-{p}")
            progress = state.progress
            timers = [(entry.due, key) for key, entry in state.entries()]
            cursor = Cursor(self.rules, state.get, state.stage, timers, progress.newest_ts, state.preload)
            cursor.clicks_frontier = -(1 << 62)  # no click read yet: no window closes until they are
            part = _Partition(state, cursor, progress.impressions_offset, progress.clicks_offset)
            self.parts[p] = part
            behind = (_offset(committed.get((imp, p))), _offset(committed.get((clk, p)))) != (
                progress.impressions_offset,
                progress.clicks_offset,
            )
            if progress.chunk and behind:  # the last chunk's transaction did not commit: send it again
                part.outputs = state.pending_outputs()
                part.touched = True
                log.warning("join: partition %d: resending chunk %d's %d outputs", p, progress.chunk, len(part.outputs))
            for topic, offset in ((imp, progress.impressions_offset), (clk, progress.clicks_offset)):
                assignment.append(TopicPartition(topic, p, offset if offset >= 0 else OFFSET_BEGINNING))
        if any(part.touched for part in self.parts.values()):
            self._send()
        self.consumer.assign(assignment)

    def step(self, timeout_s: float | None = None) -> int:
        """Read one chunk (up to take_records, waiting up to chunk_wait_s), join it, commit it;
        returns the records read."""
        wait = self.join.chunk_wait_s if timeout_s is None else timeout_s
        messages = self.consumer.consume(self.join.take_records, wait)
        messages = [m for m in messages if m.error() is None or _log_error(m)]
        for part in self.parts.values():
            part.touched = part.touched or any(part.paused.values())  # a paused input may resume: look again
        if not messages and not any(part.touched for part in self.parts.values()):
            return 0
        imp = self.kafka.impressions_topic
        messages.sort(key=lambda m: m.topic() == imp)  # a chunk's clicks first: fewer wait as early clicks
        clicked: set[int] = set()  # partitions whose clicks moved: their frontier moves before their impressions
        for message in messages:
            p, offset, topic = int(message.partition() or 0), int(message.offset() or 0), str(message.topic())
            if topic == imp and clicked:
                for q in clicked:
                    self._move_frontier(q, self.parts[q])
                clicked.clear()
            part = self.parts[p]
            part.touched = True
            record = RawRecord(p, offset, message.value() or b"")
            if topic == imp:
                impressions, bad, bundle = read_impressions(record, self.schema)
                IMPRESSIONS.inc(len(impressions))
                if bundle is not None:  # stored once; its impressions point at their rows
                    part.state.put_bundle(offset, max(i.ts for i in impressions), record.value, bundle)
                if len(impressions) > 1:
                    part.state.preload([i.impression_id for i in impressions])
                part.cursor.impressions(impressions)
                part.impressions_offset = offset + 1
            else:
                clicks, bad = read_clicks(record, self.fields)
                CLICKS.inc(len(clicks))
                for click in clicks:
                    part.cursor.click(click)
                    part.newest_click = max(part.newest_click, click.ts)
                part.clicks_offset = offset + 1
                clicked.add(p)
            if bad:
                part.outputs += [self._letter(topic, r) for r in bad]
                REJECTED.inc(len(bad))
        for p, part in self.parts.items():
            if part.touched:
                self._close_chunk(p, part)
        self._send()
        return len(messages)

    def _move_frontier(self, p: int, part: _Partition) -> None:
        """Let the watermark pass the clicks read so far, or go free once every click is read (the
        partition's high offset, as of the last fetch, reached); then run the timers it passed."""
        caught_up = self._caught_up(self.kafka.clicks_topic, p, part.clicks_offset)
        part.cursor.clicks_frontier = None if caught_up else part.newest_click
        part.cursor.fire(part.cursor.watermark)

    def _align(self, p: int, part: _Partition) -> None:
        """Read the two inputs in step, in event time: while the clicks partition has unread clicks
        and the impressions are more than the lateness allowance ahead of its newest click, pause
        the impressions partition; resume it once the clicks caught up. So the joiner's output
        follows event time (a fake negative and its positive copy come about a click delay apart, as
        live), and the state does not grow with how far the impressions ran ahead. (Clicks that ran
        ahead of their impressions are held as early clicks instead: pausing the clicks too, whose
        fetches reach much further in time than the impression bundles', costs more in refetches
        than the early clicks' slow path.)"""
        cursor = part.cursor
        ahead = (
            cursor.clicks_frontier is not None
            and cursor.newest is not None
            and cursor.newest > part.newest_click + self.rules.allowed_lateness_ms
        )
        self._pause(p, part, "impressions", ahead, part.impressions_offset)

    def _caught_up(self, topic: str, p: int, offset: int) -> bool:
        """Whether the partition's next offset to read (-1: none read yet) reached its end, as of the
        last fetch (an empty partition is caught up from the start)."""
        from confluent_kafka import TopicPartition

        low, high = self.consumer.get_watermark_offsets(TopicPartition(topic, p), cached=True)
        if high is None or high < 0:
            return False  # not fetched yet
        return (offset if offset >= 0 else max(low or 0, 0)) >= high

    def _pause(self, p: int, part: _Partition, which: str, pause: bool, offset: int) -> None:
        from confluent_kafka import TopicPartition

        if pause == part.paused[which]:
            return
        topic = self.kafka.impressions_topic if which == "impressions" else self.kafka.clicks_topic
        tp = [TopicPartition(topic, p, offset)]
        if pause:
            self.consumer.pause(tp)
        else:
            self.consumer.resume(tp)
            if offset >= 0:
                self.consumer.seek(tp[0])  # from the next record not yet read
        part.paused[which] = pause

    def _close_chunk(self, p: int, part: _Partition) -> None:
        self._move_frontier(p, part)
        self._align(p, part)
        emitted, dead, counts = part.cursor.take()
        part.outputs += self._records(part, emitted)
        for click in dead:
            value = click_record(click.click.impression_id, click.click.ts, self.fields.impression_id, self.fields.time)
            letter = Rejected(p, -1, value, click.reason)
            part.outputs.append(self._letter(self.kafka.clicks_topic, letter))
        LATE.inc(counts.late_clicks)
        ORPHANS.inc(counts.orphan_clicks)
        DUPLICATE_CLICKS.inc(counts.duplicate_clicks)
        positives = sum(e.label for e in emitted)
        EMITTED.labels("1").inc(positives)
        EMITTED.labels("0").inc(len(emitted) - positives)
        progress = Progress(
            part.impressions_offset, part.clicks_offset, part.cursor.newest, part.state.progress.chunk + 1
        )
        # no emission needs the rows of a bundle this much older than the watermark
        part.state.commit(progress, part.outputs, part.cursor.watermark - payload_kept_ms(self.rules))

    def _records(self, part: _Partition, emitted: list[Emission]) -> list[PendingOutput]:
        """Labelled events as records of at most bundle_events events and the message limit."""
        limit = self.kafka.max_message_bytes - RECORD_OVERHEAD
        records = event_records(emitted, self.schema.label, part.state.bundle, self.join.bundle_events, limit)
        return [PendingOutput(self.kafka.events_topic, key, value) for key, value in records]

    def _letter(self, topic: str, rejected: Rejected) -> PendingOutput:
        source = f"{topic}:{rejected.partition}:{rejected.offset}" if rejected.offset >= 0 else topic
        letter = dead_letter(rejected.value, rejected.reason, source, self.kafka.max_message_bytes, "join")
        return PendingOutput(self.kafka.dlq_topic, b"", letter.value, tuple(letter.headers.items()))

    def _send(self) -> None:
        """The touched partitions' outputs and next offsets in one transaction (retried while the
        broker is away; a chunk already in RocksDB is never lost: a restart sends it)."""
        from confluent_kafka import KafkaException, TopicPartition

        touched = {p: part for p, part in self.parts.items() if part.touched}
        offsets = []
        for p, part in touched.items():
            offsets.append(TopicPartition(self.kafka.impressions_topic, p, part.impressions_offset))
            offsets.append(TopicPartition(self.kafka.clicks_topic, p, part.clicks_offset))
        offsets = [tp for tp in offsets if tp.offset >= 0]
        outputs = [o for part in touched.values() for o in part.outputs]
        backoff, failures = 0.5, 0
        while True:
            try:
                self.producer.begin_transaction()
                for o in outputs:
                    self._produce(o)
                if offsets:
                    self.producer.send_offsets_to_transaction(offsets, self.consumer.consumer_group_metadata(), 60)
                self.producer.commit_transaction(120)
                break
            except KafkaException as exc:
                error = exc.args[0]
                if error.txn_requires_abort():
                    self.producer.abort_transaction(60)
                elif not (error.retriable() or is_transient(exc)):
                    raise
                if failures == 0:
                    log.warning("join: transaction failed (%s); retrying until the broker takes it", error)
                failures += 1
                time.sleep(backoff)
                backoff = min(2 * backoff, 10.0)
        for part in touched.values():
            part.touched, part.outputs = False, []
        self._report()

    def _produce(self, o: PendingOutput) -> None:
        while True:
            try:
                self.producer.produce(o.topic, o.value, o.key or None, headers=list(o.headers) or None)
                return
            except BufferError:
                self.producer.poll(0.05)

    def _report(self) -> None:
        pending = size = 0
        watermarks = []
        for part in self.parts.values():
            count, nbytes = part.state.stats()
            pending, size = pending + count, size + nbytes
            if part.cursor.newest is not None:
                watermarks.append(part.cursor.watermark)
        PENDING.set(pending)
        STATE_BYTES.set(size)
        if watermarks:
            WATERMARK_LAG.set(time.time() - min(watermarks) / 1000)

    def close(self) -> None:
        self.consumer.close()
        for part in self.parts.values():
            part.state.close()


def _offset(committed: int | None) -> int:
    """A committed offset, -1 for none (Kafka answers -1001)."""
    return committed if committed is not None and committed >= 0 else -1


def _log_error(message: object) -> bool:
    log.warning("join: consumer: %s", message.error())  # type: ignore[attr-defined]
    return False


def collect_garbage_rarely() -> None:
    """The joiner's process makes several short-lived tuples per impression and holds a timer per
    pending entry: at Python's default thresholds its collector runs every 700 allocations and
    rescans what it holds; every 50,000 costs ~5% less time. (Its records hold no reference cycles.)"""
    import gc

    gc.set_threshold(50_000, 50, 100)


def run_joiner(kafka: KafkaSettings, settings: StreamSettings, worker: int = 0, workers: int = 1) -> None:
    """Run one joiner worker until SIGTERM/SIGINT; a write Kafka refuses for good ends the process
    with status 70 after what is committed (nothing is lost: a restart resends)."""
    from common.processes import stop_requested
    from stream.topics import ensure_topics

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    collect_garbage_rarely()
    ensure_topics(kafka)
    port = settings.join.metrics_port + worker if settings.join.metrics_port else 0
    serve_metrics(port, settings.metrics_host, "stream.join.metrics_port")
    stopping = stop_requested()
    joiner = Joiner(kafka, settings, worker, workers)
    try:
        joiner.start()
        while not stopping():
            joiner.step()
    except Exception:
        log.exception("join: worker %d stops: a write the broker refuses for good", worker)
        os._exit(EXIT_CANNOT_WRITE)
    joiner.close()


def run_joiners(kafka: KafkaSettings, settings: StreamSettings, workers: int) -> int:
    """`workers` joiner processes, partitions split between them (worker i: p % workers == i)."""
    from stream.children import run_children

    if workers == 1:  # each worker creates the topics it needs (run_joiner)
        run_joiner(kafka, settings)
        return 0
    return run_children(run_joiner, [(kafka, settings, i, workers) for i in range(workers)])
