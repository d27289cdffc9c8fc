"""The import rules of the design and the docker-compose file's agreement with the settings."""

import ast
from pathlib import Path

import pytest
import yaml

from adstream.cli import build_parser
from adstream.config import load_config
from adstream.stack import KAFKA_VERSION
from stream.kafka.settings import KafkaSettings

ROOT = Path(__file__).resolve().parent.parent
PROJECT = {"common", "stream", "store", "trainer", "serving", "adstream", "bench"}
FORBIDDEN = {  # the core packages never import the benchmarks
    "common": PROJECT - {"common"},  # the ground floor: every package may import it, it imports none of them
    "stream": {"torch", "store", "trainer", "serving", "adstream", "bench"},
    "store": {"stream", "trainer", "serving", "adstream", "bench"},
    "trainer": {"serving", "adstream", "bench"},
    "serving": {"adstream", "bench"},
    "bench": {"adstream"},  # the benchmarks measure the packages (serving too), not the CLI that wires them
}


def imported_modules(package: str) -> dict[str, set[str]]:
    """Every absolute import of the package: module name -> files importing it."""
    found: dict[str, set[str]] = {}
    for file in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name, set()).add(str(file.relative_to(ROOT)))
    return found


def imported_roots(package: str) -> dict[str, set[str]]:
    roots: dict[str, set[str]] = {}
    for name, files in imported_modules(package).items():
        if name.split(".")[0] != package:
            roots.setdefault(name.split(".")[0], set()).update(files)
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_go_one_way(package):
    roots = imported_roots(package)
    bad = {name: sorted(files) for name, files in roots.items() if name in FORBIDDEN[package]}
    assert not bad, f"{package} must not import {sorted(bad)}: {bad}"


GROUND = {"stream", "stream.errors", "stream.schema", "stream.records", "stream.rules", "stream.settings"}
WINGS = {  # stream's wings, in the data flow's order: what each may import of stream besides the ground
    "formats": set(),  # record formats: below the producers, the joiner and the featurizer
    "kafka": set(),  # plumbing every Kafka process shares (stream's and the trainer's)
    "produce": {"formats", "kafka"},
    "join": {"formats", "kafka"},  # the joiner comes before the featurizer and never imports it
    "featurizer": {"formats", "kafka"},
}
# what the other packages may take from stream: the ground, the formats and the plumbing, and the
# featurizer's pure functions (serving featurizes at serve time; the trainer knows the shared rows)
OUTSIDE = {
    "trainer": {"stream.featurizer.featurize"},
    "serving": {"stream.featurizer.featurize", "stream.featurizer.decode"},
}


def _stream_imports(files: list[Path]) -> set[str]:
    names = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("stream"):
                names.add(node.module or "")
    return names


def _allowed(name: str, wings: set[str], modules: frozenset[str] | set[str] = frozenset()) -> bool:
    if name in GROUND or name in modules:
        return True
    return any(name == f"stream.{w}" or name.startswith(f"stream.{w}.") for w in wings)


@pytest.mark.parametrize("wing", sorted(WINGS))
def test_each_stream_wing_imports_only_the_ground_and_the_wings_before_it(wing):
    imported = _stream_imports(sorted((ROOT / "stream" / wing).glob("*.py")))
    # replay checks a raw log's rows with the featurizer's own column check: one rule set, one reason per bad value
    extra = {"stream.featurizer.bundle"} if wing == "produce" else set()
    bad = sorted(n for n in imported if not _allowed(n, WINGS[wing] | {wing}, extra))
    assert not bad, f"stream/{wing} must not import {bad}"


def test_the_ground_of_stream_imports_no_wing_but_the_joiners_settings():
    imported = _stream_imports(sorted((ROOT / "stream").glob("*.py")))
    assert sorted(n for n in imported if not _allowed(n, set(), {"stream.join.settings"})) == []


@pytest.mark.parametrize("package", sorted(OUTSIDE))
def test_trainer_and_serving_take_only_the_ground_formats_and_plumbing_of_stream(package):
    imported = _stream_imports(sorted((ROOT / package).rglob("*.py")))
    bad = sorted(n for n in imported if not _allowed(n, {"formats", "kafka"}, OUTSIDE[package]))
    assert not bad, f"{package} must not import {bad}"


