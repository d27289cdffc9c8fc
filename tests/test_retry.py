"""Transient Kafka errors are retried with backoff and logged once; others are raised at once. The
trainer's offset commit never dies on one (the error a clean clone's `make test` hit:
NOT_COORDINATOR from a commit right after a broker restart). The real broker's side of this is
tests/integration/test_faults.py."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import KafkaError, KafkaException

from stream.kafka.retry import StuckCall, finish_within, is_transient, retrying
from trainer.source import BatchSource

log = logging.getLogger("test.retry")


def failing(times: int, code: int, then: object = "done"):
    calls = []

    def call() -> object:
        calls.append(1)
        if len(calls) <= times:
            raise KafkaException(KafkaError(code))
        return then

    return call, calls


def test_a_transient_error_is_retried_with_growing_backoff_and_logged_once(caplog):
    call, calls = failing(4, KafkaError.NOT_COORDINATOR)
    sleeps: list[float] = []
    with caplog.at_level(logging.WARNING, "test.retry"):
        assert retrying(call, "commit", log, give_up_s=60, sleep=sleeps.append) == "done"
    assert len(calls) == 5 and sleeps == [0.2, 0.4, 0.8, 1.6]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "NOT_COORDINATOR" in messages[0] and "after 4 retries" in messages[1]


def test_an_error_that_is_not_transient_is_raised_at_once():
    call, calls = failing(1, KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(KafkaException):
        retrying(call, "commit", log, sleep=lambda s: None)
    assert len(calls) == 1


def test_a_transient_error_past_the_deadline_is_raised():
    call, calls = failing(10**6, KafkaError.REQUEST_TIMED_OUT)
    with pytest.raises(KafkaException):
        retrying(call, "commit", log, give_up_s=0.5, first_backoff_s=0.1, max_backoff_s=0.1)
    assert 2 <= len(calls) <= 7


def test_which_errors_are_transient():
    import aiokafka.errors as aio
    from faust.exceptions import ProducerSendError

    for code in (KafkaError.NOT_COORDINATOR, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN):
        assert is_transient(KafkaException(KafkaError(code)))
    assert not is_transient(KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)))
    wrapped = ProducerSendError("Error while sending")
    wrapped.__cause__ = aio.KafkaTimeoutError()
    assert is_transient(wrapped) and is_transient(aio.NotLeaderForPartitionError())
    assert not is_transient(aio.MessageSizeTooLargeError()) and not is_transient(ValueError("x"))


class RefusingConsumer:
    """Commits fail `times` times with `code`, then go through (what a broker restart looks like)."""

    def __init__(self, times: int, code: int) -> None:
        self.commit_once, self.calls = failing(times, code, then=None)
        self.committed: list = []

    def commit(self, offsets, asynchronous):
        self.commit_once()
        self.committed.append({tp.partition: tp.offset for tp in offsets})


def source_with(consumer: RefusingConsumer) -> BatchSource:
    from stream.kafka.settings import KafkaSettings

    source = BatchSource.__new__(BatchSource)  # no broker needed: only commit() is under test
    source.kafka, source.partitions, source.consumer = KafkaSettings(), [0, 1], consumer
    return source


def test_the_trainer_commit_rides_out_not_coordinator():
    consumer = RefusingConsumer(3, KafkaError.NOT_COORDINATOR)
    assert source_with(consumer).commit({0: 10, 1: 20, 5: 7}) is True
    assert consumer.committed == [{0: 10, 1: 20}]  # its own partitions only


def test_a_commit_refused_for_good_is_logged_and_left_to_the_next_snapshot(caplog):
    consumer = RefusingConsumer(10**6, KafkaError.COORDINATOR_NOT_AVAILABLE)
    with caplog.at_level(logging.ERROR, "adstream.trainer"):
        assert source_with(consumer).commit({0: 10}, give_up_s=0.3) is False
    assert consumer.committed == [] and "the snapshot holds them" in caplog.text


def test_a_call_past_its_deadline_is_reported_stuck_others_answer_as_they_would():
    """The joiner's guard around librdkafka's transactional calls (send_offsets_to_transaction can
    ignore its timeout after a broker outage: librdkafka #5456): a call that does not return in
    time is StuckCall, not a hang; a result or an error comes back as the call gave it."""
    import threading
    import time

    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(StuckCall, match="send_offsets_to_transaction still blocked after 0.2 s"):
        finish_within(release.wait, 0.2, "send_offsets_to_transaction")
    assert 0.2 <= time.monotonic() - started < 2.0
    release.set()
    assert finish_within(lambda: 42, 5.0, "commit") == 42
    with pytest.raises(KafkaException):
        finish_within(lambda: (_ for _ in ()).throw(KafkaException(KafkaError(KafkaError._TIMED_OUT))), 5.0, "x")
