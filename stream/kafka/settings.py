"""[kafka]: the broker and adstream's topics. Built by adstream/config.py from TOML or flags."""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.checks import at_least, check_fields
from stream.errors import StreamError


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap: str = "127.0.0.1:19092"  # host:port of a broker
    events_topic: str = "adstream.events"  # raw JSON events (or bundles), key = event id
    impressions_topic: str = (
        "adstream.impressions"  # unlabelled events (or bundles), key = impression id: the joiner's input
    )
    clicks_topic: str = "adstream.clicks"  # clicks, key = impression id, as many partitions as impressions
    batches_topic: str = "adstream.batches"  # Arrow IPC feature batches
    dlq_topic: str = "adstream.events.dlq"  # rejected lines, header "reason"
    partitions: int = at_least(1, 2)  # partitions of each topic when adstream creates it
    max_message_bytes: int = at_least(1 << 10, 4 << 20)  # topic max.message.bytes, producer and consumer limits
    replication_factor: int = at_least(1, 1)  # copies of each partition of the topics adstream creates (3 on a cluster)
    min_insync_replicas: int = at_least(1, 1)  # copies a write waits for (acks=all): 2 of 3 rides out one broker

    def __post_init__(self) -> None:
        check_fields(self, "kafka", StreamError)
        if not self.bootstrap or ":" not in self.bootstrap:
            raise StreamError(f"config kafka.bootstrap={self.bootstrap!r}: write host:port, e.g. 127.0.0.1:19092")
        if self.min_insync_replicas > self.replication_factor:
            raise StreamError(
                f"config kafka.min_insync_replicas={self.min_insync_replicas} > replication_factor="
                f"{self.replication_factor}: no write could succeed; lower it (2 of 3 on a cluster)"
            )

    def scoped(self, prefix: str) -> KafkaSettings:
        """The same settings with topics of their own (`<prefix>.events`, ...), for tests and benchmarks."""
        return replace(
            self,
            events_topic=f"{prefix}.events",
            batches_topic=f"{prefix}.batches",
            dlq_topic=f"{prefix}.dlq",
            impressions_topic=f"{prefix}.impressions",
            clicks_topic=f"{prefix}.clicks",
        )
