"""Challengers beside the champion (trainer/champion.py, trainer/members.py): an entry's changes and
their refusals, the budget's cheapest-first rule, the hysteresis of the choice, every member
learning exactly as it would alone, a clearly better challenger taking over, and every member
resuming from its snapshot with the champion it had."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from adstream.config import load_config
from bench.accuracy import synthetic_stream
from stream.schema import load_schema
from trainer.batch import batch_from_features
from trainer.champion import challenger_settings, choose_champion, within_budget
from trainer.errors import TrainerError
from trainer.group import Control
from trainer.members import BUDGET_FROM_STEP, Members
from trainer.settings import ModelSettings, SnapshotSettings, StoreSettings, TrainerSettings, challenger_changes
from trainer.trainer import Trainer

LR = "model.kind=lr"
ADAGRAD = "optim.sparse_optimizer=adagrad"


def small(**changes: object) -> TrainerSettings:
    settings = TrainerSettings(
        batch_size=128,
        metrics_port=0,
        model=ModelSettings(embed_dim=4, hidden=(16,)),
        store=StoreSettings(ram_bytes=1 << 26),
        challengers=(LR, ADAGRAD),
    )
    return replace(settings, **changes)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def stream():
    schema = load_schema("criteo")
    return schema, synthetic_stream(schema, 3072, 0.0).features


def batches(features, size: int = 128):
    return [batch_from_features([part], {0: i + 1}) for i, part in enumerate(features.split(size))]


def test_an_entry_becomes_typed_changes_and_a_challenger_gets_its_own_folders():
    settings = TrainerSettings(snapshot=SnapshotSettings(dir="/snaps"), challengers=())
    changes = challenger_changes(
        settings, "model.kind=lr optim.wide_lr=0.1 model.dense_norm=false model.hidden=32,16", 0
    )
    assert changes == {"model.kind": "lr", "optim.wide_lr": 0.1, "model.dense_norm": False, "model.hidden": (32, 16)}
    challenger = challenger_settings(settings, "model.kind=lr optim.wide_lr=0.1", 0)
    assert challenger.model.kind == "lr" and challenger.optim.wide_lr == 0.1
    assert challenger.challengers == () and challenger.metrics_port == 0 and challenger.learn_log == ""
    assert challenger.snapshot.dir == "/snaps/challengers/kind-lr_wide_lr-0.1"
    assert challenger.store.path == f"{settings.store.path}-kind-lr_wide_lr-0.1"
    assert challenger.batch_size == settings.batch_size and challenger.group == settings.group  # the job's own


@pytest.mark.parametrize(
    "entry, named",
    [
        ("store.kind=tiered", "not a change of trainer.model"),
        ("optim.delayed_feedback=fnw", "delayed_feedback"),
        ("model.width=3", "trainer.model has no key 'width'"),
        ("optim.lr=fast", "optim.lr='fast': expected float"),
        ("model.kind=svm", "trainer.model.kind='svm': use one of"),
        ("kind=lr", "space-separated key=value pairs"),
    ],
)
def test_a_bad_entry_is_refused_naming_the_entry_and_the_fix(entry, named):
    with pytest.raises(TrainerError, match=r"trainer\.challengers\[0\]") as refused:
        TrainerSettings(challengers=(entry,))
    assert named in str(refused.value)
    with pytest.raises(Exception, match=r"trainer\.challengers\[1\]"):  # from the command line too
        load_config(None, [f"trainer.challengers={LR},{entry}"])


def test_the_command_line_sets_the_list_or_empties_it():
    assert load_config(None, [f"trainer.challengers={LR},{ADAGRAD}"]).trainer.challengers == (LR, ADAGRAD)
    assert load_config(None, ["trainer.challengers="]).trainer.challengers == ()
    with pytest.raises(TrainerError, match="challengers_budget=1.0: the challengers' share of a step must be below 1"):
        TrainerSettings(challengers_budget=1.0)


def test_the_budget_keeps_the_cheapest_challengers_while_their_share_of_a_step_holds():
    # costs relative to the default member's step: kept cheapest first while kept / (1 + kept) <= budget
    assert within_budget([0.2, 5.0, 0.1], 0.5) == [True, False, True]
    assert within_budget([0.6, 0.5], 0.5) == [False, True]  # 0.5 / 1.5 holds; (0.5 + 0.6) / 2.1 does not
    assert within_budget([0.6, 0.5], 0.55) == [True, True]
    assert within_budget([0.01], 0.0) == [False]


def test_the_champion_changes_only_past_the_margin_and_never_for_a_lower_auc():
    assert choose_champion(0, [0.50, 0.49], [0.70, 0.70], 0.005) == 1
    assert choose_champion(0, [0.50, 0.498], [0.70, 0.70], 0.005) == 0  # within the margin: no flip on noise
    assert choose_champion(0, [0.50, 0.49], [0.70, 0.697], 0.005) == 0  # lower AUC by more than 0.002
    assert choose_champion(1, [0.50, 0.49, 0.45], [0.7, 0.7, 0.7], 0.005) == 2
    assert choose_champion(0, [math.nan, 0.49], [math.nan, 0.7], 0.005) == 1  # the serving one has no figures yet
    assert choose_champion(0, [0.50, math.nan], [0.7, math.nan], 0.005) == 0


def test_every_member_learns_exactly_as_it_would_alone(stream):
    schema, features = stream
    settings = small()
    members = Members(schema, settings)
    alone = [Trainer(schema, replace(settings, challengers=()))]
    alone += [Trainer(schema, challenger_settings(settings, text, i)) for i, text in enumerate(settings.challengers)]
    assert members.names == ["default", LR, ADAGRAD]
    for batch in batches(features):
        probs = members.learn_round(batch)
        for name, trainer in zip(members.names, alone, strict=True):
            np.testing.assert_allclose(probs[name], trainer.learn(batch).probs, rtol=0, atol=1e-7)
    assert [m.trainer.model_config.kind for m in members.members] == ["dcn", "lr", "dcn"]
    assert members.members[2].trainer.table_config.optim.name == "adagrad"


def test_a_clearly_better_challenger_takes_over_and_a_margin_keeps_the_default(stream):
    schema, features = stream
    # the default learns nothing (it predicts 0.5); the challenger is a plain learning LR
    frozen = {"optim": replace(TrainerSettings().optim, lr=0.0, wide_lr=0.0, sparse_lr=1e-12)}
    learning = "model.kind=lr optim.wide_lr=0.05 optim.lr=0.003 optim.sparse_lr=0"
    for margin, winner in ((0.005, learning), (0.9, "default")):
        members = Members(schema, small(challengers=(learning,), switch_every=512, switch_margin=margin, **frozen))
        events, switched = 0, []
        for batch in batches(features):
            members.learn_round(batch)
            events += len(batch)
            if members.review(Control(1), events, None):
                switched.append(events)
        assert members.champion.name == winner
        assert len(switched) == (winner != "default")
        if switched:
            assert switched[0] == 512  # at the first choice


def test_the_budget_stops_the_dearest_challenger_from_the_measured_seconds(stream):
    schema, features = stream
    members = Members(schema, small(challengers_budget=0.5))
    for batch in batches(features)[:BUDGET_FROM_STEP]:
        members.learn_round(batch)
    assert all(m.seconds == 0 for m in members.members)  # the clock starts after the first steps
    for batch in batches(features)[BUDGET_FROM_STEP : BUDGET_FROM_STEP + 3]:
        members.learn_round(batch)
    assert all(m.seconds > 0 for m in members.members)
    members.members[0].seconds, members.members[1].seconds, members.members[2].seconds = 1.0, 0.3, 0.9
    members.champion = members.members[2]
    members.apply_budget(Control(1), None)
    assert members.names == ["default", LR, ADAGRAD]  # as configured: the metrics' indices stay
    assert [m.name for m in members.members] == ["default", LR]
    assert members.champion.name == "default"  # a stopped member does not serve
    assert members.share == pytest.approx(0.3 / 1.3)


class Commits:
    """What snapshot_round hands the source: the offsets to commit (the Kafka side is tested in
    tests/integration/test_champion.py)."""

    def __init__(self) -> None:
        self.offsets: list[dict[int, int]] = []

    def commit(self, offsets: dict[int, int]) -> None:
        self.offsets.append(dict(offsets))


def test_every_member_resumes_from_its_snapshot_with_the_champion_it_had(stream, tmp_path: Path):
    schema, features = stream
    settings = small(snapshot=SnapshotSettings(dir=str(tmp_path / "snapshots")))
    members, every = Members(schema, settings), batches(features)
    for batch in every[:6]:
        members.learn_round(batch)
    members.champion = members.members[1]
    commits = Commits()
    path, version = members.snapshot_round(Control(1), None, commits, 6 * 128)
    assert version is None and path is not None and path.parent == tmp_path / "snapshots"
    assert commits.offsets == [{0: 6}]  # the next offset after the six learned
    for m in members.members[1:]:
        assert (Path(m.trainer.settings.snapshot.dir) / path.name / "manifest.json").exists()
    assert members.served_snapshot == Path(members.members[1].trainer.settings.snapshot.dir) / path.name

    again = Members(schema, settings)
    resumed, state, _ = again.resume(0)
    assert resumed == path and state.events == 6 * 128 and again.champion.name == LR
    following = every[6]
    before, after = members.learn_round(following), again.learn_round(following)
    for name in members.names:
        np.testing.assert_allclose(after[name], before[name], rtol=0, atol=1e-6)


def test_a_resumed_replica_keeps_only_its_own_partitions_offsets(stream, tmp_path: Path):
    """The snapshot holds the group's offsets; each resumed replica keeps its own partitions' alone,
    so the next snapshot's gather cannot overwrite a replica's fresh offset with another's stale copy
    (a third start would then read that partition again: every record learned twice)."""
    schema, features = stream
    settings = small(snapshot=SnapshotSettings(dir=str(tmp_path / "snapshots")), challengers=())
    members = Members(schema, settings)
    for batch in batches(features)[:2]:
        members.learn_round(batch)
    members.main.offsets = {0: 6, 1: 9, 2: 4}  # the group's, as gathered from three partitions' readers
    members.snapshot_round(Control(1), None, Commits(), 256)
    kept = []
    for rank in (0, 1):
        again = Members(schema, settings)
        again.resume(rank, 2)
        kept.append(again.main.offsets)
    assert kept == [{0: 6, 2: 4}, {1: 9}]


def test_the_marks_of_what_was_learned_are_snapshotted_and_every_member_resumes_them(stream, tmp_path: Path):
    """The newest source key learned per events-topic partition (trainer/replayed.py) goes into the
    snapshot beside the offsets and comes back to every member on every rank, whole (a mark only
    grows: a stale copy loses the group's max at the next snapshot)."""
    schema, features = stream
    settings = small(snapshot=SnapshotSettings(dir=str(tmp_path / "snapshots")))
    members = Members(schema, settings)
    for i, part in enumerate(features.split(128)[:3]):
        members.learn_round(batch_from_features([part], {0: i + 1}, (), {2: 1000 + i, 5: 7}))
    assert all(m.trainer.marks == {2: 1002, 5: 7} for m in members.members)
    members.snapshot_round(Control(1), None, Commits(), 3 * 128)
    for rank in (0, 1):
        again = Members(schema, settings)
        again.resume(rank, 2)
        assert [m.trainer.marks for m in again.members] == [{2: 1002, 5: 7}] * len(again.members)
