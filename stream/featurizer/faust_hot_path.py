"""The Faust worker's per-record path made cheap: a Kafka transport and a quiet monitor.

With one event per Kafka record, most of the featurizer's time went to Faust's machinery around each
record, not to featurizing (profiled with py-spy under `adstream bench pipeline`). Two parts of it
do work the featurizer does not need:

- the transport: Faust hands each fetched record to the streams with `Consumer.wait_first(deliver
  (record), suspend_flow.wait())`, a race between the delivery and a rebalance suspending the
  flow, run as two tasks and an asyncio.wait per record. A delivery normally finishes at once (it
  puts the event on the stream's queue without waiting), so while the consumer and the flow run
  and no stream queue is full, this consumer awaits the delivery alone; otherwise it keeps Faust's
  race. The race matters: a delivery that waited through a rebalance would reach the stream after
  Faust cleared its queues, ahead of the records the rebalance sends again from the committed
  offset; written ahead of older unwritten records of its partition, it would break the source
  order the trainer's check relies on (stream/featurizer/outputs.py), and those older records would
  be dropped there as seen.
- the monitor: Faust's Monitor times and counts every message and event for its web pages, which
  the featurizer does not serve (its own counters go to Prometheus).

Measured with one event per record (bench pipeline's Faust worker, 2 cores): 8.6k events/s before,
14k with the transport and uvloop, 15-16k with the quiet monitor too.

The transport also reads the events topic with isolation level read_committed: the joiner
(stream/join/joiner.py) writes its labelled events in Kafka transactions, and a record of an aborted
one must not be featurized.

The transport is registered as Faust's "adstream" transport (pyproject.toml, entry point group
faust.transports): the featurizer's broker URL is adstream://host:port.
"""

from __future__ import annotations

from typing import Any

from faust.sensors.monitor import Monitor
from faust.transport.drivers import aiokafka
from faust.types import TP, EventT, Message, StreamT
from mode.services import WaitArgT, WaitResults
from mode.utils.locks import Event
from mode.utils.times import Seconds


class ReadCommittedThread(aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: aiokafka.Transport) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # the joiner writes labelled events in transactions: an aborted one must never be featurized
        # (Faust reads committed only under its own exactly-once guarantee, which this app does not use)
        consumer._isolation_level = "read_committed"
        return consumer


class Consumer(aiokafka.Consumer):
    def _new_consumer_thread(self) -> aiokafka.AIOKafkaConsumerThread:
        return ReadCommittedThread(self, loop=self.loop, beacon=self.beacon)

    async def wait_first(self, *coros: WaitArgT, timeout: Seconds = None) -> WaitResults:  # type: ignore[assignment]
        delivery = coros[0]
        if len(coros) == 2 and self._delivering(coros[1]) and not isinstance(delivery, Event):
            coros[1].close()  # type: ignore[union-attr]  # the flow's wait, never started
            return WaitResults([delivery], [await delivery], False)
        return await super().wait_first(*coros, timeout=timeout)  # type: ignore[arg-type]

    def _delivering(self, second: Any) -> bool:
        """True for the fetch loop's race (its second coroutine waits on suspend_flow) while the
        consumer and the flow run (nothing stopping, suspended or being suspended) and the delivery
        cannot wait (no stream queue full)."""
        frame = getattr(second, "cr_frame", None)
        flow = self.app.flow_control
        return (
            frame is not None
            and frame.f_locals.get("self") is self.suspend_flow
            and not self.suspend_flow.is_set()
            and flow.is_active()
            and not self.should_stop
            and not any(queue.full() for queue in flow._queues)
        )


class Transport(aiokafka.Transport):
    Consumer = Consumer


class QuietMonitor(Monitor):
    """Faust's Monitor without its per-message and per-event bookkeeping (timings and counts kept
    for Faust's web pages, which the featurizer does not serve; its own counters go to Prometheus)."""

    def on_message_in(self, tp: TP, offset: int, message: Message) -> None:
        return None

    def on_stream_event_in(self, tp: TP, offset: int, stream: StreamT, event: EventT) -> dict | None:
        return None

    def on_stream_event_out(
        self, tp: TP, offset: int, stream: StreamT, event: EventT, state: dict | None = None
    ) -> None:
        return None

    def on_message_out(self, tp: TP, offset: int, message: Message) -> None:
        return None
