"""[stream]: the featurizer's settings, with the joiner's ([stream.join]) nested. Built by
adstream/config.py from TOML or flags; the join's rules are built from [stream.join] by
stream/join/policy.py's `join_rules`."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.checks import at_least, check_fields, one_of
from stream.errors import StreamError

JOIN_POLICIES = ("window", "fake_negative", "elapsed")  # stream.join.policy: stream/join/policy.py's POLICIES


@dataclass(frozen=True)
class JoinSettings:
    """[stream.join]: the joiner (`adstream join`), impressions + clicks -> labelled events (stream/join/joiner.py)."""

    # "window" (final labels), "fake_negative" (at once, then positive copies) or "elapsed": the
    # policies themselves are stream/join/policy.py's JoinPolicy objects
    policy: str = one_of(JOIN_POLICIES, "window")
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
    # who decides which joiner reads which partitions: "static" (worker i of N takes p % N == i, its
    # state on this machine's disk: one machine) or "group" (Kafka's consumer group assigns them and
    # moves them when a joiner dies; the state follows through a changelog topic: joiners on
    # several machines, stream/join/group.py)
    assignment: str = one_of(("static", "group"), "static")
    # "group": this joiner's name, unique in the group and the same after a restart (its transactional
    # id, so a restarted joiner fences its predecessor); "" = the host's name
    member: str = ""
    session_timeout_s: float = at_least(6, 10.0)  # "group": a joiner silent this long loses its partitions
    # a transaction left open this long (its joiner died) is aborted by the broker; until then readers
    # of the events, and a "group" joiner restoring that partition's state, wait for it
    transaction_timeout_s: float = at_least(1, 60.0)
    metrics_port: int = at_least(0, 9200)  # Prometheus endpoint of the joiner (worker i: port + i); 0 = off
    click_impression_id: str = "impression_id"  # field of a click naming its impression (the impression's event id)
    click_time: str = "ts"  # field of a click holding its time, ms since the epoch

    def __post_init__(self) -> None:
        check_fields(self, "stream.join", StreamError)
        if self.policy == "elapsed" and self.elapsed_s > self.window_s:
            raise StreamError(
                f"config stream.join.elapsed_s={float(self.elapsed_s)} is longer than "
                f"window_s={float(self.window_s)}: an impression would be emitted after its window closed; "
                "lower elapsed_s"
            )


@dataclass(frozen=True)
class StreamSettings:
    schema: str = "criteo"  # bundled schema name or path to a schema TOML file
    batch_events: int = at_least(1, 1024)  # most events per Arrow batch (~400 KB for Criteo: under Kafka's 1 MB)
    take_records: int = at_least(1, 1024)  # Kafka records per agent iteration (lower it when records are large bundles)
    batch_within_s: float = at_least(0, 1.0)  # flush a partial batch after this many seconds
    # how often a worker commits the offsets of what it has written (Faust's broker_commit_interval):
    # a killed worker's successor featurizes again at most this much (the trainer drops the copies)
    commit_interval_s: float = at_least(0.1, 2.8)
    app_id: str = "adstream-featurizer"  # Faust app id = Kafka consumer group
    metrics_port: int = at_least(0, 9300)  # Prometheus endpoint of the worker (worker i: port + i); 0 = off
    metrics_host: str = "127.0.0.1"  # interface it binds; "0.0.0.0" in a container, for the stack's network only
    workers: int = at_least(1, 1)  # Faust worker processes of the one app (they share the partitions)
    join: JoinSettings = field(default_factory=JoinSettings)  # the impression/click joiner ([stream.join])

    def __post_init__(self) -> None:
        check_fields(self, "stream", StreamError)
