"""What the CLI prints: strict JSON (a metric not measured yet is null, never NaN), and one line
naming the address and the fix when a server does not answer."""

from __future__ import annotations

import json
import subprocess
import sys

from adstream.commands import json_line


def test_json_lines_are_strict_json_with_null_for_an_unmeasured_metric():
    text = json_line({"progressive_auc": float("nan"), "runs": [{"ece": float("inf")}, 1.5], "steps": 3})
    assert json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c))) == {
        "progressive_auc": None,
        "runs": [{"ece": None}, 1.5],
        "steps": 3,
    }


def test_predict_without_a_server_is_one_line_naming_the_address_and_the_fix():
    done = subprocess.run(
        [sys.executable, "-m", "adstream.cli", "predict", "{}", "--url", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "http://127.0.0.1:9" in lines[0] and "adstream serve" in lines[0], done.stderr


DOWN = ["--set", "kafka.bootstrap=127.0.0.1:9", "--set", "mlflow.tracking_uri=http://127.0.0.1:9"]


# what "at once" means for a command that must not wait on a service: a broker or tracking server
# wait is 30 s and more; the CLI's own start (Python, its imports) takes seconds on a loaded machine
# (a loaded run once went past the 15 s this was before)
AT_ONCE_S = 25


def _cli(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    import time

    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "adstream.cli", *args], capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - started


def test_with_nothing_running_every_command_says_which_service_in_one_line_within_seconds(tmp_path):
    """#29 item 2: train retried MLflow for 4 min 37 s of warnings; with only Kafka down it printed
    hundreds of librdkafka lines and left its MLflow run open. Each command now checks the services
    it needs once, Kafka before an MLflow run can open."""
    import socket

    listener = socket.socket()  # "Kafka up" for a TCP connect: a listening socket of this test's own
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    kafka_up = f"kafka.bootstrap=127.0.0.1:{listener.getsockname()[1]}"
    cases = [
        (["train", "--max-events", "10"], "kafka at 127.0.0.1:9"),
        (["--set", "kafka.bootstrap=127.0.0.1:9", "train"], "kafka at 127.0.0.1:9"),
        (
            ["--set", kafka_up, "--set", "mlflow.tracking_uri=http://127.0.0.1:9", "train"],
            "mlflow at http://127.0.0.1:9",
        ),
        (["replay", "--synthetic", "10"], "kafka at 127.0.0.1:9"),
        (["stream"], "kafka at 127.0.0.1:9"),
        (["join"], "kafka at 127.0.0.1:9"),
        (["serve"], "mlflow at http://127.0.0.1:9"),
        (["dlq"], "kafka at 127.0.0.1:9"),
    ]
    for args, service in cases:
        full = args if args[0] == "--set" else [*DOWN, *args]
        done, seconds = _cli(*full)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (args, done.stderr[-2000:])
        assert service in lines[0] and "adstream up" in lines[0] and seconds < AT_ONCE_S, (args, lines, seconds)
    listener.close()


def test_replay_looks_at_its_files_before_the_broker():
    """A mistyped path with no broker used to cost 30 s on Kafka and name neither."""
    done, seconds = _cli(*DOWN, "replay", "/no/such/day_0.txt")
    assert done.returncode == 2 and seconds < AT_ONCE_S
    assert done.stderr.strip() == "adstream replay: no such file '/no/such/day_0.txt'"


def test_replay_of_a_log_under_the_wrong_schema_stops_naming_the_schema_that_reads_it(tmp_path):
    """#29 item 1: an Avazu CSV under the default schema replayed 0 events, rejected them all, exit 0."""
    from tests.helpers import avazu_csv

    log = avazu_csv(tmp_path / "train.csv", 300)
    done, seconds = _cli(*DOWN, "replay", str(log))
    assert done.returncode == 2 and seconds < AT_ONCE_S, done.stderr[-2000:]
    message = done.stderr.strip()
    assert "reads under schema 'criteo'" in message and "--set stream.schema=avazu" in message
    done, _ = _cli(*DOWN, "--set", "stream.schema=avazu", "replay", str(log))
    assert done.returncode == 2 and "kafka at 127.0.0.1:9" in done.stderr  # the right schema: on to the broker


def test_metrics_endpoints_are_on_by_default_and_a_taken_port_is_said_not_fatal(caplog):
    """#29 item 10: the trainer's and the featurizer's Prometheus endpoints were off by default."""
    import socket
    import urllib.request

    from stream.kafka.prometheus import serve_metrics
    from stream.settings import JoinSettings, StreamSettings
    from trainer.settings import TrainerSettings

    ports = {TrainerSettings().metrics_port, StreamSettings().metrics_port, JoinSettings().metrics_port}
    assert len(ports) == 3 and 0 not in ports  # on, and apart
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert serve_metrics(port, "127.0.0.1", "trainer.metrics_port")
    assert b"python_info" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    assert not serve_metrics(port, "127.0.0.1", "trainer.metrics_port")  # taken: said, not raised
    assert f"port {port}" in caplog.text and "set trainer.metrics_port" in caplog.text
    assert not serve_metrics(0, "127.0.0.1", "trainer.metrics_port")
