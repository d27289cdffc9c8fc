"""Impressions + delayed clicks -> labelled events: the join's rules, as pure functions. (#26's core)

An ad server logs an impression when it shows an ad; the click, if any, comes seconds to hours
later on another stream. The joiner keeps one `Entry` per impression id (the state a key-partitioned
store holds: its impression, whether it was clicked, what was already emitted) and moves it by
three transitions, each a pure function of (entry, arrival or timer, settings):

    on_impression(entry, impression)  an impression arrives (the entry may hold an early click)
    on_click(entry, click)            a click arrives for that impression id
    on_timer(entry, watermark)        event time passed the entry's `due` time

Each returns a `Step`: the entry to store (None: forget the id), the labelled events to emit,
the dead letters (clicks no impression claimed) and counters. Event time is the impressions'
`ts`; the watermark is the newest impression time minus `allowed_lateness_ms` (the shell keeps it,
and calls on_timer for every entry whose `due` it passed, in `due` order).

Policies (`JoinRules.policy`):
- "window": a click within `window_ms` of its impression emits it labelled 1 at once; an
  impression whose window closed unclicked is emitted labelled 0. Labels are final; negatives are
  as stale as the window.
- "fake_negative" (Ktena et al., RecSys 2019): every impression is emitted at once labelled 0; a
  click within the window emits a positive copy. The trainer corrects the bias in its loss.
- "elapsed" (ES-DFM's shape): an impression waits `elapsed_ms`, then is emitted with the label
  seen by then; a click after that, within the window, emits a positive copy.
A click after the window is a late click (counted; under fake_negative and elapsed it still emits a
positive copy, a correction). A duplicate click counts once. A click with no impression yet is held
for `allowed_lateness_ms` of event time (its impression may be late) and then dead-lettered as an
orphan. A closed entry is remembered until `window_ms + allowed_lateness_ms` after its window
closed, so a late or duplicate click still finds it; then the id is forgotten. So a click that
arrives with no entry while the watermark is past its time + `window_ms + allowed_lateness_ms` is
judged by its event time, not by when it was read: any impression it could belong to would have
been forgotten by then, so it is a "forgotten" click (its own reason and counter), not an orphan.

The records the joiner makes per impression and per click (RowRef, Impression, Click, Entry, Step,
Emission) are NamedTuples, immutable as the frozen dataclasses elsewhere: a frozen dataclass costs
~0.8 us to build against ~0.3, and a click builds five of them; tuples of plain values also drop out
of the garbage collector's scans, which the held entries of a long window would otherwise fill.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

from stream.errors import StreamError
from stream.settings import JOIN_POLICIES, JoinSettings

# Emission.kind: what an emitted labelled event is. It stays in the joiner (counters, tests, the join
# bench); the events written carry only the label, and the trainer tells a positive copy by its
# repeated event id (trainer/delayed.py)
FINAL = "final"  # window: the one emission, with the final label
FAKE_NEGATIVE = "fake_negative"  # fake_negative: the at-once emission, labelled 0
ELAPSED = "elapsed"  # elapsed: the emission after elapsed_ms, with the label seen by then
POSITIVE_COPY = "positive_copy"  # fake_negative / elapsed: a click inside the window, after the first emission
LATE_POSITIVE = "late_positive"  # fake_negative / elapsed: a click after the window (a correction)
FIRST_EMISSIONS = frozenset({FINAL, FAKE_NEGATIVE, ELAPSED})
# a dead-lettered click's reason (one text for every orphan, so `adstream dlq` counts them together;
# the click record beside it names the impression)
ORPHAN_CLICK = "impression_id: no impression with this id came within stream.join.allowed_lateness_s of the click"
FORGOTTEN_CLICK = (
    "ts: a late click past the join's memory: when it was read, event time (the newest impressions "
    "minus allowed_lateness_s) was more than window_s + allowed_lateness_s past the click, so every "
    "window it could count in had closed and no impression with this id was remembered any more; "
    "send clicks sooner after their impressions"
)


@dataclass(frozen=True)
class JoinPolicy:
    """What one policy does differently, read by the transitions below; adding a policy is one more
    of these (and the branches its traits need), never another string compared."""

    name: str  # stream.join.policy
    emits_at_once: bool  # every impression emitted at once, labelled 0 (then a positive copy on a click)
    waits_elapsed: bool  # an impression is emitted elapsed_ms after its time, with the label seen by then
    final_labels: bool  # one emission per impression, with its final label; a late click corrects nothing
    # the trainer.optim.delayed_feedback modes that learn right from this policy's labels: final labels
    # need no correction; fake negatives and positive copies need FNW's weights or FNC's calibration
    delayed_feedback: tuple[str, ...]


WINDOW = JoinPolicy("window", False, False, True, ("none",))
FAKE_NEGATIVE_POLICY = JoinPolicy("fake_negative", True, False, False, ("fnw", "fnc"))
ELAPSED_POLICY = JoinPolicy("elapsed", False, True, False, ("fnw", "fnc"))
POLICIES = {p.name: p for p in (WINDOW, FAKE_NEGATIVE_POLICY, ELAPSED_POLICY)}
assert tuple(POLICIES) == JOIN_POLICIES, "stream/settings.py names every policy, in this order"


def check_delayed_feedback(policy: str, delayed_feedback: str) -> None:
    """Refuse a trainer that would learn the joiner's labels with the wrong weights (window + fnw
    trains on weights meant for fake negatives; fake_negative + none learns every clicked impression
    as a negative too), naming both settings."""
    allowed = POLICIES[policy].delayed_feedback
    if delayed_feedback not in allowed:
        raise StreamError(
            f"config stream.join.policy={policy!r} with trainer.optim.delayed_feedback={delayed_feedback!r}: "
            f"that policy's labels are learned with delayed_feedback {' or '.join(map(repr, allowed))}; set one"
        )


@dataclass(frozen=True)
class JoinRules:
    """The join's settings in event-time milliseconds, with the policy resolved. Built from
    [stream.join] by `join_rules` (each knob, its default and its checks are declared once, in
    stream/settings.py's JoinSettings); the transitions read only this."""

    policy: str  # a POLICIES name: see the module docstring
    window_ms: int  # attribution window: a click counts if it comes this soon after its impression
    allowed_lateness_ms: int  # how far event time may run out of order (and an early click waits)
    elapsed_ms: int  # "elapsed": how long an impression waits for its click before it is emitted
    kind: JoinPolicy = field(init=False, repr=False, compare=False)  # POLICIES[policy]

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise StreamError(f"config stream.join.policy={self.policy!r}: use one of {list(POLICIES)}")
        object.__setattr__(self, "kind", POLICIES[self.policy])


def join_rules(settings: JoinSettings) -> JoinRules:
    """[stream.join] -> the rules the transitions read."""
    return JoinRules(
        policy=settings.policy,
        window_ms=round(settings.window_s * 1000),
        allowed_lateness_ms=round(settings.allowed_lateness_s * 1000),
        elapsed_ms=round(settings.elapsed_s * 1000),
    )


class RowRef(NamedTuple):
    """Where an impression of an Arrow bundle lies: row `row` of the bundle the impressions partition
    held at `offset` (the joiner stores each bundle once, stream/join/state.py, and emits Arrow)."""

    offset: int
    row: int


class Impression(NamedTuple):
    impression_id: str
    ts: int  # event time, ms
    # the event as it will be emitted, without its label (the shell adds it): its JSON object, or
    # where it lies in a stored Arrow bundle; b"" once no emission will need it
    payload: bytes | RowRef


class Click(NamedTuple):
    impression_id: str
    ts: int  # click time, ms


class Emission(NamedTuple):
    """A labelled event to emit: the impression's payload with `label`, and what kind of emission it is."""

    impression_id: str
    ts: int  # the impression's event time
    label: int  # 0 or 1
    kind: str  # FINAL, FAKE_NEGATIVE, ELAPSED, POSITIVE_COPY or LATE_POSITIVE
    payload: bytes | RowRef


class DeadClick(NamedTuple):
    click: Click
    reason: str


@dataclass(frozen=True)
class Counts:
    """What one step did, for the join_* metrics."""

    late_clicks: int = 0  # clicks after their impression's window
    duplicate_clicks: int = 0  # a second click of an impression already clicked
    orphan_clicks: int = 0  # clicks dead-lettered: no impression came within the lateness allowance
    duplicate_impressions: int = 0  # an impression id seen again (the second is dropped)
    forgotten_clicks: int = 0  # clicks dead-lettered: read when event time was past the join's memory of them

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.late_clicks + other.late_clicks,
            self.duplicate_clicks + other.duplicate_clicks,
            self.orphan_clicks + other.orphan_clicks,
            self.duplicate_impressions + other.duplicate_impressions,
            self.forgotten_clicks + other.forgotten_clicks,
        )