def test_every_integration_test_file_is_marked():
    """`pytest -m "not integration"` runs without Kafka and MLflow only if every such file says so."""
    unmarked = [
        f.name
        for f in sorted((ROOT / "tests" / "integration").glob("test_*.py"))
        if "pytestmark = pytest.mark.integration" not in f.read_text()
    ]
    assert not unmarked, unmarked


def test_the_rule_checker_sees_imports():
    assert "torch" in imported_roots("trainer") and "stream" in imported_roots("trainer")
    assert "common.errors" in imported_modules("store")  # seen, and allowed


def test_every_error_derives_from_the_project_root():
    from adstream.errors import CliError
    from common.errors import AdstreamError
    from serving.errors import ServingError
    from store.errors import StoreError
    from stream.errors import StreamError
    from trainer.errors import TrainerError

    for base in (StreamError, StoreError, TrainerError, ServingError, CliError):
        assert issubclass(base, AdstreamError), base


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_services_run_real_cli_commands():
    services = compose()["services"]
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    adstream_services = [
        s
        for s in services.values()
        if s.get("image") == "adstream:local" and "command" in s and s.get("entrypoint") is None
    ]
    assert {s["command"][0] for s in adstream_services} == {
        "join",
        "stream",
        "train",
        "serve",
        "judge",
        "replay",
        "simulate",
    }
    for service in adstream_services:
        assert service["command"][0] in commands
        build_parser().parse_args(service["command"])  # the flags exist too
    assert services["replay"]["profiles"] == ["replay"]
    for name in ("kafka", "mlflow", "serving", "stream", "trainer"):
        assert "healthcheck" in services[name], name


def test_compose_matches_the_settings():
    services = compose()["services"]
    # the official image by default; `make images` builds one of the same version where none can be pulled
    assert (
        services["kafka"]["image"] == services["topics"]["image"] == f"${{KAFKA_IMAGE:-apache/kafka:{KAFKA_VERSION}}}"
    )
    assert "adstream/stack.py" in (ROOT / "docker" / "images.sh").read_text()  # the image's tag: KAFKA_VERSION
    assert f"<version>{KAFKA_VERSION}</version>" in (ROOT / "docker" / "kafka" / "pom.xml").read_text()
    creator = services["topics"]["command"][0]
    defaults = KafkaSettings()
    for topic in (defaults.events_topic, defaults.batches_topic, defaults.dlq_topic):
        assert topic in creator
    assert f"max.message.bytes={defaults.max_message_bytes}" in creator
    config = load_config(str(ROOT / "docker" / "adstream.toml"))
    assert config.kafka.bootstrap == "kafka:9092" and "9092" in services["kafka"]["environment"]["KAFKA_LISTENERS"]
    assert f"--partitions {config.kafka.partitions}" in creator
    mlflow_port = config.mlflow.tracking_uri.rsplit(":", 1)[1]
    assert mlflow_port in services["mlflow"]["command"]
    assert services["trainer"]["expose"] == [str(config.trainer.metrics_port)]
    assert services["stream"]["expose"] == [str(config.stream.metrics_port)]
    assert config.trainer.metrics_host == config.stream.metrics_host == "0.0.0.0"  # inside the stack's network
    # state on volumes: a recreated container keeps Kafka's log, MLflow's store, the trainer's snapshots
    assert services["trainer"]["volumes"] == [f"snapshots:{config.trainer.snapshot.dir}"]
    assert services["kafka"]["volumes"] == [f"kafka:{services['kafka']['environment']['KAFKA_LOG_DIRS']}"]
    assert services["mlflow"]["volumes"] == ["mlflow:/mlflow"] and "sqlite:////mlflow/" in str(
        services["mlflow"]["command"]
    )


def test_compose_publishes_serving_and_mlflows_ui_on_loopback_only():
    services = compose()["services"]
    config = load_config(str(ROOT / "docker" / "adstream.toml"))
    published = {name: s["ports"] for name, s in services.items() if s.get("ports")}
    assert published == {
        "serving": [f"127.0.0.1:{config.serving.port}:{config.serving.port}"],
        "mlflow": ["127.0.0.1:15000:5000"],
    }
    allowed = services["mlflow"]["command"][services["mlflow"]["command"].index("--allowed-hosts") + 1]
    assert "*" not in allowed and "mlflow:5000" in allowed
    assert "ADSTREAM_SERVING_TOKEN" in services["serving"]["environment"]
