"""What a group of replicas does each round: learn, merge, snapshot, report, stop. Pure.

Replicas move in rounds. In each round every replica takes at most one batch, then all of them
sum a small control vector (`Round`): how many replicas hold a batch, their events, how many are
idle, and whether rank 0's clocks say a merge or a snapshot is due. `decide` turns that sum and
the loop's counters (`LoopState`) into the round's `Actions`. Every replica calls it with the same
sum, so every replica takes the same decisions at the same round and no collective deadlocks.
The training loop (loop.py) and `bench merge` both follow this one schedule.

Rules:
  - a round in which some replica holds a batch is a learning round (replicas without a batch
    still join a synchronous step, see layouts.Synchronous);
  - stop when every replica is idle and none holds a batch, or at max_steps rounds, or once the
    job has learned max_events events;
  - a sync point (replicas hold the same model) comes after k learning rounds, when rank 0's clock
    says so, or at the stop; at a sync point the replicas merge (k > 0; with k = 0 every step is
    already synchronous, so there is nothing to merge);
  - a snapshot is taken only at a sync point with new rounds since the last one, when
    snapshot_every_steps rounds have passed, rank 0's clock says so, or at the stop; it is a
    recovery snapshot and a base publication for serving;
  - rank 0's publish clock (publish_every_s) makes a sync point too, where a delta publication
    is sent (the rows changed since the last publication), unless a snapshot is taken there or
    nothing was learned since the last publication (the stop round after a snapshot);
  - report metrics every log_every_steps learning rounds, and at rounds 1, 2, 4, 8... before the
    first of those, so a short run draws a curve too (the loop also reports once at the end).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Schedule:
    """The settings the decisions follow (from TrainerSettings and the run's limits)."""

    world: int  # replicas in the group
    merge_every_steps: int  # k; 0 = synchronous data parallel (nothing to merge)
    snapshot_every_steps: int  # learning rounds between snapshots
    log_every_steps: int  # learning rounds between metric reports
    max_steps: int | None = None  # stop after this many learning rounds
    max_events: int | None = None  # stop once the job has learned this many events


@dataclass(frozen=True)
class Round:
    """The control vector of one round, summed over replicas."""

    batches: int  # replicas holding a batch
    events: int  # events in those batches
    idle: int  # replicas that have had no batch for idle_exit_s
    merge_due: bool = False  # rank 0's clock: merge_every_s has passed since the last merge
    snapshot_due: bool = False  # rank 0's clock: snapshot_every_s has passed since the last snapshot
    publish_due: bool = False  # rank 0's clock: publish_every_s has passed since the last publication

    @staticmethod
    def vector(
        events: int | None, idle: bool, merge_due: bool, snapshot_due: bool, publish_due: bool = False
    ) -> list[float]:
        """One replica's contribution; `events` is None without a batch."""
        flags = (idle, merge_due, snapshot_due, publish_due)
        return [float(events is not None), float(events or 0), *(float(f) for f in flags)]

    @classmethod
    def from_sum(cls, summed: list[float]) -> Round:
        batches, events, idle, merge_due, snapshot_due, publish_due = summed
        return cls(int(batches), int(events), int(idle), merge_due > 0, snapshot_due > 0, publish_due > 0)


@dataclass(frozen=True)
class LoopState:
    """The loop's counters (the same on every replica)."""

    rounds: int = 0  # learning rounds so far (this run)
    events: int = 0  # events the job has learned, including those of a resumed snapshot
    since_merge: int = 0  # learning rounds since the last sync point
    last_snapshot_round: int = 0  # `rounds` at the last snapshot
    last_publication_round: int = 0  # `rounds` at the last snapshot or delta (what serving has)


@dataclass(frozen=True)
class Actions:
    learn: bool  # a learning round (replicas with a batch learn it; k = 0: every replica steps)
    merge: bool  # average the replicas' models now (k > 0 at a sync point)
    snapshot: bool  # take a snapshot now (after the merge)
    report: bool  # log metrics now
    stop: bool  # leave the loop after this round
    sync: bool = False  # a sync point (the clocks of merge_every_s restart)
    publish: bool = False  # send a delta publication now (after the merge)


def decide(state: LoopState, summed: Round, schedule: Schedule) -> tuple[LoopState, Actions]:
    """The next counters and this round's actions (the rules in the module docstring)."""
    learn = summed.batches > 0
    if learn:
        state = replace(
            state, rounds=state.rounds + 1, events=state.events + summed.events, since_merge=state.since_merge + 1
        )
    stop = (
        (summed.idle == schedule.world and not learn)
        or bool(schedule.max_steps and state.rounds >= schedule.max_steps)
        or bool(schedule.max_events and state.events >= schedule.max_events)
    )
    due = state.since_merge >= max(schedule.merge_every_steps, 1) or summed.merge_due or summed.publish_due
    sync = stop or (state.since_merge > 0 and due)
    since_snapshot = state.rounds - state.last_snapshot_round
    snapshot = (
        sync and since_snapshot > 0 and (stop or since_snapshot >= schedule.snapshot_every_steps or summed.snapshot_due)
    )
    news = state.rounds > state.last_publication_round  # learned since serving's last publication
    publish = sync and summed.publish_due and not snapshot and news
    if sync:
        state = replace(
            state,
            since_merge=0,
            last_snapshot_round=state.rounds if snapshot else state.last_snapshot_round,
            last_publication_round=state.rounds if snapshot or publish else state.last_publication_round,
        )
    report = learn and (state.rounds % schedule.log_every_steps == 0 or _early(state.rounds, schedule.log_every_steps))
    merge = sync and schedule.merge_every_steps > 0
    return state, Actions(
        learn=learn, merge=merge, snapshot=snapshot, report=report, stop=stop, sync=sync, publish=publish
    )


def _early(rounds: int, every: int) -> bool:
    """Round 1, 2, 4, 8... below `every`: the first reports of a run come sooner."""
    return rounds < every and rounds & (rounds - 1) == 0