NO_COUNTS = Counts()  # what most steps count: shared, so adding it up can be skipped


class Entry(NamedTuple):
    """What the joiner keeps for one impression id. An entry with no impression holds an early click."""

    impression: Impression | None = None
    clicked: bool = False  # a click within the window was seen
    emitted: bool = False  # its first emission is out (FAKE_NEGATIVE, ELAPSED or FINAL)
    closed: bool = False  # its window is over: kept only to recognise late and duplicate clicks
    early_click: Click | None = None  # a click that came before its impression
    due: int = 0  # event time of this entry's next timer


class Step(NamedTuple):
    entry: Entry | None  # what to store for the id (None: forget it)
    emit: tuple[Emission, ...] = ()
    dead: tuple[DeadClick, ...] = ()
    counts: Counts = NO_COUNTS


def _emission(imp: Impression, label: int, kind: str) -> Emission:
    return Emission(imp.impression_id, imp.ts, label, kind, imp.payload)


def _closes(imp: Impression, s: JoinRules) -> int:
    return imp.ts + s.window_ms


def _forget(imp: Impression, s: JoinRules) -> int:
    return imp.ts + 2 * s.window_ms + s.allowed_lateness_ms  # payload_kept_ms: keep the two one


def payload_kept_ms(s: JoinRules) -> int:
    """How long after an impression's time an emission may still need its payload: under "window"
    until its window closes (the last emission), else until it is forgotten (a late click's
    correction). The joiner drops a stored bundle once the watermark is this far past its newest row."""
    return s.window_ms if s.kind.final_labels else 2 * s.window_ms + s.allowed_lateness_ms


