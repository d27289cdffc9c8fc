"""What serving logs of a scored event: an impression record in the joiner's format. Pure (but for
PendingShows, a bounded dict of candidates waiting for POST /shown).

    scored event (its JSON object as received, id and time filled in) + the served model + its CTR
        --impression_record--> {...the event..., "served": {"version", "step", "sequence", "ctr",
                                "served_ms"[, "propensity"]}}   key: the event id

The joiner reads it as any impression (stream/join/inputs.py: the event's id and time, no label) and
emits it labelled, the `served` object and all, onto the events topic; the featurizer reads only the
schema's fields, so the trainer learns the very event that was scored, and the live judge
(serving/judge.py) reads `served` back to score the served model on its own answers.

Deferred activation (an ad server scores many candidates and shows a few): an event scored with
`"shown": false` is held here, not logged; `POST /shown` with its id logs it (with the propensity
of the choice, if the caller says it); one not shown within `serving.shown_wait_s` is forgotten,
never an impression.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

SERVED = "served"  # the field of an impression record that says how it was served


@dataclass(frozen=True)
class ServedAs:
    """Which model scored a request: the part of `served` shared by its events."""

    version: str  # registry version of the base
    step: int  # trainer step of the newest publication applied (base or delta)
    sequence: int  # deltas applied after the base (0: the base alone)


def impression_record(item: dict[str, Any], label_field: str, served: ServedAs, ctr: float, served_ms: int) -> bytes:
    """The impression for one scored event: its object (no label: the joiner sets it) with `served`."""
    event = {k: v for k, v in item.items() if k != label_field and k != SERVED}
    event[SERVED] = {
        "version": served.version,
        "step": served.step,
        "sequence": served.sequence,
        "ctr": ctr,
        "served_ms": served_ms,
    }
    return orjson.dumps(event)


def with_propensity(record: bytes, propensity: float) -> bytes:
    """An impression record with the probability its ad had of being shown (exploration)."""
    event = orjson.loads(record)
    event[SERVED]["propensity"] = propensity
    return orjson.dumps(event)


class PendingShows:
    """Candidates scored with "shown": false: impression records by id, oldest first, at most `most`
    of them, each for `wait_ms`. Kept in memory by the worker that scored them."""

    def __init__(self, most: int, wait_ms: int) -> None:
        self.most, self.wait_ms = most, wait_ms
        self._held: OrderedDict[str, tuple[int, bytes]] = OrderedDict()  # id -> (deadline ms, record)
        self.expired = 0  # held candidates forgotten: never shown in time, or pushed out by newer ones

    def hold(self, impression_id: str, record: bytes, now_ms: int, deadline_ms: int | None = None) -> None:
        """Hold a candidate until now + wait_ms (or the deadline it had before a restart)."""
        self._held.pop(impression_id, None)
        self._held[impression_id] = (now_ms + self.wait_ms if deadline_ms is None else deadline_ms, record)
        self.expire(now_ms)
        while len(self._held) > self.most:
            self._held.popitem(last=False)
            self.expired += 1

    def take(self, impression_id: str, now_ms: int) -> bytes | None:
        """The held record of a shown candidate (None: unknown, already shown, or expired)."""
        held = self._held.pop(impression_id, None)
        if held is None:
            return None
        if held[0] < now_ms:
            self.expired += 1
            return None
        return held[1]

    def items(self) -> list[tuple[str, int, bytes]]:
        """(id, deadline ms, record) of every held candidate, oldest first (kept across a restart)."""
        return [(i, deadline, record) for i, (deadline, record) in self._held.items()]

    def expire(self, now_ms: int) -> None:
        while self._held:
            deadline, _ = next(iter(self._held.values()))
            if deadline >= now_ms:
                return
            self._held.popitem(last=False)
            self.expired += 1

    def __len__(self) -> int:
        return len(self._held)
