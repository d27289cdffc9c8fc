"""Members: the trainer's own configuration and its challengers (trainer.challengers), learning the
same batches in the same process (each replica of a group holds every member), and the one of them
that serves: the champion (the rules: trainer/champion.py).

    learn_round / merge / idle    every member, in the same order on every replica (collectives)
    review                        at a report round: the budget once (which challengers go on),
                                  then every switch_every events the champion; True on a switch
    snapshot_round                every member's recovery snapshot, the challengers' first, then the
                                  default member's (the one a restart looks for); the champion's
                                  base publication; the offsets committed once all are durable
    delta_round                   the champion's delta; the others forget their changes
    resume                        every member from the snapshots of the default member's newest step

After a switch the publisher forgets its base (trainer/loop.py), so the next publication is the
new champion's base (at the next delta tick, or the next snapshot when deltas are off): no delta
ever crosses from one member to another.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import Gauge

from stream.schema import Schema
from trainer.champion import (
    DEFAULT_MEMBER,
    challenger_settings,
    choose_champion,
    member_slug,
    within_budget,
)
from trainer.merge import MergeStats
from trainer.metrics import ProgressiveMetrics, merged_summary
from trainer.replayed import newest_marks
from trainer.schedule import LoopState
from trainer.settings import TrainerSettings
from trainer.snapshot import MANIFEST, latest_snapshot
from trainer.source import reads
from trainer.trainer import Trainer

if TYPE_CHECKING:
    from trainer.batch import Batch
    from trainer.group import Control
    from trainer.publish import Publisher
    from trainer.source import BatchSource

log = logging.getLogger("adstream.trainer")
MEMBER_LOGLOSS = Gauge("adstream_trainer_member_window_logloss", "window logloss of each member", ["member"])
CHAMPION = Gauge("adstream_trainer_champion", "1 for the member being served, 0 for the others", ["member"])
BUDGET_FROM_STEP = 5  # the budget's clock starts after this step (the first steps pay for lazy set-up)


@dataclass
class Member:
    name: str  # "default" (the trainer's own configuration) or the challenger's entry
    slug: str  # the name in folders and metric names
    trainer: Trainer
    seconds: float = 0.0  # wall seconds learning since the budget's clock started


class Members:
    def __init__(self, schema: Schema, settings: TrainerSettings) -> None:
        self.settings = settings
        self.members = [Member(DEFAULT_MEMBER, DEFAULT_MEMBER, Trainer(schema, settings))]
        if settings.challengers_budget > 0:
            for index, text in enumerate(settings.challengers):
                challenger = Trainer(schema, challenger_settings(settings, text, index), counted=False)
                self.members.append(Member(text, member_slug(text), challenger))
        self.names = [m.name for m in self.members]  # as configured: a member's index in metrics
        self.champion = self.members[0]
        self.next_choice = settings.switch_every  # the job's events at the next choice
        self.budget_checked = len(self.members) == 1
        self.share = 0.0  # the challengers' measured share of a step (0 until the budget is checked)
        self.learn_seconds = 0.0  # every member's learning, what the job's samples/s divides by
        self.merge_seconds = 0.0  # every member's merges
        self.served_snapshot: Path | None = None  # the champion's recovery snapshot at the last snapshot round

    @property
    def main(self) -> Trainer:
        """The default member: its steps, offsets and events are the job's."""
        return self.members[0].trainer

    # --- every member, in order -----------------------------------------------------------
    def learn_round(self, batch: Batch | None) -> dict[str, np.ndarray | None]:
        """Every member's part of the round; {member name: its predictions (B,) made before it learned}."""
        probs = {}
        for m in self.members:
            started = time.perf_counter()
            probs[m.name] = m.trainer.learn_round(batch)
            spent = time.perf_counter() - started
            m.seconds += spent
            self.learn_seconds += spent
        if self.main.step == BUDGET_FROM_STEP and batch is not None:
            for m in self.members:
                m.seconds = 0.0
        return probs

    def merge(self) -> MergeStats:
        """Every member's k-step merge (collectives); the default member's figures."""
        started = time.perf_counter()
        stats = [m.trainer.merge() for m in self.members]
        self.merge_seconds += time.perf_counter() - started
        return stats[0]

    def idle(self) -> None:
        for m in self.members:
            m.trainer.idle()

    @property
    def prefetches(self) -> bool:
        return any(m.trainer.prefetches for m in self.members)

    def prefetch(self, batch: Batch) -> None:
        for m in self.members:
            if m.trainer.prefetches:
                m.trainer.prefetch(batch)

    # --- which of them serves ---------------------------------------------------------------
    def review(self, control: Control, events: int, publisher: Publisher | None) -> bool:
        """At a report round (every replica): the budget, once its clock has run log_every_steps
        steps, then the champion every switch_every events. True when the champion changed."""
        before = self.champion
        if not self.budget_checked and self.main.step >= BUDGET_FROM_STEP + self.settings.log_every_steps:
            self.apply_budget(control, publisher)
        if len(self.members) > 1 and events >= self.next_choice:
            self.next_choice = events + self.settings.switch_every
            figures = [[m.trainer.metrics.summary()[k] for m in self.members] for k in ("window_logloss", "window_auc")]
            everyone = np.array(control.gather(figures), dtype=np.float64)  # (replicas, 2, members)
            with np.errstate(all="ignore"):
                losses, aucs = np.nanmean(everyone, axis=0) if len(everyone) > 1 else everyone[0]
            index = self.members.index(self.champion)
            chosen = choose_champion(index, losses.tolist(), aucs.tolist(), self.settings.switch_margin)
            self.champion = self.members[chosen]
        if self.champion is before:
            return False
        log.warning("champion: %s now serves (was %s) at %d events", self.champion.name, before.name, events)
        if publisher is not None:
            publisher.set_tag("champion", self.champion.name)
        return True

    def apply_budget(self, control: Control, publisher: Publisher | None) -> None:
        """Keep the challengers the budget allows (cheapest first, trainer/champion.py); the others
        stop learning and leave the group (on every replica alike: the seconds are the group's)."""
        self.budget_checked = True
        seconds = np.sum(control.gather([m.seconds for m in self.members]), axis=0)
        if seconds[0] <= 0:
            return
        costs = (seconds[1:] / seconds[0]).tolist()
        keep = [True, *within_budget(costs, self.settings.challengers_budget)]
        kept_cost = sum(c for c, k in zip(costs, keep[1:], strict=True) if k)
        self.share = kept_cost / (1 + kept_cost)
        dropped = [(m, c) for m, c, k in zip(self.members[1:], costs, keep[1:], strict=True) if not k]
        if dropped:
            text = ", ".join(f"{m.name!r} ({c:.2f}x the default's step)" for m, c in dropped)
            log.warning(
                "trainer.challengers_budget=%s: %s stop learning (raise the budget to keep them)",
                self.settings.challengers_budget,
                text,
            )
            if publisher is not None:
                publisher.set_tag("challengers_dropped", text[:5000])
        self.members = [m for m, k in zip(self.members, keep, strict=True) if k]
        if self.champion not in self.members:
            self.champion = self.members[0]

    def metrics(self, control: Control) -> dict[str, float]:
        """Every member's figures for MLflow (a collective): member/<slug>/{progressive,window}_{auc,logloss},
        `champion` (its index in the configured list, 0 = default), the challengers' share of a step."""
        out: dict[str, float] = {
            "champion": float(self.names.index(self.champion.name)),
            "challengers_share": self.share,
        }
        for m in self.members:
            merged = merged_summary(m.trainer.metrics)
            window = m.trainer.metrics.summary()
            figures = {
                "progressive_auc": merged["progressive_auc"],
                "progressive_logloss": merged["progressive_logloss"],
                "window_auc": window["window_auc"],
                "window_logloss": window["window_logloss"],
            }
            out.update({f"member/{m.slug}/{key}": value for key, value in figures.items()})
            MEMBER_LOGLOSS.labels(m.slug).set(window["window_logloss"])
            CHAMPION.labels(m.slug).set(float(m is self.champion))
        return out

    # --- snapshots and publications ---------------------------------------------------------
    def snapshot_round(
        self, control: Control, publisher: Publisher | None, source: BatchSource, events: int
    ) -> tuple[Path | None, str | None]:
        """Every member's recovery snapshot of the same offsets (challengers first: a restart looks
        for the default member's newest and finds theirs beside it), the champion's publication;
        every replica then commits its offsets, once all are durable. (path of the default member's
        snapshot, registry version) on rank 0."""
        offsets, marks = self.group_positions(control)
        extra: dict[str, object] = {"champion": self.champion.name}
        if publisher is not None:
            extra["mlflow_run_id"] = publisher.run_id
        version = None
        for m in [*self.members[1:], self.members[0]]:
            serves = m is self.champion
            path, published = m.trainer.checkpoints.base_round(
                control, events, offsets, extra, serves, publisher, marks
            )
            version = published or version
            if serves:
                self.served_snapshot = path
        control.barrier()  # every snapshot is durable before any replica commits its offsets
        source.commit(offsets)
        for m in self.members:
            m.trainer.checkpoints.prune()
        return path, version

    def delta_round(self, control: Control, publisher: Publisher | None, events: int) -> None:
        """The champion's next delta (with every replica's offsets, as a base: what serving says it
        learned up to); every other member forgets its changes (collectives all)."""
        offsets, _ = self.group_positions(control)
        for m in self.members:
            serves = publisher if m is self.champion else None
            m.trainer.checkpoints.delta_round(control, serves, events, {"champion": self.champion.name}, offsets)

    def group_positions(self, control: Control) -> tuple[dict[int, int], dict[int, int]]:
        """Every replica's next batches offsets (they read disjoint partitions) and the group's
        marks (trainer/replayed.py: the newest per source partition). A collective."""
        offsets: dict[int, int] = {}
        gathered = control.gather((self.main.offsets, self.main.marks))
        for part, _ in gathered:
            offsets.update(part)
        return offsets, newest_marks([marks for _, marks in gathered])

    def resume(self, rank: int, world: int = 1) -> tuple[Path | None, LoopState, str | None]:
        """Restore the default member's newest complete snapshot, if any, and every challenger's of
        the same step (one missing, e.g. a challenger added since: it starts afresh at that step);
        the champion it names serves again. Each replica keeps the offsets of its own partitions
        only (source.reads): the snapshot holds the whole group's, and one kept for another
        replica's partition would go stale and, gathered into the next snapshot, overwrite that
        replica's. The marks (trainer/replayed.py) are kept whole: they only grow, and the group's
        are gathered as the newest of each. (its path, the loop's counters, its MLflow run)."""
        resumed = latest_snapshot(self.settings.snapshot.dir)
        if resumed is None:
            return None, LoopState(), None
        main = self.main
        manifest = main.checkpoints.restore(resumed)
        for m in self.members[1:]:
            path = Path(m.trainer.settings.snapshot.dir) / resumed.name
            if (path / MANIFEST).exists():
                m.trainer.checkpoints.restore(path)
            else:
                log.warning("challenger %r has no snapshot at %s: it starts afresh", m.name, path)
                m.trainer.step = m.trainer.merged_step = main.step
                m.trainer.events, m.trainer.offsets, m.trainer.marks = main.events, dict(main.offsets), dict(main.marks)
        for m in self.members:
            m.trainer.offsets = {p: o for p, o in m.trainer.offsets.items() if reads(rank, world, p)}
            if rank != 0:  # rank 0 carries the job's counts (events, the metrics' sums): the others add from zero
                m.trainer.events = 0
                m.trainer.metrics = ProgressiveMetrics(window=self.settings.metrics_window)
        named = str(manifest.extra.get("champion") or DEFAULT_MEMBER)
        self.champion = next((m for m in self.members if m.name == named), self.members[0])
        log.warning("replica %d resumes from %s (step %d), %s serving", rank, resumed, main.step, self.champion.name)
        self.next_choice = manifest.events + self.settings.switch_every
        return resumed, LoopState(events=manifest.events), str(manifest.extra.get("mlflow_run_id") or "") or None