def on_impression(entry: Entry | None, imp: Impression, watermark: int, s: JoinRules) -> Step:
    """An impression arrives. A held early click labels it at once; under fake_negative it is emitted
    at once as a negative. Its timer: the window's close (or elapsed_ms under "elapsed")."""
    if entry is not None and entry.impression is not None:
        return Step(entry, counts=Counts(duplicate_impressions=1))
    fresh = Entry(impression=imp, due=imp.ts + s.elapsed_ms if s.kind.waits_elapsed else _closes(imp, s))
    emit: list[Emission] = []
    if s.kind.emits_at_once:
        emit.append(_emission(imp, 0, FAKE_NEGATIVE))
        fresh = Entry(imp, False, True, False, None, fresh.due)
    step = Step(fresh, tuple(emit))
    if entry is not None and entry.early_click is not None:
        clicked = on_click(fresh, entry.early_click, watermark, s)
        step = Step(clicked.entry, step.emit + clicked.emit, clicked.dead, clicked.counts)
    if step.entry is not None and step.entry.due <= watermark:  # arrived after its timer: run it now
        timed = on_timer(step.entry, watermark, s)
        step = Step(timed.entry, step.emit + timed.emit, step.dead + timed.dead, step.counts + timed.counts)
    return step


def on_click(entry: Entry | None, click: Click, watermark: int, s: JoinRules) -> Step:
    """A click arrives for an impression id."""
    if entry is None or entry.impression is None:
        if entry is not None and entry.early_click is not None:
            return Step(entry, counts=Counts(duplicate_clicks=1))
        if watermark > click.ts + s.window_ms + s.allowed_lateness_ms:  # any impression of it was forgotten
            return Step(None, dead=(DeadClick(click, FORGOTTEN_CLICK),), counts=Counts(forgotten_clicks=1))
        # no impression yet: hold the click while its impression may still come
        return Step(Entry(early_click=click, due=max(click.ts, watermark) + s.allowed_lateness_ms))
    imp = entry.impression
    if entry.clicked:
        return Step(entry, counts=Counts(duplicate_clicks=1))
    if click.ts - imp.ts > s.window_ms or entry.closed:  # after the window, or after it was closed: late
        late = _clicked(entry)
        if s.kind.final_labels:  # its label is 0, emitted or to be
            return Step(late, counts=Counts(late_clicks=1))
        first: tuple[Emission, ...] = ()
        if not entry.emitted:  # "elapsed" whose timer has not fired yet: the label seen at elapsed_ms was 0
            first = (_emission(imp, 0, ELAPSED),)
            late = late._replace(emitted=True, due=_closes(imp, s))
        return Step(late, (*first, _emission(imp, 1, LATE_POSITIVE)), counts=Counts(late_clicks=1))
    clicked = _clicked(entry)
    if s.kind.final_labels:  # the label is final: emit and close
        return Step(_closed(clicked, s), (_emission(imp, 1, FINAL),))
    if not entry.emitted:  # "elapsed" before its time: wait, the label at emission will be 1
        return Step(clicked)
    return Step(clicked, (_emission(imp, 1, POSITIVE_COPY),))


