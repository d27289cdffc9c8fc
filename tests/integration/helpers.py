"""Helpers for the integration tests: CLI subprocesses on the test stack and draining topics."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from adstream.config import Config
from adstream.processes import cli_process, stop_process, write_toml
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


__all__ = ["drain", "free_port", "start_cli", "stop_process"]
