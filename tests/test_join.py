"""The join's rules (stream/join/policy.py) against hand-written timelines, policy by policy, and the
invariants every timeline keeps (one first emission per impression, one positive at most, nothing
for a click without an impression). Event time in ms: window 1000, lateness 100, elapsed 300."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.errors import StreamError
from stream.join.policy import (
    ELAPSED,
    FAKE_NEGATIVE,
    FINAL,
    FIRST_EMISSIONS,
    LATE_POSITIVE,
    POSITIVE_COPY,
    Click,
    Counts,
    Impression,
    JoinRules,
    join_all,
)
from stream.settings import JoinSettings

W, L, E = 1000, 100, 300


def cfg(policy: str) -> JoinRules:
    return JoinRules(policy=policy, window_ms=W, allowed_lateness_ms=L, elapsed_ms=E)


def imp(key: str, ts: int) -> Impression:
    return Impression(key, ts, f'{{"event_id":"{key}"}}'.encode())


def click(key: str, ts: int) -> Click:
    return Click(key, ts)


def emitted(arrivals, policy: str, flush: bool = False) -> list[tuple[str, int, str]]:
    return [(e.impression_id, e.label, e.kind) for e in join_all(arrivals, cfg(policy), flush).emitted]


def test_window_a_click_labels_at_once_an_unclicked_impression_when_its_window_closes():
    arrivals = [imp("a", 0), imp("b", 100), click("a", 500)]
    assert emitted(arrivals, "window") == [("a", 1, FINAL)]  # b's window is still open
    # event time runs past b's window (closes at 1100) once an impression of 1100 + lateness arrives
    assert emitted([*arrivals, imp("c", 1199)], "window") == [("a", 1, FINAL)]
    assert emitted([*arrivals, imp("c", 1200)], "window") == [("a", 1, FINAL), ("b", 0, FINAL)]


def test_a_click_at_the_windows_edge_counts_one_past_it_is_late():
    on_edge = join_all([imp("a", 0), click("a", W)], cfg("window"))
    assert [(e.label, e.kind) for e in on_edge.emitted] == [(1, FINAL)]
    past = join_all([imp("a", 0), click("a", W + 1), imp("z", 5000)], cfg("window"))
    assert [(e.impression_id, e.label) for e in past.emitted] == [("a", 0)]
    assert past.counts.late_clicks == 1


def test_a_duplicate_click_counts_once():
    for policy in ("window", "fake_negative", "elapsed"):
        joined = join_all([imp("a", 0), click("a", 10), click("a", 20), imp("z", 5000)], cfg(policy))
        assert sum(e.label for e in joined.emitted if e.impression_id == "a") == 1, policy
        assert joined.counts.duplicate_clicks == 1


def test_a_click_before_its_impression_is_held_and_labels_it():
    assert emitted([click("a", 50), imp("a", 0)], "window") == [("a", 1, FINAL)]
    assert emitted([click("a", 50), imp("a", 0)], "fake_negative") == [("a", 0, FAKE_NEGATIVE), ("a", 1, POSITIVE_COPY)]


def test_an_orphan_click_is_held_for_the_lateness_allowance_then_dead_lettered():
    arrivals = [click("ghost", 10), imp("a", 0), imp("b", 100)]
    assert join_all(arrivals, cfg("window")).dead == ()  # still within the allowance
    joined = join_all([*arrivals, imp("c", 10 + 2 * L)], cfg("window"))
    assert [d.click.impression_id for d in joined.dead] == ["ghost"] and joined.counts.orphan_clicks == 1
    assert joined.dead[0].reason.startswith("impression_id: no impression with this id came within")
    assert all(e.impression_id != "ghost" for e in joined.emitted)


def test_a_late_click_is_counted_and_emitted_only_as_a_correction():
    arrivals = [imp("a", 0), imp("b", 1200), click("a", 1300)]
    window = join_all(arrivals, cfg("window"))
    assert [(e.impression_id, e.label) for e in window.emitted] == [("a", 0)] and window.counts.late_clicks == 1
    fake = join_all(arrivals, cfg("fake_negative"))
    assert [(e.impression_id, e.label, e.kind) for e in fake.emitted] == [
        ("a", 0, FAKE_NEGATIVE),
        ("b", 0, FAKE_NEGATIVE),
        ("a", 1, LATE_POSITIVE),
    ]


def test_a_click_inside_the_window_that_arrives_after_it_closed_is_late_too():
    # a's window closed at event time 1000 (watermark 1100 - 100); the click's own time is inside it
    arrivals = [imp("a", 0), imp("b", 1100), click("a", 900)]
    assert emitted(arrivals, "window") == [("a", 0, FINAL)]  # the final 0 stands; no contradicting 1
    assert join_all(arrivals, cfg("window")).counts.late_clicks == 1


def test_out_of_order_impressions_within_the_allowance_join_as_usual():
    arrivals = [imp("a", 500), imp("b", 450), click("b", 1400), imp("c", 1540)]
    assert emitted(arrivals, "window") == [("b", 1, FINAL)]  # a closes at 1500: watermark 1440 has not
    assert emitted([*arrivals, imp("d", 1600)], "window") == [("b", 1, FINAL), ("a", 0, FINAL)]


def test_an_impression_older_than_the_watermark_is_emitted_at_once_under_window():
    assert emitted([imp("a", 5000), imp("old", 100)], "window") == [("old", 0, FINAL)]


def test_fake_negative_emits_at_once_and_a_positive_copy_on_a_click():
    assert emitted([imp("a", 0), imp("b", 0), click("a", 300)], "fake_negative") == [
        ("a", 0, FAKE_NEGATIVE),
        ("b", 0, FAKE_NEGATIVE),
        ("a", 1, POSITIVE_COPY),
    ]


def test_elapsed_waits_then_emits_the_label_seen_and_a_copy_for_a_later_click():
    arrivals = [imp("a", 0), imp("b", 0), click("a", 100), imp("c", E + L), click("b", 500)]
    assert emitted(arrivals, "elapsed") == [("a", 1, ELAPSED), ("b", 0, ELAPSED), ("b", 1, POSITIVE_COPY)]


def test_state_is_bounded_by_the_window_not_the_stream():
    arrivals = [imp(f"i{t}", t * 10) for t in range(2000)]  # 20 s of event time, a 1 s window
    for policy in ("window", "fake_negative", "elapsed"):
        held = join_all(arrivals, cfg(policy)).pending
        assert held <= (2 * W + 2 * L) // 10 + 2, (policy, held)  # open windows + closed ones remembered
        assert join_all(arrivals, cfg(policy), flush=True).pending == 0


def test_settings_errors_name_the_key():
    with pytest.raises(StreamError, match="stream.join.policy='oracle'"):
        JoinSettings(policy="oracle")
    with pytest.raises(StreamError, match="stream.join.elapsed_s=5.0 is longer than window_s=1.0"):
        JoinSettings(policy="elapsed", window_s=1, elapsed_s=5)
    with pytest.raises(StreamError, match="stream.join.window_s=-1"):
        JoinSettings(window_s=-1)


@st.composite
def timelines(draw):
    """Impressions in roughly increasing event time (jitter within the allowance), clicks of some
    of them after random delays (some past the window), a few orphans; arrival order by event
    time with a click's arrival at its own time."""
    n = draw(st.integers(1, 40))
    events = []
    t = 0
    for i in range(n):
        t += draw(st.integers(0, 200))
        ts = max(0, t - draw(st.integers(0, L // 2)))
        events.append((ts, 0, imp(f"i{i}", ts)))
        if draw(st.booleans()):
            delay = draw(st.integers(0, 2 * W))
            events.append((ts + delay, 1, click(f"i{i}", ts + delay)))
            if draw(st.integers(0, 9)) == 0:
                events.append((ts + delay + 1, 1, click(f"i{i}", ts + delay + 1)))  # a duplicate
    for j in range(draw(st.integers(0, 2))):
        events.append((draw(st.integers(0, t + 1)), 1, click(f"orphan{j}", 0)))
    return [arrival for _, _, arrival in sorted(events, key=lambda e: (e[0], e[1]))]


@settings(max_examples=200, deadline=None)
@given(timelines(), st.sampled_from(["window", "fake_negative", "elapsed"]))
def test_every_impression_is_emitted_first_once_and_positive_at_most_once(arrivals, policy):
    joined = join_all(arrivals, cfg(policy), flush=True)
    impressions = {a.impression_id: a for a in arrivals if isinstance(a, Impression)}
    firsts = [e.impression_id for e in joined.emitted if e.kind in FIRST_EMISSIONS]
    assert sorted(firsts) == sorted(impressions)  # each impression's first emission, exactly once
    positives = [e.impression_id for e in joined.emitted if e.label == 1]
    assert len(positives) == len(set(positives))  # a click labels its impression once
    assert set(positives) <= {a.impression_id for a in arrivals if isinstance(a, Click)}
    assert {d.click.impression_id for d in joined.dead} == {a.impression_id for a in arrivals} - set(impressions)
    if policy == "window":  # clicks arrive at their own time here, so every in-window click labels it
        clicked = {
            a.impression_id
            for a in arrivals
            if isinstance(a, Click) and a.impression_id in impressions and a.ts - impressions[a.impression_id].ts <= W
        }
        assert set(positives) == clicked
    assert joined.pending == 0


def test_the_watermark_waits_for_unread_clicks():
    """The joiner holds the watermark at the newest click read while its clicks partition is behind:
    a window does not close while a click inside it may still be unread."""
    from functools import partial

    from stream.join.policy import Cursor, put_into

    entries: dict = {}
    cursor = Cursor(cfg("window"), entries.get, partial(put_into, entries))
    cursor.frontier = 0  # clicks read up to event time 0, more to come
    cursor.impression(imp("a", 0))
    cursor.impression(imp("z", 5000))  # far past a's window, but the clicks are not
    assert cursor.take()[0] == []
    cursor.click(click("a", 900))  # came late in wall time, inside the window in event time
    cursor.frontier = None  # every click read
    cursor.fire(cursor.watermark)
    assert [(e.impression_id, e.label) for e in cursor.take()[0]] == [("a", 1)]


@settings(max_examples=200, deadline=None)
@given(timelines(), st.sampled_from(["window", "fake_negative", "elapsed"]))
def test_the_short_path_for_new_impressions_equals_on_impression(arrivals, policy):
    fast = join_all(arrivals, cfg(policy), flush=True)
    slow = join_all(arrivals, cfg(policy), flush=True, fast=False)
    assert fast == slow


def test_counts_add_up_field_by_field():
    names = [f.name for f in dataclasses.fields(Counts)]
    one = Counts(**{name: i + 1 for i, name in enumerate(names)})
    assert vars(one + one) == {name: 2 * (i + 1) for i, name in enumerate(names)}


def test_a_click_read_past_the_joins_memory_of_its_time_is_forgotten_not_an_orphan():
    """By event time only: a click read when event time is more than window + allowance past it (every
    window it could count in closed, its impression forgotten or about to be) is a forgotten click,
    with its own reason and counter; the same click read in time labels its impression."""
    in_time = join_all([imp("a", 0), click("a", 900), imp("z", 5000)], cfg("window"))
    assert [(e.impression_id, e.label) for e in in_time.emitted] == [("a", 1)]
    # read late: event time (5000 - L) is past the click (900) by more than W + L; a was forgotten
    late = join_all([imp("a", 0), imp("z", 5000), click("a", 900), imp("y", 9000)], cfg("window"))
    assert late.counts.forgotten_clicks == 1 and late.counts.orphan_clicks == 0
    assert [d.click.impression_id for d in late.dead] == ["a"] and late.dead[0].reason.startswith("ts: a late click")
    # a click behind event time by less than that, with no impression, is still held as an orphan
    held = join_all([imp("z", 2000), click("ghost", 1000), imp("y", 9000)], cfg("window"))
    assert held.counts.orphan_clicks == 1 and held.counts.forgotten_clicks == 0