def on_timer(entry: Entry, watermark: int, s: JoinRules) -> Step:
    """Event time passed entry.due: emit what is due, move the entry to its next timer or forget it."""
    if entry.impression is None:  # an early click whose impression never came
        assert entry.early_click is not None
        return Step(None, dead=(DeadClick(entry.early_click, ORPHAN_CLICK),), counts=Counts(orphan_clicks=1))
    imp = entry.impression
    if entry.closed:
        return Step(None)  # remembered long enough for late and duplicate clicks
    if s.kind.waits_elapsed and not entry.emitted:
        emitted = entry._replace(emitted=True, due=_closes(imp, s))
        step = Step(emitted, (_emission(imp, int(entry.clicked), ELAPSED),))
        if emitted.due <= watermark:
            later = on_timer(emitted, watermark, s)
            return Step(later.entry, step.emit + later.emit)
        return step
    emit = () if entry.emitted else (_emission(imp, 0, FINAL),)  # "window": closed unclicked
    return Step(_closed(entry, s), emit)


def _closed(entry: Entry, s: JoinRules) -> Entry:
    """The entry once its window is over, kept to recognise late and duplicate clicks; under "window"
    without its payload (no correction will be emitted), so it costs a few bytes."""
    assert entry.impression is not None
    imp = entry.impression
    kept = imp if not s.kind.final_labels else Impression(imp.impression_id, imp.ts, b"")
    return Entry(kept, entry.clicked, True, True, entry.early_click, _forget(imp, s))


def _clicked(entry: Entry) -> Entry:
    """The entry with its click seen (built by hand: this is the joiner's hot path)."""
    return Entry(entry.impression, True, entry.emitted, entry.closed, entry.early_click, entry.due)


def watermark_of(newest_ts: int, s: JoinRules) -> int:
    """Event time every later impression is assumed to be past: the newest impression time seen
    minus the lateness allowance."""
    return newest_ts - s.allowed_lateness_ms


@dataclass(frozen=True)
class Joined:
    """All that a join of a whole stream produced (join_all)."""

    emitted: tuple[Emission, ...]
    dead: tuple[DeadClick, ...]
    counts: Counts
    pending: int  # entries still held at the end (a live joiner keeps them for later arrivals)


