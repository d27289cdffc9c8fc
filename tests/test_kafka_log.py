"""librdkafka's lines during a broker outage: one when the broker goes away, one when it is back,
from a real client against a port nothing listens on."""

from __future__ import annotations

import logging
import socket
import time

from stream.kafka.client_log import OUTAGE, broker_back, quiet_logs


def test_an_unreachable_broker_is_one_line_and_its_return_one_more(caplog):
    from confluent_kafka import Producer

    with socket.socket() as s:  # a free port: connections to it are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    caplog.set_level(logging.INFO)
    producer = Producer({"bootstrap.servers": f"127.0.0.1:{port}", "reconnect.backoff.max.ms": 100, **quiet_logs()})
    producer.produce("t", b"x")
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        producer.poll(0.1)
    lines = [r for r in caplog.records if r.name.startswith("adstream.")]
    assert OUTAGE.hidden >= 3, "librdkafka tried again several times"
    assert len(lines) == 1 and "unreachable" in lines[0].getMessage() and lines[0].levelno == logging.WARNING
    broker_back()
    broker_back()  # once back, again is nothing
    lines = [r for r in caplog.records if r.name.startswith("adstream.")]
    assert len(lines) == 2 and "is back" in lines[1].getMessage()
    producer.purge()
