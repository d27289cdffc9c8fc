"""librdkafka's own log lines, one line per broker outage instead of hundreds.

A producer or consumer of confluent-kafka logs every failed connection attempt of its background
threads to stderr ("FAIL|rdkafka#producer-1| ... Connect to ipv4#127.0.0.1:19092 failed:
Connection refused"), several a second per broker connection while a broker is away: a 75 s
outage printed 385 of them in `replay`. Every client of the project takes `quiet_logs()` in its
config: librdkafka's lines then go through the `adstream.librdkafka` logger, whose filter lets the
first line about an unreachable broker through, as one warning, and hides the rest until
`broker_back()` (called where a client sees the broker answer again: a delivery, a fetched record,
a committed transaction) logs one line that it is back. Other librdkafka lines pass unchanged.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("adstream.kafka")

# what librdkafka says when a broker cannot be reached, or the connection to it broke
_DOWN = (
    "Connection refused",
    "Connect to",
    "Disconnected",
    "brokers are down",
    "broker(s) are down",
    "transport failure",
    "Receive failed",
    "Connection reset",
    "Failed to resolve",
)


class _Outage(logging.Filter):
    """The process's one view of whether the broker is away, and the lines it held back."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.hidden = 0
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if not any(words in text for words in _DOWN):
            return True
        with self.lock:
            if self.down:
                self.hidden += 1
                return False
            self.down = True
        record.msg, record.args = (
            "kafka: the broker is unreachable (%s); retrying, quiet until it is back",
            (text[:200],),
        )
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True

    def back(self) -> None:
        if not self.down:  # the usual case, without the lock
            return
        with self.lock:
            if not self.down:
                return
            self.down, hidden = False, self.hidden
            self.hidden = 0
        log.warning("kafka: the broker is back (%d more librdkafka lines about the outage not shown)", hidden)


OUTAGE = _Outage()
LIBRDKAFKA = logging.getLogger("adstream.librdkafka")
LIBRDKAFKA.addFilter(OUTAGE)


def quiet_logs() -> dict[str, object]:
    """The config entries that route a confluent-kafka client's log lines through the outage filter."""
    return {"logger": LIBRDKAFKA}


def broker_back() -> None:
    """The broker answered (a delivery, a record read, a commit): end a logged outage with one line."""
    OUTAGE.back()