class Cursor:
    """One partition's join in motion: applies arrivals to the entries of a store (`get(id)`,
    `put(id, entry or None)`: a dict for join_all, RocksDB for the joiner) and fires timers in
    (due, id) order as the watermark passes them. What each step emits gathers in `emitted`,
    `dead` and `counts` until the caller takes them (`take`)."""

    def __init__(
        self,
        rules: JoinRules,
        get: Callable[[str], Entry | None],
        put: Callable[[str, Entry | None], None],
        timers: list[tuple[int, str]] | None = None,
        newest: int | None = None,
        preload: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.rules, self.get, self.put = rules, get, put
        self.preload = preload  # reads many ids' entries at once ahead of `get` (a disk-backed store)
        self.timers = timers if timers is not None else []  # a heap of (due, id); stale ones are skipped
        heapq.heapify(self.timers)
        self.newest = newest  # newest impression time seen
        # how far the inputs that may still change this partition's entries are known to have come
        # (event time: unread clicks, impressions that may first arrive elsewhere): None when all is
        # in hand (a joiner caught up, or join_all); the watermark never passes it, so a window does
        # not close while its clicks may still be unread
        self.frontier: int | None = None
        self.emitted: list[Emission] = []
        self.dead: list[DeadClick] = []
        self.counts = Counts()
        self.fast = True  # the short path for a new impression (False: on_impression for every one; tests)

    @property
    def watermark(self) -> int:
        if self.newest is None:
            return -(1 << 62)
        newest = self.newest if self.frontier is None else min(self.newest, self.frontier)
        return watermark_of(newest, self.rules)

    def impression(self, imp: Impression) -> None:
        self.impressions((imp,))

    def impressions(self, imps: Iterable[Impression]) -> None:
        """Impressions in order. The usual one (a new id whose timer is still ahead of the watermark)
        takes a short path that builds what on_impression would (the joiner's hot loop; the tests
        pin the two to the same output); any other goes through on_impression."""
        rules, get, put, timers = self.rules, self.get, self.put, self.timers
        fake = rules.kind.emits_at_once
        wait = rules.elapsed_ms if rules.kind.waits_elapsed else rules.window_ms
        watermark, frontier, lateness = self.watermark, self.frontier, rules.allowed_lateness_ms
        for imp in imps:
            key = imp.impression_id
            before = get(key)
            due = imp.ts + wait
            if before is None and due > watermark and self.fast:
                put(key, Entry(imp, False, fake, False, None, due))
                heapq.heappush(timers, (due, key))
                if fake:
                    self.emitted.append(Emission(key, imp.ts, 0, FAKE_NEGATIVE, imp.payload))
            else:
                self._apply(key, before, on_impression(before, imp, watermark, rules))
            if self.newest is None or imp.ts > self.newest:
                self.newest = imp.ts
                watermark = (imp.ts if frontier is None or imp.ts < frontier else frontier) - lateness  # .watermark
                if timers and timers[0][0] <= watermark:
                    self.fire(watermark)

    def click(self, click: Click) -> None:
        key = click.impression_id
        before = self.get(key)
        self._apply(key, before, on_click(before, click, self.watermark, self.rules))

    def fire(self, watermark: int) -> int:
        """Run every timer due at or before `watermark`, in (due, id) order; their entries read
        together first. A timer a fired one sets at or before `watermark` runs in the next round.
        Returns how many timers were popped (0: nothing changed)."""
        timers, get, rules = self.timers, self.get, self.rules
        popped = 0
        while timers and timers[0][0] <= watermark:
            due_now = []
            while timers and timers[0][0] <= watermark:
                due_now.append(heapq.heappop(timers))
            popped += len(due_now)
            if self.preload is not None and len(due_now) > 1:
                self.preload([key for _, key in due_now])
            for due, key in due_now:
                entry = get(key)
                if entry is not None and entry.due == due:  # else a stale timer: the entry moved on
                    self._apply(key, entry, on_timer(entry, watermark, rules))
        return popped

    def take(self) -> tuple[list[Emission], list[DeadClick], Counts]:
        out = self.emitted, self.dead, self.counts
        self.emitted, self.dead, self.counts = [], [], Counts()
        return out

    def _apply(self, key: str, before: Entry | None, step: Step) -> None:
        if step.entry is not before:
            self.put(key, step.entry)
            if step.entry is not None and (before is None or before.due != step.entry.due):
                heapq.heappush(self.timers, (step.entry.due, key))
        if step.emit:
            self.emitted.extend(step.emit)
        if step.dead:
            self.dead.extend(step.dead)
        if step.counts is not NO_COUNTS:
            self.counts = self.counts + step.counts


def put_into(entries: dict[str, Entry], key: str, entry: Entry | None) -> None:
    """A Cursor's `put` over a dict (with functools.partial): store the entry, or forget the id."""
    if entry is None:
        entries.pop(key, None)
    else:
        entries[key] = entry


def join_all(arrivals: list[Impression | Click], s: JoinRules, flush: bool = False, fast: bool = True) -> Joined:
    """The join of arrivals in the order given, held in a dict: the reference every joiner shell
    (Kafka, disk-backed state) must equal. Each impression moves the watermark, then the timers it
    passed fire in (due, id) order; with `flush`, event time finally runs past every timer (the end
    of a bounded replay)."""
    entries: dict[str, Entry] = {}
    cursor = Cursor(s, entries.get, partial(put_into, entries))
    cursor.fast = fast
    for arrival in arrivals:
        if isinstance(arrival, Impression):
            cursor.impression(arrival)
        else:
            cursor.click(arrival)
    if flush:
        cursor.fire(1 << 62)
    return Joined(tuple(cursor.emitted), tuple(cursor.dead), cursor.counts, len(entries))
