"""The joiner (`adstream join`): impressions + clicks on Kafka -> labelled events, exactly once.

    adstream.impressions --+
                           +--> read_impressions / read_clicks --> Cursor (stream/join/policy.py) --> adstream.events
    adstream.clicks -------+        (stream/join/inputs.py)          entries in RocksDB          (+ the DLQ)

A thin shell around the join's rules: it reads a chunk of records, moves each partition's Cursor
(whose entries live in that partition's RocksDB, stream/join/state.py), and writes what came out.

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

Partitions: impressions and clicks have as many partitions, and an impression id's state lives in
the partition its id hashes to (murmur2, Java's default partitioner: stream/kafka/partitioner.py). A
record that arrived elsewhere (a producer with another partitioner: librdkafka's default is CRC32)
is moved there, as Kafka Streams' repartition topics do, but onto the same topic: it goes out as a
record to its own partition inside the chunk's transaction, with the input offset that consumed it,
so it is moved exactly once; until its partition reads it back, that partition's watermark is held
at its time, so no window it belongs to closes meanwhile (when that partition is this worker's).
The watermark also waits for every clicks partition of the worker, not only its own: a click for
partition p may first arrive on q. Output records of partition p go to partition p of the events
topic (mod its count), so an impression's negative and its positive copy share a partition, in order.
Worker i of N takes the partitions p with p % N == i, and each partition has its own database, so
N can change between runs. With `stream.join.assignment = "group"` Kafka's consumer group assigns
them instead, to joiners on any machines, and moves them when one dies; the state follows through
a changelog topic (stream/join/group.py argues exactly once there).

A bounded log (a replayed file, a test) ends with the last `window_s + allowed_lateness_s` of event
time still open: nothing later moves the watermark past it. `adstream join --until-idle S` closes
every window once all inputs are read to their end and nothing came for S seconds, then exits
(`end_of_input`); not for a live log, whose next impression would find its window closed.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from stream.errors import StreamError
from stream.formats.clicks import click_record
from stream.formats.dead_letter import RECORD_OVERHEAD, dead_letter
from stream.join.group import Fenced, changelog_topic, committed_tokens, ensure_changelog, member_name, open_state
from stream.join.inputs import ClickFields, Read, read_record
from stream.join.outputs import event_records
from stream.join.partitions import NEVER, Inputs, Partition, assign_fetching, worker_partitions
from stream.join.policy import Click, Cursor, Emission, Impression, JoinRules, join_rules, payload_kept_ms
from stream.join.reroute import moved_value, split_by_home
from stream.join.state import PartitionState, PendingOutput, Progress
from stream.join.transactions import Transactions
from stream.kafka.client_log import quiet_logs
from stream.kafka.partitioner import murmur2_partitions
from stream.kafka.prometheus import serve_metrics
from stream.kafka.settings import KafkaSettings
from stream.records import Rejected
from stream.schema import Schema, load_schema
from stream.settings import StreamSettings

log = logging.getLogger("adstream.join")
IMPRESSIONS = Counter("adstream_join_impressions_total", "impressions read")
CLICKS = Counter("adstream_join_clicks_total", "clicks read")
EMITTED = Counter("adstream_join_emitted_total", "labelled events written", ["label"])
LATE = Counter("adstream_join_late_clicks_total", "clicks after their impression's window")
ORPHANS = Counter("adstream_join_orphan_clicks_total", "clicks no impression claimed (dead-lettered)")
FORGOTTEN = Counter(
    "adstream_join_forgotten_clicks_total",
    "clicks older than the join's memory: their impression, if any, was forgotten (dead-lettered)",
)
REROUTED = Counter(
    "adstream_join_rerouted_total",
    "impressions and clicks that arrived on another partition than their id's (murmur2) and were moved there",
    ["input"],
)
DUPLICATE_CLICKS = Counter("adstream_join_duplicate_clicks_total", "second clicks of a clicked impression")
REJECTED = Counter("adstream_join_rejected_total", "impressions and clicks sent to the dead-letter topic")
PENDING = Gauge(
    "adstream_join_pending", "entries held (pending impressions, closed ones kept for late clicks, early clicks)"
)
STATE_BYTES = Gauge("adstream_join_state_bytes", "bytes of join state on disk and in memtables")
WATERMARK_LAG = Gauge("adstream_join_watermark_lag_seconds", "wall-clock time minus the lowest partition watermark")
EXIT_CANNOT_WRITE = 70
REROUTED_FROM = "adstream-rerouted-from"  # header of a moved record: topic:partition:offset it came from
JOINED_BY = "adstream-joined-by"  # header of an events record: "<transactional id> partition <p> chunk <n>"


class Joiner:
    """One joiner worker: its partitions' states, a read-committed consumer, a transactional producer."""

    def __init__(self, kafka: KafkaSettings, settings: StreamSettings, worker: int = 0, workers: int = 1) -> None:
        from confluent_kafka import Consumer

        self.kafka, self.settings, self.join = kafka, settings, settings.join
        self.schema: Schema = load_schema(settings.schema)
        self.rules: JoinRules = join_rules(self.join)
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
                # a fetch the broker holds for want of data waits 50 ms, not 500: single JSON
                # impressions 32.1k -> 35.0k/s read as a backlog (some partition is always short)
                "fetch.wait.max.ms": 50,
                # "group": impressions p and clicks p to one joiner (range assigns equal numbers of
                # co-partitioned topics together); a joiner silent this long loses its partitions
                "partition.assignment.strategy": "range",
                "session.timeout.ms": round(self.join.session_timeout_s * 1000),
                **quiet_logs(),
            }
        )
        self.worker = worker
        self.in_group = self.join.assignment == "group"
        member = member_name(self.join, worker, workers) if self.in_group else str(worker)
        timeout = self.join.transaction_timeout_s
        self.transactions = Transactions(kafka, self.join.app_id, member, self.in_group, timeout)
        self.partitions, self.input_partitions, self.events_partitions = worker_partitions(
            self.consumer, kafka, worker, 1 if self.in_group else workers
        )
        self.parts: dict[int, Partition] = {}  # the partitions this worker holds now
        self.inputs = Inputs(self.consumer, kafka, self.rules, self.parts)
        self._warned_moves = self._warned_away = False

    def start(self) -> None:
        """Fence any earlier instance, finish what a crash left unsent, and assign the partitions
        (in a group: join it; partitions come and go in `_assigned` and `_revoked`)."""
        from confluent_kafka import TopicPartition

        self.transactions.start()  # aborts a predecessor's open transaction
        imp, clk = self.kafka.impressions_topic, self.kafka.clicks_topic
        if self.in_group:
            ensure_changelog(self.kafka, self.join, self.input_partitions)
            self._subscribe()
            return
        committed = {
            (tp.topic, tp.partition): tp.offset
            for tp in self.consumer.committed(
                [TopicPartition(t, p) for p in self.partitions for t in (imp, clk)], timeout=60
            )
        }
        assignment = []
        for p in self.partitions:
            part = self._hold(p, PartitionState(Path(self.join.state_dir) / f"{imp}-{p}"))
            progress = part.state.progress
            behind = (_offset(committed.get((imp, p))), _offset(committed.get((clk, p)))) != (
                progress.impressions_offset,
                progress.clicks_offset,
            )
            if progress.chunk and behind:  # the last chunk's transaction did not commit: send it again
                self._resend(part)
            assignment += self._positions(part)
        if any(part.touched for part in self.parts.values()):
            self._send()
        self.inputs.note_moved()  # holds a crash left unresolved: until the inputs' ends now
        self.consumer.assign(assignment)

    def _hold(self, p: int, state: PartitionState) -> Partition:
        """Take partition p with its state: its cursor's timers rebuilt from the stored entries."""
        progress = state.progress
        timers = [(entry.due, key) for key, entry in state.entries()]
        cursor = Cursor(self.rules, state.get, state.stage, timers, progress.newest_ts, state.preload)
        cursor.frontier = NEVER  # no click read yet: no window closes until they are
        part = Partition(p, state, cursor, progress.impressions_offset, progress.clicks_offset)
        part.holds = {which: (ts, until) for which, ts, until in progress.holds}
        self.parts[p] = part
        return part

    def _positions(self, part: Partition) -> list[Any]:
        """Where the partition's two inputs are read from: its next offsets (none yet: the start)."""
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        imp, clk = self.kafka.impressions_topic, self.kafka.clicks_topic
        return [
            TopicPartition(topic, part.number, offset if offset >= 0 else OFFSET_BEGINNING)
            for topic, offset in ((imp, part.impressions_offset), (clk, part.clicks_offset))
        ]

    def _resend(self, part: Partition) -> None:
        part.outputs = part.state.pending_outputs()
        part.touched = True
        log.warning(
            "join: partition %d: resending chunk %d's %d outputs",
            part.number,
            part.state.progress.chunk,
            len(part.outputs),
        )

    def _subscribe(self) -> None:
        self.consumer.subscribe(
            [self.kafka.impressions_topic, self.kafka.clicks_topic],
            on_assign=self._assigned,
            on_revoke=self._revoked,
            on_lost=self._revoked,
        )

    def _assigned(self, consumer: Any, assigned: list[Any]) -> None:
        """The group gave this worker these partitions (impressions p and clicks p together): each
        one's state as committed (kept, its last chunk sent again, or restored from the changelog),
        read on from its offsets."""

        imp, clk = self.kafka.impressions_topic, self.kafka.clicks_topic
        numbers = sorted({tp.partition for tp in assigned})
        pairs = {(tp.topic, tp.partition) for tp in assigned}
        if any((t, p) not in pairs for p in numbers for t in (imp, clk)):
            raise StreamError(
                f"join: the group assigned {sorted(pairs)}: impressions and clicks partition p must go together; "
                "every joiner of the group must be adstream's (partition.assignment.strategy range)"
            )
        tokens = committed_tokens(consumer, (imp, clk), numbers)
        assignment = []
        for p in numbers:
            path = Path(self.join.state_dir) / f"{imp}-{p}"
            state, resend = open_state(path, tokens[p], (changelog_topic(self.join), p), self.kafka)
            part = self._hold(p, state)
            if resend:
                self._resend(part)
            assignment += self._positions(part)
        log.warning("join: %s holds partitions %s", self.transactions.transactional_id, numbers)
        if any(part.touched for part in self.parts.values()):
            self._send()
        self.inputs.note_moved()
        assign_fetching(consumer, assignment)  # (a partition paused before it was revoked: fetched again)

    def _revoked(self, consumer: Any, revoked: list[Any]) -> None:
        """The group takes this worker's partitions (to give them out again): their states closed.
        (Called between chunks: every chunk read before is committed.)"""
        self._drop()

    def _drop(self) -> None:
        for part in self.parts.values():
            part.state.close()
        self.parts.clear()  # (in place: Inputs holds the same dict)

    def step(self, timeout_s: float | None = None) -> int:
        """Read one chunk (up to take_records, waiting up to chunk_wait_s), join it, commit it;
        returns the records read."""
        wait = self.join.chunk_wait_s if timeout_s is None else timeout_s
        try:
            messages = self.consumer.consume(self.join.take_records, wait)  # (a rebalance runs in here)
        except Fenced:  # a partition given to this worker could not be taken: it moved on meanwhile
            self._rejoin()
            return 0
        messages = [m for m in messages if m.error() is None or _log_error(m)]
        if self.in_group:  # (records fetched before a rebalance took their partition)
            messages = [m for m in messages if m.partition() in self.parts]
        for part in self.parts.values():
            part.touched = part.touched or any(part.paused.values())  # a paused input may resume: look again
        if not messages and not any(part.touched for part in self.parts.values()):
            return 0
        imp = self.kafka.impressions_topic
        messages.sort(key=lambda m: m.topic() == imp)  # a chunk's clicks first: fewer wait as early clicks
        reads = [read_record(m, imp, self.schema, self.fields) for m in messages]
        ids = [item.impression_id.encode() for read in reads for item in read.items]
        homes = murmur2_partitions(ids, self.input_partitions).tolist()  # each id's own partition
        clicked = False  # clicks read or records moved: the frontiers move before the next impressions
        run: list[Impression] = []  # consecutive impressions of one partition, joined together
        run_part: Partition | None = None
        at = 0
        for read in reads:
            part = self.parts[read.partition]
            part.touched = True
            items = read.items
            here = homes[at : at + len(items)]
            at += len(items)
            if any(home != read.partition for home in here):
                items = self._keep(read, here)
            if not read.impressions:
                CLICKS.inc(len(items))  # (a moved click counts where it belongs, once)
                for click in items:
                    part.cursor.click(click)  # type: ignore[arg-type]
                    part.newest_click = max(part.newest_click, click.ts)
                part.clicks_offset = read.offset + 1
                clicked = True
            else:
                if clicked:
                    self.inputs.move_frontiers()
                    clicked = False
                if run_part is not part or read.bundle is not None:
                    self._join_run(run_part, run)
                    run, run_part = [], part
                if read.bundle is not None and items:  # stored once; its impressions point at their rows
                    part.state.put_bundle(read.offset, max(i.ts for i in items), read.value, read.bundle)
                run += items  # type: ignore[arg-type]
                part.impressions_offset = read.offset + 1
            if read.bad:
                part.outputs += [self._letter(str(read.topic), r) for r in read.bad]
                REJECTED.inc(len(read.bad))
        self._join_run(run_part, run)
        self.inputs.move_frontiers(settled=True)
        for p, part in self.parts.items():
            if part.touched:
                self._close_chunk(p, part)
        try:
            self._send()
        except Fenced:  # the partitions moved on while this chunk was made: drop it and rejoin
            self._rejoin()
        return len(messages)

    def _rejoin(self) -> None:
        """After a refused commit: let every partition go (their databases are at most the dropped
        chunk ahead; whoever holds them next sees that) and join the group afresh."""
        self._drop()
        self.consumer.unsubscribe()
        self._subscribe()

    def _join_run(self, part: Partition | None, impressions: list[Impression]) -> None:
        """Consecutive impressions of one partition into its cursor, their entries read together."""
        if part is None or not impressions:
            return
        IMPRESSIONS.inc(len(impressions))
        if len(impressions) > 1:
            part.state.preload([i.impression_id for i in impressions])
        part.cursor.impressions(impressions)

    def _keep(self, read: Read, homes: list[int]) -> list[Impression | Click]:
        """The impressions or clicks of this partition; the others are moved to theirs (`_move`)."""
        kept, away = split_by_home(read.items, homes, read.partition)
        for q, moved in away.items():
            value = moved_value(moved, read.impressions, read.bundle, self.fields)
            self._move(read, q, moved[0].impression_id, value, moved)
        return kept

    def _move(self, read: Read, to: int, key: str, value: bytes, moved: list) -> None:
        """Send records that arrived on the wrong partition to `to`, in this chunk's transaction (so
        exactly once: with the offset that read them); hold `to`'s watermark until it reads them
        back, where `to` is this worker's."""
        topic = read.topic
        which = "impressions" if read.impressions else "clicks"
        source = f"{topic}:{read.partition}:{read.offset}".encode()
        output = PendingOutput(topic, key.encode(), value, ((REROUTED_FROM, source),), to)
        self.parts[read.partition].outputs.append(output)
        REROUTED.labels(which).inc(len(moved))
        if not self._warned_moves:
            self._warned_moves = True
            log.warning(
                "join: %s for partition %d arrived on partition %d of %s (its producer does not place keys by "
                "murmur2); moved there, exactly once. Produce with partitioner=murmur2_random (librdkafka) or "
                "Java's default partitioner to save the hop",
                which,
                to,
                read.partition,
                topic,
            )
        target = self.parts.get(to)
        if target is None and self.in_group and not self._warned_away:
            self._warned_away = True
            log.warning(
                "join: %s moved to partition %d, which another joiner of the group holds: its watermark does not "
                "wait for them, so if this joiner falls behind by more than stream.join.allowed_lateness_s of event "
                "time they arrive late there (dropped, counted as late). With joiners on several machines, produce "
                "by murmur2 (Java's default, librdkafka's murmur2_random)",
                which,
                to,
            )
        if target is not None:
            oldest = min(m.ts for m in moved)
            held = target.holds.get(which)
            target.holds[which] = (min(oldest, held[0]) if held else oldest, -1)  # its offset: once committed
            target.touched = True

    def at_end(self) -> bool:
        """Whether every input partition of this worker is read to its end (Inputs.at_end)."""
        return self.inputs.at_end()

    def end_of_input(self) -> None:
        """The end of a bounded log: close every window now (event time runs past every timer),
        emit what that emits, commit and send it, as any chunk. Not for a live log: an impression
        read afterwards finds its window closed."""
        for p, part in self.parts.items():
            part.cursor.fire(1 << 62)
            self._close_chunk(p, part, bundles_before=1 << 62)
            part.touched = True
        self._send()

    def _close_chunk(self, p: int, part: Partition, bundles_before: int | None = None) -> None:
        self.inputs.align(p, part)
        emitted, dead, counts = part.cursor.take()
        part.outputs += self._records(part, emitted)
        for click in dead:
            value = click_record(click.click.impression_id, click.click.ts, self.fields.impression_id, self.fields.time)
            letter = Rejected(p, -1, value, click.reason)
            part.outputs.append(self._letter(self.kafka.clicks_topic, letter))
        LATE.inc(counts.late_clicks)
        ORPHANS.inc(counts.orphan_clicks)
        FORGOTTEN.inc(counts.forgotten_clicks)
        DUPLICATE_CLICKS.inc(counts.duplicate_clicks)
        positives = sum(e.label for e in emitted)
        EMITTED.labels("1").inc(positives)
        EMITTED.labels("0").inc(len(emitted) - positives)
        holds = tuple((which, ts, until) for which, (ts, until) in part.holds.items())
        last = part.state.progress
        token = uuid.uuid4().hex
        progress = Progress(
            part.impressions_offset, part.clicks_offset, part.cursor.newest, last.chunk + 1, holds, token, last.token
        )
        # no emission needs the rows of a bundle this much older than the watermark
        if bundles_before is None:
            bundles_before = part.cursor.watermark - payload_kept_ms(self.rules)
        part.outputs = part.state.commit(progress, part.outputs, bundles_before)

    def _records(self, part: Partition, emitted: list[Emission]) -> list[PendingOutput]:
        """Labelled events as records of at most bundle_events events and the message limit, each
        saying which joiner's chunk wrote it (JOINED_BY: an event seen twice is traced to its writers)."""
        limit = self.kafka.max_message_bytes - RECORD_OVERHEAD
        records = event_records(emitted, self.schema.label, part.state.bundle, self.join.bundle_events, limit)
        to = part.number % self.events_partitions  # an impression's events share a partition, in order
        chunk = part.state.progress.chunk + 1  # (the chunk being closed)
        by = ((JOINED_BY, f"{self.transactions.transactional_id} partition {part.number} chunk {chunk}".encode()),)
        return [PendingOutput(self.kafka.events_topic, key, value, by, to) for key, value in records]

    def _letter(self, topic: str, rejected: Rejected) -> PendingOutput:
        source = f"{topic}:{rejected.partition}:{rejected.offset}" if rejected.offset >= 0 else topic
        letter = dead_letter(rejected.value, rejected.reason, source, self.kafka.max_message_bytes, "join")
        return PendingOutput(self.kafka.dlq_topic, b"", letter.value, tuple(letter.headers.items()))

    def _send(self) -> None:
        """The touched partitions' outputs and next offsets in one transaction (retried while the
        broker is away; a chunk already in RocksDB is never lost: a restart sends it)."""
        from confluent_kafka import TopicPartition

        touched = {p: part for p, part in self.parts.items() if part.touched}
        offsets = []
        for p, part in touched.items():
            if self.in_group:  # every touched partition's offsets, with its chunk's token (stream/join/group.py)
                token = part.state.progress.token
                offsets.append(TopicPartition(self.kafka.impressions_topic, p, max(part.impressions_offset, 0), token))
                offsets.append(TopicPartition(self.kafka.clicks_topic, p, max(part.clicks_offset, 0), token))
                continue
            offsets.append(TopicPartition(self.kafka.impressions_topic, p, part.impressions_offset))
            offsets.append(TopicPartition(self.kafka.clicks_topic, p, part.clicks_offset))
        outputs = [o for part in touched.values() for o in part.outputs]
        self.transactions.send(outputs, [tp for tp in offsets if tp.offset >= 0], self.consumer)
        for part in touched.values():
            part.touched, part.outputs = False, []
        self.inputs.note_moved()
        report_state(self.parts)

    def close(self) -> None:
        self.consumer.close()
        for part in self.parts.values():
            part.state.close()


