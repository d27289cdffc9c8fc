"""The Faust featurizer: a thin agent around featurize_isolating -> plan_outputs -> deliver.

adstream.events --take_events(n, within)--> featurize_isolating --> plan_outputs --> adstream.batches (Arrow IPC)
                                                                                \--> adstream.events.dlq (headers
                                                                                     reason, stage, source)
Records are read as raw bytes (one event or a newline-separated bundle); the agent never raises
on input, so one bad event cannot stop it. Every output is sized to fit the message limit before it
is sent (outputs.py), and a take is acknowledged only once all its outputs are on the broker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import faust
from prometheus_client import Counter

from stream.featurizer.faust_hot_path import QuietMonitor
from stream.featurizer.ingest import featurize_isolating
from stream.featurizer.outputs import plan_outputs
from stream.formats.dead_letter import BATCHES, DLQ, Output
from stream.kafka.prometheus import serve_metrics
from stream.kafka.retry import is_transient
from stream.kafka.settings import KafkaSettings
from stream.records import RawRecord, Rejected
from stream.schema import Schema, load_schema
from stream.settings import StreamSettings

log = logging.getLogger("adstream.stream")
FAUST_DIR = ".state/faust"
EVENTS = Counter("adstream_stream_events_total", "events featurized into batches")
REJECTED = Counter("adstream_stream_rejected_total", "events sent to the dead-letter topic")
BATCHES_WRITTEN = Counter("adstream_stream_batches_total", "Arrow batches written")
EXIT_CANNOT_WRITE = 70  # the worker's exit status when an output cannot be written (EX_SOFTWARE)


def build_app(kafka: KafkaSettings, settings: StreamSettings, batch_partitions: int | None = None) -> faust.App:
    """The featurizer's Faust app; `batch_partitions`: the batches topic's partition count (each
    source partition's events go to one of them, outputs.py), kafka.partitions when not given."""
    schema = load_schema(settings.schema)
    batch_partitions = batch_partitions or kafka.partitions
    Path(FAUST_DIR).mkdir(parents=True, exist_ok=True)  # Faust makes its own folder, not the parents
    app = faust.App(
        settings.app_id,
        # Faust's Kafka driver, its per-record race skipped (faust_hot_path.py); one URL per broker
        broker=";".join(f"adstream://{server.strip()}" for server in kafka.bootstrap.split(",")),
        topic_replication_factor=kafka.replication_factor,  # Faust's own topics, as ours
        store="memory://",
        datadir=f"{FAUST_DIR}/{{conf.id}}",  # Faust's own folder, out of the working tree
        web_enabled=False,
        topic_partitions=kafka.partitions,
        consumer_auto_offset_reset="earliest",
        producer_max_request_size=kafka.max_message_bytes,
        consumer_max_fetch_size=kafka.max_message_bytes,
        producer_compression_type=None,  # aiokafka compresses lz4 at level 9: 70% of the worker's CPU
        topic_allow_declare=True,  # Faust declares its own internal topics; ours exist already
        stream_buffer_maxsize=32768,  # Faust's default (4096) stalls the fetcher behind the agent
        broker_max_poll_records=4096,
        broker_commit_interval=settings.commit_interval_s,
        stream_wait_empty=False,
        monitor=QuietMonitor(),  # no per-event timings for web pages the worker does not serve
    )
    raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
    events_topic = app.topic(kafka.events_topic, **raw)  # type: ignore[arg-type]
    batches_topic = app.topic(kafka.batches_topic, **raw)  # type: ignore[arg-type]
    dlq_topic = app.topic(kafka.dlq_topic, **raw)  # type: ignore[arg-type]
    topics = {BATCHES: batches_topic, DLQ: dlq_topic}

    @app.agent(events_topic)
    async def featurize_agent(stream: faust.StreamT) -> None:
        seen_good = warned = False  # a record of this worker's was featurized; the all-rejected line was said
        async for events in stream.take_events(  # type: ignore[attr-defined]
            settings.take_records, within=settings.batch_within_s
        ):
            # Faust acknowledges the take when this body returns, and also when it raises: so it
            # never raises, and it returns only once every output is on the broker
            try:
                records = [RawRecord(e.message.partition, e.message.offset, e.value or b"") for e in events]
                batch, rejected = featurize_isolating(records, schema)  # a crash costs only its own record
                outputs = plan_outputs(
                    batch, rejected, settings.batch_events, kafka.max_message_bytes, batch_partitions
                )
                await deliver(outputs, topics)
            except Exception:  # a bug, or a write Kafka refuses for good: stop before anything is acknowledged
                give_up(f"featurizing the records at {_where(events)}")
            letters = sum(o.topic == DLQ for o in outputs)
            if letters == len(records) and not seen_good and not warned:  # nothing featurized yet, all rejected
                say_all_rejected(rejected, schema, kafka.dlq_topic)
                warned = True
            seen_good = seen_good or letters < len(records)
            REJECTED.inc(letters)
            EVENTS.inc(sum(o.events for o in outputs))
            BATCHES_WRITTEN.inc(len(outputs) - letters)

    return app


def say_all_rejected(rejected: list[Rejected], schema: Schema, dlq_topic: str) -> None:
    """One error line when a worker's takes are all rejected from its start: likely another schema."""
    if rejected:
        log.error(
            "every event so far was rejected under schema %s (%s), e.g. %r; if the events are of another "
            "schema, run with --set stream.schema=NAME (and train/serve alike); `adstream dlq` shows them in %s",
            schema.name,
            schema.hash,
            rejected[0].reason,
            dlq_topic,
        )


async def deliver(outputs: list[Output], topics: dict[str, faust.TopicT]) -> None:
    """Write every output and wait until the broker has each one. A transient error (the broker
    away, a delivery timed out) sends the failed ones again with backoff, for as long as it takes
    (logged once; duplicates are possible, losses are not); any other error is raised.

    The batches of a partition must land in the order given (outputs.py: the trainer drops what is
    not past the newest event it learned). The producer keeps that order for what it sends (one
    request in flight per partition, a retried one first); a send refused before it left (no
    metadata yet, a full buffer) holds back the rest of its partition to the next round."""
    pending, backoff, failures = outputs, 0.5, 0
    while pending:
        sent: list[Awaitable[Any] | Exception] = []
        held: set[tuple[str, int]] = set()  # partitions with an output refused before it left
        for output in pending:
            lane = (output.topic, output.partition)
            if output.partition is not None and lane in held:
                sent.append(HeldBack(f"behind a refused write to {output.topic} partition {output.partition}"))
                continue
            try:
                topic = topics[output.topic]
                sent.append(
                    await topic.send(
                        key=output.key, value=output.value, headers=output.headers, partition=output.partition
                    )
                )
            except Exception as exc:  # refused before sending (a full buffer, no metadata yet)
                sent.append(exc)
                if output.partition is not None:
                    held.add(lane)  # type: ignore[arg-type]
        errors = await asyncio.gather(*(_failure(s) for s in sent))  # all in flight at once, then awaited
        failed = [(o, e) for o, e in zip(pending, errors) if e is not None]
        for _, error in failed:
            if not isinstance(error, HeldBack) and not is_transient(error):
                raise error
        if failed and failures == 0:
            log.warning("kafka: %d record(s) not written yet (%s); retrying until they are", len(failed), failed[0][1])
        if failed:
            failures += 1
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, 10.0)
        elif failures:
            log.warning("kafka: written after %d retries", failures)
        pending = [o for o, _ in failed]


