"""Settings of the local stack (Kafka and MLflow as local processes). Built by config.py."""

from __future__ import annotations

from dataclasses import dataclass

from adstream.errors import CliError
from common.checks import at_least, check_fields


@dataclass(frozen=True)
class StackSettings:
    state_dir: str = ".state/stack"  # data, logs and pid files of the local processes
    kafka_port: int = at_least(1, 19092)  # broker listener (clients connect here)
    controller_port: int = at_least(1, 19093)  # KRaft controller listener
    mlflow_port: int = at_least(1, 15000)  # MLflow tracking server
    kafka_heap: str = "768m"  # -Xmx of the broker JVM
    jar_cache: str = "~/.cache/adstream"  # where the Kafka jars are kept between clones
    start_timeout_s: float = at_least(1, 120.0)  # how long to wait for each service to come up

    def __post_init__(self) -> None:
        check_fields(self, "stack", CliError)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_port}"

    @property
    def tracking_uri(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"