def report_state(parts: dict[int, Partition]) -> None:
    """The join-state gauges: pending entries, state bytes, the watermark's lag behind the clock."""
    pending = size = 0
    watermarks = []
    for part in parts.values():
        count, nbytes = part.state.stats()
        pending, size = pending + count, size + nbytes
        if part.cursor.newest is not None:
            watermarks.append(part.cursor.watermark)
    PENDING.set(pending)
    STATE_BYTES.set(size)
    if watermarks:
        WATERMARK_LAG.set(time.time() - min(watermarks) / 1000)


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


def run_joiner(
    kafka: KafkaSettings, settings: StreamSettings, worker: int = 0, workers: int = 1, until_idle_s: float | None = None
) -> None:
    """Run one joiner worker until SIGTERM/SIGINT (or, with `until_idle_s`, until every input is read
    to its end and nothing came for that long: then every window is closed and it exits); a write
    Kafka refuses for good ends the process with status 70 after what is committed (nothing is
    lost: a restart resends)."""
    from common.processes import stop_requested
    from stream.kafka.topics import ensure_topics

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    collect_garbage_rarely()
    ensure_topics(kafka)
    port = settings.join.metrics_port + worker if settings.join.metrics_port else 0
    serve_metrics(port, settings.metrics_host, "stream.join.metrics_port")
    stopping = stop_requested()
    joiner = Joiner(kafka, settings, worker, workers)
    try:
        joiner.start()
        idle_since = time.monotonic()
        while not stopping():
            if joiner.step():
                idle_since = time.monotonic()
            elif until_idle_s is not None and time.monotonic() - idle_since >= until_idle_s:
                if joiner.at_end():
                    joiner.end_of_input()
                    log.warning(
                        "join: worker %d: every input read and idle %.0f s: all windows closed", worker, until_idle_s
                    )
                    break
                idle_since = time.monotonic()
    except Exception:
        log.exception("join: worker %d stops: a write the broker refuses for good", worker)
        os._exit(EXIT_CANNOT_WRITE)
    joiner.close()


def run_joiners(kafka: KafkaSettings, settings: StreamSettings, workers: int, until_idle_s: float | None = None) -> int:
    """`workers` joiner processes, partitions split between them (worker i: p % workers == i)."""
    from stream.kafka.children import run_children

    if workers == 1:  # each worker creates the topics it needs (run_joiner)
        run_joiner(kafka, settings, until_idle_s=until_idle_s)
        return 0
    args = [(kafka, settings, i, workers, until_idle_s) for i in range(workers)]
    return run_children(run_joiner, args, finite=until_idle_s is not None)