class HeldBack(Exception):
    """An output not sent this round: an earlier one of its partition was refused (order is kept)."""


async def _failure(sent: Awaitable[Any] | Exception) -> Exception | None:
    """The error of one send (None once the broker has the record)."""
    if isinstance(sent, Exception):
        return sent
    try:
        await sent
    except Exception as exc:
        return exc
    return None


def give_up(what: str) -> NoReturn:
    """Exit the worker at once, without acknowledging the take in hand: Faust would acknowledge it
    on any way out of the agent (a raise included), and its records would then be lost. A
    restarted worker reads them again."""
    log.critical("%s failed; exiting so that nothing unwritten is acknowledged", what, exc_info=True)
    logging.shutdown()
    os._exit(EXIT_CANNOT_WRITE)


def _where(events: list) -> str:
    if not events:
        return "nowhere"
    first, last = events[0].message, events[-1].message
    return f"{first.topic} {first.partition}:{first.offset}..{last.partition}:{last.offset}"


def run_worker(kafka: KafkaSettings, settings: StreamSettings, loglevel: str = "warning") -> None:
    """Run the Faust worker in the foreground until SIGINT/SIGTERM."""
    import mode.loop

    from stream.kafka.topics import ensure_topics, partition_count

    # uvloop runs asyncio's own machinery (futures, handles, the selector: a fifth of the worker's
    # time with one event per record) in C; it must be chosen before Faust makes its loop
    mode.loop.use("uvloop")
    ensure_topics(kafka)
    app = build_app(kafka, settings, partition_count(kafka, kafka.batches_topic))
    serve_metrics(settings.metrics_port, settings.metrics_host, "stream.metrics_port")
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    if not sys.stdout.isatty():  # its start-up spinner writes cursor codes into a log file
        worker.spinner = None
    worker.execute_from_commandline()


def run_workers(kafka: KafkaSettings, settings: StreamSettings, workers: int, loglevel: str = "warning") -> int:
    """Run `workers` Faust workers of the one app (one process each; Kafka splits the partitions
    between them, so more workers than partitions leaves some idle). Returns when one exits (the
    others are stopped) or on SIGINT/SIGTERM; the exit code is the first non-zero child's."""
    from stream.kafka.children import run_children
    from stream.kafka.topics import ensure_topics

    ensure_topics(kafka)
    if workers > kafka.partitions:
        log.warning(
            "%d workers for %d partitions: %d will be idle", workers, kafka.partitions, workers - kafka.partitions
        )
    args = []
    for i in range(workers):
        port = settings.metrics_port + i if settings.metrics_port else 0
        args.append((kafka, replace(settings, metrics_port=port, workers=1), loglevel))
    return run_children(run_worker, args)
