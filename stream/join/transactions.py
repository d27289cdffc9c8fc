"""The joiner's Kafka side of a chunk: its outputs and its inputs' next offsets in one transaction.

One transactional id per worker (`<stream.join.app_id>-<worker>`): a restarted worker's producer
fences its predecessor and aborts the transaction it left open. A try that fails while the broker
is away is aborted and sent again until the broker takes it; a transactional call that never
returns (librdkafka #5456: after a broker outage a call can block past its own timeout) is left
behind to a new producer of the same id, which fences the stuck one and aborts its transaction.
The chunk is in RocksDB before any of this (stream/join/joiner.py), so no failure here loses it.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial
from typing import Any

from prometheus_client import Counter

from stream.join.group import GROUP_FENCING, PRODUCER_FENCING, Fenced
from stream.join.state import PendingOutput
from stream.kafka.client_log import broker_back, quiet_logs
from stream.kafka.retry import StuckCall, finish_within, is_transient, retrying
from stream.kafka.settings import KafkaSettings

log = logging.getLogger("adstream.join")
STUCK_MARGIN_S = 30.0  # a transactional call this far past its own timeout is stuck (librdkafka #5456)

STUCK = Counter(
    "adstream_join_stuck_producers_total",
    "transactional producers replaced after a call blocked past its timeout (after a broker outage)",
)


class Transactions:
    """A worker's transactional producer and the retry rules around its transactions."""

    def __init__(
        self, kafka: KafkaSettings, app_id: str, member: str, in_group: bool = False, timeout_s: float = 60.0
    ) -> None:
        """`member`: the worker's name (its index, or its name in a joiner group); `in_group`: the
        consumer's group assigns the partitions, so a refused commit means they moved (`Fenced`);
        `timeout_s`: how long the broker lets a transaction stay open."""
        self.kafka, self.transactional_id, self.in_group = kafka, f"{app_id}-{member}", in_group
        self.timeout_ms = round(timeout_s * 1000)
        self.producer = self._new_producer()

    def start(self) -> None:
        """init_transactions, retried while the broker is away (it fences an earlier producer of ours)."""
        retrying(partial(self.producer.init_transactions, 60), "init_transactions", log, give_up_s=math.inf)

    def send(self, outputs: list[PendingOutput], offsets: list[Any], consumer: Any) -> None:
        """`outputs` and the consumer group's next `offsets` (TopicPartitions) in one transaction,
        tried until the broker takes it; only a fatal error is raised."""
        from confluent_kafka import KafkaException

        backoff, failures = 0.5, 0
        while True:
            try:
                self.producer.begin_transaction()
                for o in outputs:
                    self._produce(o)
                if offsets:
                    group = consumer.consumer_group_metadata()
                    send = partial(self.producer.send_offsets_to_transaction, offsets, group, 30)
                    finish_within(send, 30 + STUCK_MARGIN_S, "send_offsets_to_transaction")
                finish_within(partial(self.producer.commit_transaction, 60), 60 + STUCK_MARGIN_S, "commit_transaction")
                broker_back()
                break
            except StuckCall as exc:
                # the old producer stays blocked; a new one with the same transactional id fences
                # it, and its open transaction (this chunk's) is aborted: the chunk is sent again
                log.warning("join: %s (librdkafka #5456); a new transactional producer sends the chunk again", exc)
                STUCK.inc()
                self._renew()
                continue
            except KafkaException as exc:
                error = exc.args[0]
                if self.in_group and error.name() in GROUP_FENCING | PRODUCER_FENCING:
                    # the group gave this worker's partitions away (or the broker timed its transaction
                    # out): the chunk is not ours to commit; abort it and hand the partitions over
                    log.warning(
                        "join: %s: %s; this chunk is dropped and the partitions rejoined", self.transactional_id, error
                    )
                    if error.name() in GROUP_FENCING:
                        self._leave_transaction()
                    else:
                        self._renew()
                    raise Fenced(f"join: {self.transactional_id}: {error.name()}") from None
                if error.fatal() or not (error.txn_requires_abort() or is_transient(exc)):
                    raise
                if failures == 0:
                    log.warning("join: transaction failed (%s); retrying until the broker takes it", error)
                failures += 1
                time.sleep(backoff)
                backoff = min(2 * backoff, 10.0)
                self._leave_transaction()

    def _leave_transaction(self) -> None:
        """After a failed try, the chunk's transaction is aborted before it is sent again (a retry
        must not begin a transaction inside the open one); a producer that cannot abort (the broker
        still away, or not in a transaction) is replaced, which aborts it too."""
        from confluent_kafka import KafkaException

        try:
            finish_within(partial(self.producer.abort_transaction, 30), 30 + STUCK_MARGIN_S, "abort_transaction")
        except (KafkaException, StuckCall) as exc:
            log.warning("join: abort failed (%s); a new transactional producer takes over", exc)
            self._renew()

    def _renew(self) -> None:
        """A new transactional producer of the same id: it fences the old and aborts its transaction."""
        self.producer = self._new_producer()
        self.start()

    def _new_producer(self) -> Any:
        """The transactional producer (one transactional id per worker: a new one fences the old)."""
        from confluent_kafka import Producer

        return Producer(
            {
                "bootstrap.servers": self.kafka.bootstrap,
                "transactional.id": self.transactional_id,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 20,
                "compression.type": "lz4",
                "message.max.bytes": self.kafka.max_message_bytes,
                "transaction.timeout.ms": self.timeout_ms,
                **quiet_logs(),
            }
        )

    def _produce(self, o: PendingOutput) -> None:
        while True:
            try:
                if o.partition >= 0:
                    self.producer.produce(o.topic, o.value, o.key or None, o.partition, headers=list(o.headers) or None)
                else:
                    self.producer.produce(o.topic, o.value, o.key or None, headers=list(o.headers) or None)
                return
            except BufferError:
                self.producer.poll(0.05)
