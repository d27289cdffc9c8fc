"""Serving settings. Built by adstream/config.py from TOML or flags; unknown keys are errors there."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.checks import at_least, check_fields, one_of
from serving.errors import ServingError


@dataclass(frozen=True)
class JudgeSettings:
    """[serving.judge]: `adstream judge`, the served model scored on live traffic (serving/judge.py)."""

    app_id: str = "adstream-judge"  # consumer group prefix (each start reads the events topic from its start)
    metrics_port: int = at_least(0, 9500)  # Prometheus endpoint of the live figures; 0 = off
    metrics_host: str = "127.0.0.1"  # interface it binds; "0.0.0.0" in a container
    report_s: float = at_least(0.1, 10.0)  # how often the gauges, MLflow and the report file are updated
    most_impressions: int = at_least(1, 5_000_000)  # impressions kept (~100 B each); past it the oldest versions go
    report_file: str = ".state/judge.json"  # the newest report, for `adstream status` and `adstream simulate`

    def __post_init__(self) -> None:
        check_fields(self, "serving.judge", ServingError)


@dataclass(frozen=True)
class ServingSettings:
    host: str = "127.0.0.1"  # interface to bind
    port: int = at_least(1, 18000)  # HTTP port
    # registry alias to serve; "" = mlflow.alias, the one the trainer moves (adstream/config.py fills it
    # in); "latest" means the highest version number
    alias: str = ""
    poll_s: float = at_least(0.01, 1.0)  # how often to look for a newer version or delta (2 registry calls)
    cache_dir: str = ".state/serving"  # where downloaded snapshots are kept
    store: str = one_of(("ram", "rocksdb"), "ram")  # served rows: "ram" (sorted arrays) or "rocksdb" (tables > RAM)
    disk_bytes: int = at_least(1, 64 << 30)  # budget of a served version's RocksDB (store = "rocksdb"), bytes
    max_events: int = at_least(1, 10_000)  # most events accepted in one request
    max_body_bytes: int = at_least(1 << 10, 8 << 20)  # largest request body accepted (413 above it)
    # processes answering on one port (serving/workers.py): each follows the registry and maps the
    # same table from the download cache (one copy in RAM); about one per core the server may use
    workers: int = at_least(1, 1)
    threads: int = at_least(1, 1)  # torch threads per request (1 keeps latency steady under concurrency)
    # the closed loop (serving/impressions.py): every scored event becomes an impression on
    # kafka.impressions_topic (the joiner's input), POST /click writes clicks to kafka.clicks_topic;
    # off: /predict only scores (and /shown, /click answer 409)
    log_impressions: bool = True
    log_queue: int = at_least(
        1, 100_000
    )  # most records waiting for Kafka (an outage at 500 req/s: 200 s); past it dropped, counted
    log_flush_s: float = at_least(0, 10.0)  # how long SIGTERM waits for the records still waiting for Kafka
    shown_wait_s: float = at_least(0.001, 60.0)  # how long a candidate scored "shown": false waits for POST /shown
    max_pending: int = at_least(1, 100_000)  # most such candidates held at once (~1 KB each; the oldest go first)
    judge: JudgeSettings = field(default_factory=JudgeSettings)  # [serving.judge]
    # if set, /predict and /model need "Authorization: Bearer <token>" (/healthz and /metrics stay
    # open; /docs and /openapi.json are off); or set ADSTREAM_SERVING_TOKEN. Never logged, never in a repr.
    token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        check_fields(self, "serving", ServingError)
        if type(self.log_impressions) is not bool:
            raise ServingError(f"config serving.log_impressions={self.log_impressions!r}: write true or false")
