"""trainer.schedule.decide: the training loop's decisions, case by case, and over whole runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainer.schedule import Actions, LoopState, Round, Schedule, decide

TWO = Schedule(world=2, merge_every_steps=4, snapshot_every_steps=8, log_every_steps=5)


# (name, state before, summed round, schedule) -> (state after, actions)
CASES = [
    (
        "a batch: learn, count rounds and events (round 1: an early report)",
        LoopState(rounds=0, events=10),
        Round(batches=1, events=7, idle=1),
        TWO,
        LoopState(rounds=1, events=17, since_merge=1),
        Actions(learn=True, merge=False, snapshot=False, report=True, stop=False),
    ),
    (
        "no batch, not everyone idle: wait",
        LoopState(rounds=3, events=30, since_merge=3),
        Round(batches=0, events=0, idle=1),
        TWO,
        LoopState(rounds=3, events=30, since_merge=3),
        Actions(learn=False, merge=False, snapshot=False, report=False, stop=False),
    ),
    (
        "k-th learning round: merge, no snapshot yet",
        LoopState(rounds=3, since_merge=3),
        Round(batches=2, events=8, idle=0),
        TWO,
        LoopState(rounds=4, events=8, since_merge=0),
        Actions(learn=True, merge=True, snapshot=False, report=True, stop=False, sync=True),
    ),
    (
        "merge at snapshot_every_steps: merge then snapshot",
        LoopState(rounds=7, since_merge=3),
        Round(batches=2, events=8, idle=0),
        TWO,
        LoopState(rounds=8, events=8, since_merge=0, last_snapshot_round=8, last_publication_round=8),
        Actions(learn=True, merge=True, snapshot=True, report=False, stop=False, sync=True),
    ),
    (
        "snapshot due but no merge due: wait for the sync point",
        LoopState(rounds=1, since_merge=1),
        Round(batches=2, events=8, idle=0, snapshot_due=True),
        TWO,
        LoopState(rounds=2, events=8, since_merge=2),
        Actions(learn=True, merge=False, snapshot=False, report=True, stop=False),
    ),
    (
        "rank 0's merge clock: merge early, with the snapshot clock snapshot too",
        LoopState(rounds=1, since_merge=1),
        Round(batches=1, events=4, idle=0, merge_due=True, snapshot_due=True),
        TWO,
        LoopState(rounds=2, events=4, since_merge=0, last_snapshot_round=2, last_publication_round=2),
        Actions(learn=True, merge=True, snapshot=True, report=True, stop=False, sync=True),
    ),
    (
        "merge clock with nothing learned since the last merge: nothing to do",
        LoopState(rounds=4, since_merge=0),
        Round(batches=0, events=0, idle=0, merge_due=True),
        TWO,
        LoopState(rounds=4, since_merge=0),
        Actions(learn=False, merge=False, snapshot=False, report=False, stop=False),
    ),
    (
        "everyone idle, no batch: stop with a final merge and snapshot",
        LoopState(rounds=5, since_merge=1, last_snapshot_round=0),
        Round(batches=0, events=0, idle=2),
        TWO,
        LoopState(rounds=5, since_merge=0, last_snapshot_round=5, last_publication_round=5),
        Actions(learn=False, merge=True, snapshot=True, report=False, stop=True, sync=True),
    ),
    (
        "stop right after a snapshot: merge, but no second snapshot of the same rounds",
        LoopState(rounds=8, since_merge=0, last_snapshot_round=8, last_publication_round=8),
        Round(batches=0, events=0, idle=2),
        TWO,
        LoopState(rounds=8, since_merge=0, last_snapshot_round=8, last_publication_round=8),
        Actions(learn=False, merge=True, snapshot=False, report=False, stop=True, sync=True),
    ),
    (
        "max_steps reached: stop after learning this round",
        LoopState(rounds=9, since_merge=1),
        Round(batches=2, events=8, idle=0),
        Schedule(world=2, merge_every_steps=4, snapshot_every_steps=100, log_every_steps=5, max_steps=10),
        LoopState(rounds=10, events=8, since_merge=0, last_snapshot_round=10, last_publication_round=10),
        Actions(learn=True, merge=True, snapshot=True, report=True, stop=True, sync=True),
    ),
    (
        "max_events counts the job's events, a resumed snapshot's included",
        LoopState(rounds=0, events=95),
        Round(batches=1, events=8, idle=0),
        Schedule(world=1, merge_every_steps=4, snapshot_every_steps=100, log_every_steps=5, max_events=100),
        LoopState(rounds=1, events=103, since_merge=0, last_snapshot_round=1, last_publication_round=1),
        Actions(learn=True, merge=True, snapshot=True, report=True, stop=True, sync=True),
    ),
    (
        "k = 0 (synchronous): every round is a sync point, never a merge",
        LoopState(rounds=2, since_merge=0),
        Round(batches=1, events=8, idle=1),
        Schedule(world=2, merge_every_steps=0, snapshot_every_steps=3, log_every_steps=3),
        LoopState(rounds=3, events=8, since_merge=0, last_snapshot_round=3, last_publication_round=3),
        Actions(learn=True, merge=False, snapshot=True, report=True, stop=False, sync=True),
    ),
    (
        "report every log_every_steps learning rounds",
        LoopState(rounds=4, since_merge=1),
        Round(batches=2, events=8, idle=0),
        TWO,
        LoopState(rounds=5, events=8, since_merge=2),
        Actions(learn=True, merge=False, snapshot=False, report=True, stop=False),
    ),
    (
        "rank 0's publish clock makes a sync point with a delta",
        LoopState(rounds=2, since_merge=1),
        Round(batches=2, events=8, idle=0, publish_due=True),
        TWO,
        LoopState(rounds=3, events=8, since_merge=0, last_publication_round=3),
        Actions(learn=True, merge=True, snapshot=False, report=False, stop=False, sync=True, publish=True),
    ),
    (
        "no delta when nothing was learned since the last sync point",
        LoopState(rounds=3),
        Round(batches=0, events=0, idle=0, publish_due=True),
        TWO,
        LoopState(rounds=3),
        Actions(learn=False, merge=False, snapshot=False, report=False, stop=False),
    ),
    (
        "stop right after a snapshot with the publish clock due: no empty delta",
        LoopState(rounds=8, since_merge=0, last_snapshot_round=8, last_publication_round=8),
        Round(batches=0, events=0, idle=2, publish_due=True),
        TWO,
        LoopState(rounds=8, since_merge=0, last_snapshot_round=8, last_publication_round=8),
        Actions(learn=False, merge=True, snapshot=False, report=False, stop=True, sync=True),
    ),
    (
        "a snapshot (a base) in the same round replaces the delta",
        LoopState(rounds=9, since_merge=1),
        Round(batches=2, events=8, idle=0, publish_due=True),
        TWO,
        LoopState(rounds=10, events=8, since_merge=0, last_snapshot_round=10, last_publication_round=10),
        Actions(learn=True, merge=True, snapshot=True, report=True, stop=False, sync=True),
    ),
]


@pytest.mark.parametrize(("name", "state", "summed", "schedule", "after", "actions"), CASES, ids=[c[0] for c in CASES])
def test_decide(
    name: str, state: LoopState, summed: Round, schedule: Schedule, after: LoopState, actions: Actions
) -> None:
    assert decide(state, summed, schedule) == (after, actions)


def test_control_vector_round_trip() -> None:
    one = Round.vector(events=5, idle=False, merge_due=True, snapshot_due=False, publish_due=True)
    none = Round.vector(events=None, idle=True, merge_due=False, snapshot_due=True)
    summed = [a + b for a, b in zip(one, none, strict=True)]
    assert Round.from_sum(summed) == Round(
        batches=1, events=5, idle=1, merge_due=True, snapshot_due=True, publish_due=True
    )


@pytest.mark.parametrize("k", [1, 3, 16])
def test_a_run_merges_every_k_rounds_and_at_the_end(k: int) -> None:
    schedule = Schedule(world=2, merge_every_steps=k, snapshot_every_steps=10, log_every_steps=7, max_steps=25)
    state, merges, snapshots, stops = LoopState(), [], [], []
    for _ in range(25):
        state, act = decide(state, Round(batches=2, events=4, idle=0), schedule)
        if act.merge:
            merges.append(state.rounds)
        if act.snapshot:
            snapshots.append(state.rounds)
        if act.stop:
            stops.append(state.rounds)
    assert merges == sorted({*range(k, 25, k), 25})
    assert stops == [25]
    assert snapshots[-1] == 25  # the final state is always in a snapshot
    gaps = [b - a for a, b in zip([0, *snapshots], snapshots, strict=False)]
    assert all(g >= 10 for g in gaps[:-1])  # no snapshot before snapshot_every_steps rounds, but the last
    assert state.events == 25 * 4


@pytest.mark.parametrize("rounds", [6, 7, 12])
def test_every_publication_carries_rounds_the_previous_one_did_not(rounds: int) -> None:
    """Publish clock due at every round (a short publish_every_s): a delta or a base at every
    sync point; a delta always carries rounds learned since the previous publication (none at
    the idle stop after a final snapshot); a base may repeat them (it is a recovery snapshot)."""
    schedule = Schedule(world=2, merge_every_steps=3, snapshot_every_steps=6, log_every_steps=100)
    state, published = LoopState(), [0]
    for i in range(rounds + 3):  # the learning rounds, then idle ones until everyone is idle
        learning = i < rounds
        summed = Round(batches=2 if learning else 0, events=8 if learning else 0, idle=0 if i < rounds + 2 else 2)
        state, act = decide(state, replace(summed, publish_due=True), schedule)
        if act.publish:
            assert state.rounds > published[-1], f"an empty delta at round {state.rounds}"
        if act.snapshot or act.publish:
            published.append(state.rounds)
        if act.stop:
            break
    assert act.stop
    assert published[-1] == rounds  # the last rounds learned reach serving
    assert published == sorted(published) and len(published) > rounds // 2


def test_a_short_run_reports_often_enough_to_draw_a_curve():
    """8 rounds and log_every_steps 20 gave one MLflow point (#29 item 5): rounds 1, 2, 4, 8 report,
    then every 20th as before."""
    schedule = Schedule(world=1, merge_every_steps=0, snapshot_every_steps=1000, log_every_steps=20)
    state, reported = LoopState(), []
    for _ in range(60):
        state, act = decide(state, Round(batches=1, events=10, idle=0), schedule)
        if act.report:
            reported.append(state.rounds)
    assert reported == [1, 2, 4, 8, 16, 20, 40, 60]
