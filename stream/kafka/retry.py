"""Transient Kafka errors: tried again with backoff, logged once, never fatal.

A broker restart, a coordinator moving or a leader election answers for a few seconds with errors
that mean "not now" (NOT_COORDINATOR, REQUEST_TIMED_OUT, a dropped connection...). librdkafka does
not flag all of them retriable (a commit's NOT_COORDINATOR is not), so the codes are listed here,
once, for every process that talks to Kafka: the trainer (commits, offsets), replay (delivery) and
the featurizer (aiokafka's errors, through Faust).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# confluent-kafka / librdkafka error names that mean "try again shortly"
TRANSIENT_NAMES = frozenset(
    {
        "NOT_COORDINATOR",
        "COORDINATOR_NOT_AVAILABLE",
        "COORDINATOR_LOAD_IN_PROGRESS",
        "REQUEST_TIMED_OUT",
        "NETWORK_EXCEPTION",
        "NOT_LEADER_FOR_PARTITION",
        "LEADER_NOT_AVAILABLE",
        "REBALANCE_IN_PROGRESS",
        "BROKER_NOT_AVAILABLE",
        "UNKNOWN_TOPIC_OR_PART",  # a restarted broker answers before it has loaded its topics
        "_TRANSPORT",
        "_ALL_BROKERS_DOWN",
        "_TIMED_OUT",
        "_TIMED_OUT_QUEUE",
        "_MSG_TIMED_OUT",
        "_WAIT_COORD",
        "UNSTABLE_OFFSET_COMMIT",  # committed offsets of a transaction whose markers are on their way
    }
)


def is_transient(exc: BaseException) -> bool:
    """Whether a Kafka error (confluent-kafka's, or aiokafka's as Faust raises it) is worth retrying."""
    from confluent_kafka import KafkaError, KafkaException

    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        error = exc.args[0]
        return bool(error.retriable()) or error.name() in TRANSIENT_NAMES
    return _aiokafka_transient(exc) or (exc.__cause__ is not None and _aiokafka_transient(exc.__cause__))


def _aiokafka_transient(exc: BaseException) -> bool:
    import aiokafka.errors as errors

    if isinstance(exc, (errors.KafkaTimeoutError, errors.KafkaConnectionError, TimeoutError)):
        return True  # a delivery that timed out while the broker was away: send it again
    return isinstance(exc, errors.KafkaError) and bool(getattr(exc, "retriable", False))


def retrying(
    call: Callable[[], T],
    what: str,
    log: logging.Logger,
    give_up_s: float = 60.0,
    first_backoff_s: float = 0.2,
    max_backoff_s: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """call() until it returns; a transient Kafka error is retried with exponential backoff for up
    to give_up_s, logged once (and once more when it goes through). Other errors, and a transient
    one past give_up_s, are raised."""
    deadline = time.monotonic() + give_up_s
    backoff, failures = first_backoff_s, 0
    while True:
        try:
            result = call()
        except Exception as exc:
            if not is_transient(exc) or time.monotonic() + backoff > deadline:
                raise
            if failures == 0:
                until = "until it goes through" if math.isinf(give_up_s) else f"for up to {give_up_s:.0f}s"
                log.warning("kafka: %s failed (%s); retrying %s", what, exc, until)
            failures += 1
            sleep(backoff)
            backoff = min(backoff * 2, max_backoff_s)
            continue
        if failures:
            log.warning("kafka: %s went through after %d retries", what, failures)
        return result


class StuckCall(Exception):
    """A Kafka client call that outlived its own timeout by far: the client is to be replaced."""


def finish_within(call: Callable[[], T], seconds: float, what: str) -> T:
    """call() on a helper thread; its result, or its exception, or StuckCall once `seconds` passed.

    librdkafka's send_offsets_to_transaction ignores its timeout when the group coordinator went
    away during the call (confluentinc/librdkafka#5456, open): after a broker outage it can block
    for ever, and the joiner with it. The caller gives the call its own timeout plus a margin, and
    on StuckCall abandons the client (the thread stays blocked in it) for a new one."""
    import threading

    box: dict[str, object] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"kafka-{what}", daemon=True).start()
    if not done.wait(seconds):
        raise StuckCall(f"kafka: {what} still blocked after {seconds:g} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
