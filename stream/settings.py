"""[stream]: the featurizer's settings, with the joiner's ([stream.join]) nested. Built by
adstream/config.py from TOML or flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.checks import at_least, check_fields
from stream.errors import StreamError
from stream.join.settings import JoinSettings


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
