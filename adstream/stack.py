"""The local stack: a Kafka 4 KRaft broker and an MLflow server as background processes.

Everything lives under one state folder (data, logs, pid files). The Kafka jars come from Maven
Central through adstream/kafka/pom.xml into a cache outside the clone (~/.cache/adstream), so a
fresh clone on the same machine does not download them again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from adstream.errors import CliError
from adstream.processes import pid_alive, port_open, spawn, stop_pid_file, wait_until
from adstream.settings import StackSettings
from stream.kafka.settings import KafkaSettings

KAFKA_VERSION = "4.1.1"
POM = Path(__file__).parent / "kafka" / "pom.xml"
LOG4J = Path(__file__).parent / "kafka" / "log4j2.properties"


def _state(settings: StackSettings) -> Path:
    path = Path(settings.state_dir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def kafka_jars(settings: StackSettings) -> Path:
    """The jar folder for KAFKA_VERSION, fetched with Maven on first use."""
    folder = Path(settings.jar_cache).expanduser() / f"kafka-{KAFKA_VERSION}" / "libs"
    if (folder / f"kafka_2.13-{KAFKA_VERSION}.jar").is_file():
        return folder
    if shutil.which("mvn") is None:
        raise CliError("kafka jars: Maven (mvn) is not on PATH; install Maven or put the jars in " + str(folder))
    tmp = folder.with_name("libs.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"fetching Kafka {KAFKA_VERSION} jars from Maven Central into {folder} ...", file=sys.stderr)
    result = subprocess.run(
        [
            "mvn",
            "-q",
            "-B",
            "-f",
            str(POM),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={tmp}",
            "-DincludeScope=runtime",
        ],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise CliError(f"kafka jars: mvn failed ({result.returncode}):\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def _java() -> str:
    java = shutil.which("java") or (os.environ.get("JAVA_HOME", "") + "/bin/java")
    if not Path(java).is_file():
        raise CliError("kafka: no `java` on PATH (Java 17+ is needed); install a JDK or set JAVA_HOME")
    return java


def _server_properties(settings: StackSettings, kafka: KafkaSettings, data: Path) -> str:
    """The broker's properties; partitions and message size follow KafkaSettings, as the clients do."""
    return "\n".join(
        [
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.bootstrap.servers=127.0.0.1:{settings.controller_port}",
            f"listeners=PLAINTEXT://127.0.0.1:{settings.kafka_port},CONTROLLER://127.0.0.1:{settings.controller_port}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{settings.kafka_port}",
            "controller.listener.names=CONTROLLER",
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "inter.broker.listener.name=PLAINTEXT",
            f"log.dirs={data}",
            f"num.partitions={kafka.partitions}",
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=4",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
            "group.initial.rebalance.delay.ms=0",
            "auto.create.topics.enable=true",
            f"message.max.bytes={kafka.max_message_bytes}",
            "log.retention.hours=168",
            "",
        ]
    )


def start_kafka(settings: StackSettings, kafka: KafkaSettings) -> None:
    state = _state(settings)
    pid_file, log_file = state / "kafka.pid", state / "kafka.log"
    if pid_alive(pid_file):
        return
    if port_open(settings.kafka_port) or port_open(settings.controller_port):
        raise CliError(
            f"kafka: port {settings.kafka_port} or {settings.controller_port} is already in use by another process; "
            "stop it or choose other ports (--kafka-port / stack.kafka_port)"
        )
    java, jars = _java(), kafka_jars(settings)
    data = state / "kafka-data"
    config = state / "server.properties"
    config.write_text(_server_properties(settings, kafka, data))
    classpath = f"{jars}/*"
    log_opt = f"-Dlog4j2.configurationFile={LOG4J}"
    if not (data / "meta.properties").is_file():
        cluster_id = subprocess.run(
            [java, "-cp", classpath, log_opt, "kafka.tools.StorageTool", "random-uuid"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        result = subprocess.run(
            [
                java,
                "-cp",
                classpath,
                log_opt,
                "kafka.tools.StorageTool",
                "format",
                "--standalone",
                "-t",
                cluster_id,
                "-c",
                str(config),
            ],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise CliError(f"kafka: storage format failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    spawn(
        [
            java,
            f"-Xmx{settings.kafka_heap}",
            f"-Xms{settings.kafka_heap}",
            "-XX:+UseG1GC",
            "-cp",
            classpath,
            log_opt,
            "kafka.Kafka",
            str(config),
        ],
        log_file,
        pid_file,
    )
    wait_until(lambda: _kafka_ready(settings.bootstrap), "kafka", settings.start_timeout_s, pid_file, log_file)


def _kafka_ready(bootstrap: str) -> bool:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    if not port_open(int(bootstrap.rsplit(":", 1)[1])):
        return False
    try:
        AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=2)
        return True
    except KafkaException:
        return False


def start_mlflow(settings: StackSettings) -> None:
    state = _state(settings)
    pid_file, log_file = state / "mlflow.pid", state / "mlflow.log"
    if pid_alive(pid_file):
        return
    if port_open(settings.mlflow_port):
        raise CliError(
            f"mlflow: port {settings.mlflow_port} is already in use by another process; "
            "stop it or choose another port (--mlflow-port / stack.mlflow_port)"
        )
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    cmd = [
        str(mlflow_bin) if mlflow_bin.is_file() else "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{state / 'mlflow.db'}",
        "--artifacts-destination",
        str(state / "mlflow-artifacts"),
        "--serve-artifacts",
        "--host",
        "127.0.0.1",
        "--port",
        str(settings.mlflow_port),
        "--workers",
        "1",
    ]
    # without MLflow's job runner (huey consumers beside the server: 10 processes, 2.35 GB on this
    # machine); adstream uses no MLflow jobs
    spawn(cmd, log_file, pid_file, env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    wait_until(
        lambda: _http_ok(f"{settings.tracking_uri}/health"), "mlflow", settings.start_timeout_s, pid_file, log_file
    )


def _http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def up(settings: StackSettings, kafka: KafkaSettings) -> None:
    """Start the broker (topics sized by `kafka`) and MLflow, unless they run already."""
    start_kafka(settings, kafka)
    start_mlflow(settings)


@contextmanager
def running(settings: StackSettings, kafka: KafkaSettings) -> Iterator[None]:
    """The stack up for the length of a command that needs it (a benchmark); what it had to start
    is stopped after, so the machine is left as it was found (a broker left on the stack's ports
    would stop the next `adstream up` of another state folder, or a test, from taking them)."""
    was_up = {name: bool(service["up"]) for name, service in status(settings).items()}
    up(settings, kafka)
    try:
        yield
    finally:
        down(settings, [name for name, up in was_up.items() if not up])


def down(settings: StackSettings, services: Sequence[str] = ("mlflow", "kafka")) -> list[str]:
    """Stop the stack's `services` (MLflow, then Kafka); returns the ones that were running."""
    state = _state(settings)
    return [name for name in ("mlflow", "kafka") if name in services and stop_pid_file(state / f"{name}.pid")]


def status(settings: StackSettings) -> dict[str, dict[str, object]]:
    state = _state(settings)
    return {
        "kafka": {
            "pid": pid_alive(state / "kafka.pid"),
            "address": settings.bootstrap,
            "up": port_open(settings.kafka_port),
            "log": str(state / "kafka.log"),
        },
        "mlflow": {
            "pid": pid_alive(state / "mlflow.pid"),
            "address": settings.tracking_uri,
            "up": port_open(settings.mlflow_port),
            "log": str(state / "mlflow.log"),
        },
    }
