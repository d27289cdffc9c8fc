"""BatchSource: reads Arrow batches from the batches topic and assembles training batches.

Stream batches are never split, so the offsets recorded with a training batch say exactly which
Kafka records it holds. Offsets are committed to Kafka only by `commit`, which the loop calls
after the snapshot holding them is durable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from stream.batch_codec import decode_batch
from stream.errors import StreamError
from stream.records import FeatureBatch
from stream.settings import KafkaSettings
from trainer.batch import Batch, batch_from_features
from trainer.errors import TrainerError

log = logging.getLogger("adstream.trainer")


class BatchSource:
    def __init__(self, kafka: KafkaSettings, group_id: str, schema_hash: str) -> None:
        from confluent_kafka import Consumer

        self.kafka = kafka
        self.schema_hash = schema_hash
        self.consumer = Consumer(
            {
                "bootstrap.servers": kafka.bootstrap,
                "group.id": group_id,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "fetch.max.bytes": max(kafka.max_message_bytes, 52428800),
                "max.partition.fetch.bytes": kafka.max_message_bytes,
            }
        )
        self.consumer.subscribe([kafka.batches_topic], on_assign=self._on_assign)
        self.position: dict[int, int] = {}  # partition -> next offset after what was handed out
        self.skipped = 0  # records that could not be decoded (logged, counted)

    def _on_assign(self, consumer: object, partitions: list) -> None:  # type: ignore[type-arg]
        log.info("trainer assigned %s", [(p.topic, p.partition) for p in partitions])

    def batches(self, batch_size: int, idle_s: float = 1.0) -> Iterator[Batch | None]:
        """Yield training batches of >= batch_size events (or fewer after idle_s without data);
        None when nothing arrived for idle_s (lets the loop check its stop conditions)."""
        parts: list[FeatureBatch] = []
        rows = 0
        last_data = time.monotonic()
        while True:
            messages = self.consumer.consume(256, timeout=0.2)
            for message in messages:
                if message.error():
                    raise TrainerError(f"kafka consumer on {self.kafka.batches_topic}: {message.error()}")
                self.position[message.partition() or 0] = (message.offset() or 0) + 1
                try:
                    part = decode_batch(message.value() or b"")
                except StreamError as exc:
                    self.skipped += 1
                    log.error("skipping batch at %s:%s: %s", message.partition(), message.offset(), exc)
                    continue
                if part.schema_hash != self.schema_hash:
                    self.skipped += 1
                    log.error("skipping batch with schema %s (expected %s)", part.schema_hash, self.schema_hash)
                    continue
                parts.append(part)
                rows += len(part)
                if rows >= batch_size:
                    yield batch_from_features(parts, self.position)
                    parts, rows = [], 0
            if messages:
                last_data = time.monotonic()
            elif time.monotonic() - last_data >= idle_s:
                if parts:
                    yield batch_from_features(parts, self.position)
                    parts, rows = [], 0
                else:
                    yield None
                last_data = time.monotonic()

    def commit(self, offsets: dict[int, int]) -> None:
        from confluent_kafka import TopicPartition

        if offsets:
            tps = [TopicPartition(self.kafka.batches_topic, p, o) for p, o in offsets.items()]
            self.consumer.commit(offsets=tps, asynchronous=False)

    def close(self) -> None:
        self.consumer.close()
