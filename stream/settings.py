"""Settings of the Kafka side and of the featurizer. Built by adstream/config.py from TOML or flags."""

from __future__ import annotations

from dataclasses import dataclass, replace

from adstream.checks import at_least, check_fields
from stream.errors import StreamError


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap: str = "127.0.0.1:19092"  # host:port of a broker
    events_topic: str = "adstream.events"  # raw JSON events (or bundles), key = event id
    batches_topic: str = "adstream.batches"  # Arrow IPC feature batches
    dlq_topic: str = "adstream.events.dlq"  # rejected lines, header "reason"
    partitions: int = at_least(1, 2)  # partitions of each topic when adstream creates it
    max_message_bytes: int = at_least(1 << 10, 4 << 20)  # topic max.message.bytes, producer and consumer limits

    def __post_init__(self) -> None:
        check_fields(self, "kafka", StreamError)
        if not self.bootstrap or ":" not in self.bootstrap:
            raise StreamError(f"config kafka.bootstrap={self.bootstrap!r}: write host:port, e.g. 127.0.0.1:19092")

    def scoped(self, prefix: str) -> KafkaSettings:
        """The same settings with topics of their own (`<prefix>.events`, ...), for tests and benchmarks."""
        return replace(
            self, events_topic=f"{prefix}.events", batches_topic=f"{prefix}.batches", dlq_topic=f"{prefix}.dlq"
        )


@dataclass(frozen=True)
class StreamSettings:
    schema: str = "criteo"  # bundled schema name or path to a schema TOML file
    batch_events: int = at_least(1, 1024)  # most events per Arrow batch (~400 KB for Criteo: under Kafka's 1 MB)
    take_records: int = at_least(1, 1024)  # Kafka records per agent iteration (lower it when records are large bundles)
    batch_within_s: float = at_least(0, 1.0)  # flush a partial batch after this many seconds
    app_id: str = "adstream-featurizer"  # Faust app id = Kafka consumer group
    metrics_port: int = at_least(0, 0)  # Prometheus endpoint of the worker (worker i: port + i); 0 = off
    metrics_host: str = "127.0.0.1"  # interface it binds; "0.0.0.0" in a container, for the stack's network only
    workers: int = at_least(1, 1)  # Faust worker processes of the one app (they share the partitions)

    def __post_init__(self) -> None:
        check_fields(self, "stream", StreamError)
