"""Settings of the Kafka side and of the featurizer. Built by adstream/config.py from TOML or flags."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from common.checks import at_least, check_fields
from stream.errors import StreamError

if TYPE_CHECKING:
    from stream.join import JoinRules


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

    def __post_init__(self) -> None:
        check_fields(self, "kafka", StreamError)
        if not self.bootstrap or ":" not in self.bootstrap:
            raise StreamError(f"config kafka.bootstrap={self.bootstrap!r}: write host:port, e.g. 127.0.0.1:19092")

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


@dataclass(frozen=True)
class JoinSettings:
    """[stream.join]: the joiner (`adstream join`), impressions + clicks -> labelled events (stream/joiner.py)."""

    policy: str = "window"  # "window" (final labels), "fake_negative" (at once, then positive copies) or "elapsed"
    window_s: float = at_least(
        0, 1800.0
    )  # attribution window, event time: a click this soon after its impression counts
    allowed_lateness_s: float = at_least(0, 60.0)  # how far event time may run out of order (and an early click waits)
    elapsed_s: float = at_least(0, 60.0)  # "elapsed": event time an impression waits for its click before it is emitted
    state_dir: str = ".state/join"  # RocksDB state, one database per input partition
    # Kafka records per chunk (one transaction, one state write; a backlog of single JSON impressions:
    # 23.9k/s at 2048, 30.0k/s at 8192 on 2 cores); under live load a chunk holds what chunk_wait_s brings
    take_records: int = at_least(1, 8192)
    chunk_wait_s: float = at_least(0.001, 0.1)  # longest a chunk waits to fill (the joiner's latency under low load)
    bundle_events: int = at_least(1, 1024)  # most labelled events per record written to the events topic
    app_id: str = "adstream-joiner"  # consumer group (committed offsets) and transactional id prefix
    metrics_port: int = at_least(0, 9200)  # Prometheus endpoint of the joiner (worker i: port + i); 0 = off
    click_impression_id: str = "impression_id"  # field of a click naming its impression (the impression's event id)
    click_time: str = "ts"  # field of a click holding its time, ms since the epoch

    def __post_init__(self) -> None:
        check_fields(self, "stream.join", StreamError)
        self.rules()  # checks the policy and the windows, naming these keys

    def rules(self) -> JoinRules:
        from stream.join import JoinRules

        return JoinRules(
            policy=self.policy,
            window_ms=round(self.window_s * 1000),
            allowed_lateness_ms=round(self.allowed_lateness_s * 1000),
            elapsed_ms=round(self.elapsed_s * 1000),
        )


@dataclass(frozen=True)
class StreamSettings:
    schema: str = "criteo"  # bundled schema name or path to a schema TOML file
    batch_events: int = at_least(1, 1024)  # most events per Arrow batch (~400 KB for Criteo: under Kafka's 1 MB)
    take_records: int = at_least(1, 1024)  # Kafka records per agent iteration (lower it when records are large bundles)
    batch_within_s: float = at_least(0, 1.0)  # flush a partial batch after this many seconds
    app_id: str = "adstream-featurizer"  # Faust app id = Kafka consumer group
    metrics_port: int = at_least(0, 9300)  # Prometheus endpoint of the worker (worker i: port + i); 0 = off
    metrics_host: str = "127.0.0.1"  # interface it binds; "0.0.0.0" in a container, for the stack's network only
    workers: int = at_least(1, 1)  # Faust worker processes of the one app (they share the partitions)
    join: JoinSettings = field(default_factory=JoinSettings)  # the impression/click joiner ([stream.join])

    def __post_init__(self) -> None:
        check_fields(self, "stream", StreamError)
