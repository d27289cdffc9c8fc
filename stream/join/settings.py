"""[stream.join]: the joiner's settings, the one place its knobs are declared (JoinRules is built from them)."""

from __future__ import annotations

from dataclasses import dataclass

from common.checks import at_least, check_fields
from stream.errors import StreamError
from stream.join.policy import JoinRules


@dataclass(frozen=True)
class JoinSettings:
    """[stream.join]: the joiner (`adstream join`), impressions + clicks -> labelled events (stream/join/joiner.py)."""

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
        return JoinRules(
            policy=self.policy,
            window_ms=round(self.window_s * 1000),
            allowed_lateness_ms=round(self.allowed_lateness_s * 1000),
            elapsed_ms=round(self.elapsed_s * 1000),
        )
