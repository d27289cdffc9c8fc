"""The featurizer's Kafka transport: Faust's aiokafka driver with its per-record race made cheap.

Faust hands each fetched record to the streams with `Consumer.wait_first(deliver(record),
suspend_flow.wait())`: a race between the delivery and a rebalance suspending the flow, run as two
tasks and an asyncio.wait per record. With one event per record that race was the largest single
cost of the worker (`adstream bench pipeline`: 7.9k events/s with it, 14.1k without). A delivery
normally finishes at once (it puts the event on the stream's queue without waiting), so while the
flow is running this consumer awaits the delivery alone, and it keeps Faust's race whenever the flow
is suspended or being suspended. The hazard this leaves: a delivery that waits (a full stream
buffer) while a rebalance starts reaches the stream after it instead of being dropped; the stream
is at-least-once anyway, so that costs a duplicate at worst, never a lost event.

Registered as Faust's "adstream" transport (pyproject.toml, entry point group faust.transports):
the featurizer's broker URL is adstream://host:port.
"""

from __future__ import annotations

from typing import Any

from faust.transport.drivers import aiokafka
from mode.services import WaitArgT, WaitResults
from mode.utils.locks import Event
from mode.utils.times import Seconds


class Consumer(aiokafka.Consumer):
    async def wait_first(self, *coros: WaitArgT, timeout: Seconds = None) -> WaitResults:  # type: ignore[assignment]
        delivery = coros[0]
        if len(coros) == 2 and self._delivering(coros[1]) and not isinstance(delivery, Event):
            coros[1].close()  # type: ignore[union-attr]  # the flow's wait, never started
            return WaitResults([delivery], [await delivery], False)
        return await super().wait_first(*coros, timeout=timeout)  # type: ignore[arg-type]

    def _delivering(self, second: Any) -> bool:
        """True for the fetch loop's race (its second coroutine waits on suspend_flow) while the
        consumer and the flow run: nothing stopping, suspended or being suspended."""
        frame = getattr(second, "cr_frame", None)
        return (
            frame is not None
            and frame.f_locals.get("self") is self.suspend_flow
            and not self.suspend_flow.is_set()
            and self.app.flow_control.is_active()
            and not self.should_stop
        )


class Transport(aiokafka.Transport):
    Consumer = Consumer
