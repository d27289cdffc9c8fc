"""What serving sends to Kafka (impressions it scored, clicks posted to it), never in a request's way.

    /predict, /shown, /click --send(topic, key, value)--> librdkafka's queue (bounded) --> Kafka

`send` only puts the record in the producer's queue (a few microseconds) and returns; a background
thread serves the delivery reports. The producer is idempotent (a retried send is written once) and
waits for the broker without a deadline (`message.timeout.ms` 0), so a broker outage holds records
in the queue and delivers them, once, when it comes back. The queue is bounded by
`serving.log_queue` records: past it a record is dropped and counted, never silently
(`adstream_serving_log_dropped_total`, `/model`, `adstream status`). Keys are placed by murmur2
(`partitioner=murmur2_random`), the rule the joiner reads impressions and clicks by
(stream/kafka/partitioner.py). `close` (SIGTERM) flushes for `serving.log_flush_s`; what is still queued
then is counted as dropped. A SIGKILL loses what is queued: at most the records of the last
`linger.ms` (5 ms) while the broker is up.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import Counter

log = logging.getLogger("adstream.serving")
LINGER_MS = 5  # how long a record waits for others to share its request to the broker
DELIVERED = Counter("adstream_serving_logged_total", "records serving wrote to Kafka (delivered)", ["topic"])
DROPPED = Counter(
    "adstream_serving_log_dropped_total",
    "records serving could not write to Kafka: queue_full (past serving.log_queue), failed (refused "
    "by the broker), shutdown (still queued after serving.log_flush_s)",
    ["reason"],
)


class KafkaOutbox:
    """An idempotent, bounded, asynchronous producer for serving's records."""

    def __init__(self, bootstrap: str, queue_records: int, max_message_bytes: int) -> None:
        from confluent_kafka import Producer

        self.counts = {"sent": 0, "delivered": 0, "queue_full": 0, "failed": 0, "shutdown": 0}
        self._lock = threading.Lock()
        self._producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "enable.idempotence": True,  # acks=all, retries without duplicates or reordering
                "message.timeout.ms": 0,  # no deadline: an outage holds records until the broker is back
                "linger.ms": LINGER_MS,
                "partitioner": "murmur2_random",  # the Java client's placement: the joiner's rule
                "queue.buffering.max.messages": queue_records,
                "queue.buffering.max.kbytes": 1 << 21,  # 2 GiB: the record count is the bound
                "message.max.bytes": max_message_bytes,
                "logger": log,
            }
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_reports, name="outbox", daemon=True)
        self._thread.start()

    def send(self, topic: str, key: str, value: bytes) -> bool:
        """Queue one record; False (counted) when the queue is full or the record refused."""
        from confluent_kafka import KafkaException

        try:
            self._producer.produce(topic, value, key.encode(), on_delivery=self._delivered)
        except BufferError:
            self._count("queue_full")
            DROPPED.labels("queue_full").inc()
            return False
        except KafkaException as exc:  # over the message limit, an unknown topic name...
            log.error("outbox: %s record %s refused: %s", topic, key, exc)
            self._count("failed")
            DROPPED.labels("failed").inc()
            return False
        self._count("sent")
        return True

    def stats(self) -> dict[str, int]:
        """Records sent, delivered, dropped (by reason and in all) and waiting in the queue now."""
        with self._lock:
            dropped = self.counts["queue_full"] + self.counts["failed"] + self.counts["shutdown"]
            return {**self.counts, "dropped": dropped, "waiting": len(self._producer)}

    def close(self, timeout_s: float) -> int:
        """Deliver what is queued (at most timeout_s); returns the records dropped at shutdown."""
        left = self._producer.flush(timeout_s)
        self._stop.set()
        self._thread.join()
        if left:
            self._count("shutdown", left)
            DROPPED.labels("shutdown").inc(left)
            log.error("outbox: %d records still waiting for Kafka after %.1f s: dropped", left, timeout_s)
        return left

    def _serve_reports(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(0.05)

    def _delivered(self, err: Any, msg: Any) -> None:
        if err is None:
            self._count("delivered")
            DELIVERED.labels(msg.topic()).inc()
        else:
            log.error("outbox: %s record %s not delivered: %s", msg.topic(), msg.key(), err)
            self._count("failed")
            DROPPED.labels("failed").inc()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n
