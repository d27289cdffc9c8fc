"""Helpers for the integration tests: CLI subprocesses on the test stack and draining topics."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from adstream import stack as local_stack
from adstream.config import Config
from adstream.processes import cli_process, pid_alive, port_open, stop_process, write_toml
from trainer.group import free_port


def start_cli(config: Config, tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    config_file = write_toml(config, tmp_path / f"{args[0]}.toml")
    log = tmp_path / f"{args[0]}.log"
    return cli_process(config_file, *args, log=log), log


def drain(bootstrap: str, topic: str, done: Callable[[list], bool], timeout_s: float, group: str) -> list:
    """Consume `topic` from the start until done(messages) or the timeout; returns the messages."""
    from confluent_kafka import Consumer

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    messages: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not done(messages):
            for message in consumer.consume(500, timeout=0.5):
                assert not message.error(), message.error()
                messages.append(message)
    finally:
        consumer.close()
    return messages


def restart_broker(config, down_s: float = 1.0) -> None:
    """SIGKILL the test broker, wait until its port is closed, keep it down for down_s, start it
    again on its own data."""
    kill_broker(config)
    time.sleep(down_s)
    start_broker(config)


def start_broker(config) -> None:
    """Start the (killed) test broker again on its own data."""
    local_stack.up(config.stack, config.kafka)


def kill_broker(config) -> None:
    state = Path(config.stack.state_dir)
    pid = pid_alive(state / "kafka.pid")
    assert pid, "the test broker is not running"
    os.kill(pid, signal.SIGKILL)
    try:  # the test session started the broker: reap it, or its zombie still looks alive to `up`
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    deadline = time.monotonic() + 30
    while port_open(config.stack.kafka_port) and time.monotonic() < deadline:
        time.sleep(0.1)


__all__ = ["drain", "free_port", "kill_broker", "restart_broker", "start_broker", "start_cli", "stop_process"]
