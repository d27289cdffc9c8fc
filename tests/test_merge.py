"""Replica merging on real torch.distributed (gloo) processes, pinned to known answers:
plain SGD merged every step == synchronous data parallel; Adam replicas fed the same batches ==
one process; merged parameters, moments and rows == a hand computation over each replica's own."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from store.configs import TableConfig
from store.ram import RamTier
from store.table import EmbeddingTable
from stream.featurizer.featurize import FIELD_SHIFT, missing_id
from stream.schema import load_schema
from trainer.batch import Batch
from trainer.group import launch_local
from trainer.layouts import Sharded, Synchronous
from trainer.merge import average_rows
from trainer.settings import GroupSettings, ModelSettings, OptimSettings, StoreSettings, TrainerSettings
from trainer.trainer import Trainer

SCHEMA = load_schema("criteo")
FIELDS, DENSE = SCHEMA.num_sparse, SCHEMA.num_dense


def make_batches(seed: int, steps: int = 4, size: int = 32, vocab: int = 60, lists: bool = False) -> list[Batch]:
    """Small batches over a small vocabulary: replicas overlap on some ids, each also has its own.
    lists: every event also has 0-3 values of one list field (criteo_tags' "tags")."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = rng.integers(0, vocab, size=(size, FIELDS)) + np.arange(FIELDS) * 1000
        ids[:, 0] = 10**6 + seed * 1000 + rng.integers(0, 5, size=size)  # ids only this seed's replica sees
        labels = torch.from_numpy((rng.random(size) < 0.3).astype(np.float32))
        dense = torch.from_numpy(rng.normal(size=(size, DENSE)).astype(np.float32))
        tags: tuple[tuple[np.ndarray, np.ndarray], ...] = ()
        if lists:
            counts = rng.integers(0, 4, size=size)
            field = FIELDS << FIELD_SHIFT
            values = [field | rng.integers(0, 40, size=c) if c else np.array([missing_id(FIELDS)]) for c in counts]
            starts = np.concatenate([[0], np.cumsum([len(v) for v in values])]).astype(np.int64)
            tags = ((starts, np.concatenate(values).astype(np.int64)),)
        out.append(Batch(labels, dense, ids.astype(np.int64), lists=tags))
    return out


def settings(
    optimizer: str, sparse: str | None = None, per_event: bool = False, row_merge: str = "mean", **store: object
) -> TrainerSettings:
    """Dense `optimizer` ("adam" or "sgd"); the sparse one is `sparse`, else the same as the dense.
    per_event: the ids' wide weights learn event by event (optim.wide_per_event); off by default
    here, where the per-batch rule is pinned; the tests that compare with it turn it on.
    row_merge: "mean" here, whose equivalences (merged every step == synchronous, replicas fed the
    same batches == one process) these tests pin; the "deltas" tests pin that rule. The dense part
    merges as "merge" (the powersgd exchange has tests of its own)."""
    lr = 0.05 if optimizer == "sgd" else 0.01
    optim = OptimSettings(
        optimizer=optimizer,
        sparse_optimizer=sparse or optimizer,
        lr=lr,
        sparse_lr=lr,
        wide_lr=lr,
        wide_per_event=per_event,
    )
    return TrainerSettings(
        model=ModelSettings(embed_dim=4, hidden=(8,)),
        optim=optim,
        store=StoreSettings(**store),  # type: ignore[arg-type]
        group=GroupSettings(row_merge=row_merge, dense_exchange="merge"),  # the dense merge these tests pin
        threads=1,
    )


def state(trainer: Trainer) -> dict[str, np.ndarray]:
    """Dense weights, the dense optimizer's state (Adam moments, Adagrad sums) and every row, as
    numpy (picklable, comparable)."""
    out = {f"w.{k}": v.detach().cpu().numpy().copy() for k, v in trainer.model.state_dict().items()}
    for i, p in enumerate(trainer.model.parameters()):
        for key, value in trainer.optimizer.state.get(p, {}).items():
            if key != "step":
                out[f"{key}.{i}"] = value.cpu().numpy().copy()
    ids, rows = trainer.table.export()
    out["ids"], out["rows"] = ids, rows.cpu().numpy()
    return out


def assert_states_close(a: dict[str, np.ndarray], b: dict[str, np.ndarray], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], atol=atol, rtol=1e-5, err_msg=key)


# --- what each replica runs (module level: the processes are spawned) ------------------------
def merge_every_step_vs_sync(optimizer: str, per_event: bool = False) -> tuple[dict, dict]:
    import torch.distributed as dist

    schema = load_schema("criteo")
    batches = make_batches(seed=dist.get_rank())
    merging, syncing = (Trainer(schema, settings(optimizer, per_event=per_event)) for _ in range(2))
    for batch in batches:
        merging.learn(batch)
        merging.merge()
        Synchronous(syncing).step(batch)
    return state(merging), state(syncing)


def deltas_same_batch(sparse: str, power: float, steps: int) -> dict:
    from dataclasses import replace

    group = GroupSettings(row_merge="deltas", row_deltas_power=power)
    trainer = Trainer(load_schema("criteo"), replace(settings("sgd", sparse), group=group))
    for batch in make_batches(seed=3, steps=steps):
        trainer.learn(batch)
    trainer.merge()
    return state(trainer)


DELTAS_WRITTEN = {0: [1, 2, 4], 1: [2, 3, 4, 5]}  # the rows each replica steps; 5 is new on replica 1


def deltas_config() -> TableConfig:
    from store.sparse_optim import SparseOptimConfig

    return TableConfig(dim=2, optim=SparseOptimConfig(name="sgd", lr=1.0))


def deltas_grad(rank: int, i: int) -> np.ndarray:
    return np.array([0.5 + rank + i, 0.25 * (rank + 1) * i])


def deltas_merge_case(power: float) -> dict[int, np.ndarray]:
    import torch.distributed as dist

    rank = dist.get_rank()
    table = EmbeddingTable(RamTier(6, 1 << 20), deltas_config())
    start = np.array([1, 2, 3, 4], dtype=np.int64)
    table.put(start, torch.tensor([[float(i), -float(i), 0, 0, 0, 0] for i in start]), step=1)
    table.keep_anchors()
    ids = np.array(DELTAS_WRITTEN[rank], dtype=np.int64)
    table.apply_grad(ids, torch.tensor(np.stack([deltas_grad(rank, i) for i in ids]), dtype=torch.float32), step=2)
    table.mark_touched(ids)  # as a shard owner does after its step
    average_rows(table, table.take_touched(), step=2, deltas_power=power)
    ids, rows = table.export()
    return {int(i): r.numpy() for i, r in zip(ids, rows)}


def deltas_and_mean(sparse: str) -> tuple[dict, dict]:
    from dataclasses import replace

    import torch.distributed as dist

    out = []
    for group in (GroupSettings(row_merge="deltas", row_deltas_power=1.0), GroupSettings(row_merge="mean")):
        trainer = Trainer(load_schema("criteo"), replace(settings("adam", sparse), group=group))
        for i, batch in enumerate(make_batches(seed=dist.get_rank(), steps=4), start=1):
            trainer.learn(batch)
            if i % 2 == 0:
                trainer.merge()
        out.append(state(trainer))
    return out[0], out[1]


def same_batches(k: int, sparse: str) -> dict:
    trainer = Trainer(load_schema("criteo"), settings("adam", sparse, per_event=True))
    for i, batch in enumerate(make_batches(seed=7, steps=6), start=1):
        trainer.learn(batch)
        if i % k == 0:
            trainer.merge()
    return state(trainer)


def same_batches_with_a_list_field(k: int) -> dict:
    trainer = Trainer(load_schema("criteo_tags"), settings("adam", "ftrl", per_event=True))
    for i, batch in enumerate(make_batches(seed=7, steps=6, lists=True), start=1):
        trainer.learn(batch)
        if i % k == 0:
            trainer.merge()
    return state(trainer)


def local_steps_then_merge() -> tuple[dict, dict]:
    import torch.distributed as dist

    trainer = Trainer(load_schema("criteo"), settings("adam"))
    for batch in make_batches(seed=dist.get_rank(), steps=3):
        trainer.learn(batch)
    before = state(trainer)
    stats = trainer.merge()
    assert stats.rows > 0 and stats.dense_bytes > 0
    return before, state(trainer)


def shared_dense_steps() -> tuple[dict, dict, int, int]:
    """Three rounds on batches of this replica's own, the dense gradients shared every step
    (dense_exchange "powersgd"), one of them without a batch; then a merge."""
    import torch.distributed as dist

    base = settings("adam", "ftrl")
    trainer = Trainer(
        load_schema("criteo"),
        replace(base, group=replace(base.group, dense_exchange="powersgd", dense_rank=2, merge_every_steps=4)),
    )
    batches = make_batches(seed=dist.get_rank(), steps=3)
    for i, batch in enumerate(batches):
        trainer.learn_round(None if (i == 1 and dist.get_rank() == 1) else batch)
    before = state(trainer)
    stats = trainer.merge()
    return before, state(trainer), stats.dense_bytes, trainer.bytes_sent


def admission_counts_after_a_merge() -> tuple[np.ndarray, np.ndarray]:
    import torch.distributed as dist

    trainer = Trainer(load_schema("criteo"), settings("adam", "ftrl", min_count=3, admission_bytes=1 << 16))
    for batch in make_batches(seed=dist.get_rank(), steps=2):
        trainer.learn(batch)
    assert trainer.table.sketch is not None
    before = trainer.table.sketch.counts.copy()
    trainer.merge()
    return before, trainer.table.sketch.counts.copy()


def rows_of(rank: int, ids: list[int]) -> tuple[np.ndarray, torch.Tensor]:
    """Row i on replica r is filled with 10 * r + i, moments included: every source is visible."""
    keys = np.array(ids, dtype=np.int64)
    return keys, torch.tensor([[10.0 * rank + i] * 6 for i in ids])


HELD = {0: [1, 2, 3, 5, 7], 1: [2, 3, 4, 6, 7]}  # id 1 expired on replica 1; 5 new on 0 only; 6 on 1 only
TOUCHED = {0: [1, 2, 3, 5], 1: [2, 4]}  # 3 updated on 0 only (1 holds the old copy); 6 and 7 untouched


def sparse_merge_case() -> dict[int, np.ndarray]:
    import torch.distributed as dist

    rank = dist.get_rank()
    table = EmbeddingTable(RamTier(6, 1 << 20), TableConfig(dim=2))
    table.put(*rows_of(rank, HELD[rank]), step=1)
    merged, sent = average_rows(table, np.array(TOUCHED[rank], dtype=np.int64), step=2)
    assert merged == 5 and sent > 0
    ids, rows = table.export()
    return {int(i): r.numpy() for i, r in zip(ids, rows)}


# --- the tests -------------------------------------------------------------------------------
@pytest.mark.parametrize("per_event", [False, True])
def test_sgd_merged_every_step_equals_synchronous_data_parallel(per_event):
    """With the wide part per event too: sync averages the replicas' per-event changes of the wide
    weights, as averaging the replicas' rows after a step does."""
    (merge0, sync0), (merge1, sync1) = launch_local(merge_every_step_vs_sync, 2, "sgd", per_event)
    assert_states_close(merge0, sync0)
    assert_states_close(merge1, sync1)
    assert_states_close(merge0, merge1, atol=0)  # replicas are identical after every merge
    # the replicas really learned different things before merging: not a trivial equality
    alone = Trainer(load_schema("criteo"), settings("sgd"))
    for batch in make_batches(seed=0):
        alone.learn(batch)
    assert not np.allclose(state(alone)["w.bias"], merge0["w.bias"], atol=1e-7)


def test_adam_merge_every_step_differs_from_synchronous_adam():
    """The issue's caveat, pinned: with Adam, averaging after each local step is not sync DP."""
    (merge0, sync0), _ = launch_local(merge_every_step_vs_sync, 2, "adam")
    assert not np.allclose(merge0["w.mlp.0.weight"], sync0["w.mlp.0.weight"], atol=1e-6)


@pytest.mark.parametrize("sparse", ["adam", "adagrad", "ftrl"])
@pytest.mark.parametrize("k", [1, 3])
def test_replicas_fed_the_same_batches_equal_one_process(k, sparse):
    """Whatever the sparse optimizer keeps in its rows is averaged with them."""
    replicas = launch_local(same_batches, 2, k, sparse)
    alone = Trainer(load_schema("criteo"), settings("adam", sparse, per_event=True))
    for batch in make_batches(seed=7, steps=6):
        alone.learn(batch)
    for replica in replicas:
        assert_states_close(replica, state(alone))


def test_replicas_with_a_list_field_fed_the_same_batches_equal_one_process():
    """List values' rows are rows: merged like any other (criteo_tags, pooled "tags")."""
    replicas = launch_local(same_batches_with_a_list_field, 2, 2)
    alone = Trainer(load_schema("criteo_tags"), settings("adam", "ftrl", per_event=True))
    for batch in make_batches(seed=7, steps=6, lists=True):
        alone.learn(batch)
    tag_rows = (state(alone)["ids"] >> 33) == FIELDS
    assert tag_rows.sum() > 20  # the list field's values really have rows
    for replica in replicas:
        assert_states_close(replica, state(alone))


def test_a_merge_shares_admission_counts_so_every_replica_admits_the_same_ids():
    (before0, after0), (before1, after1) = launch_local(admission_counts_after_a_merge, 2)
    np.testing.assert_array_equal(after0, after1)
    np.testing.assert_array_equal(after0.astype(np.int64), before0.astype(np.int64) + before1.astype(np.int64))
    assert before0.sum() > 0 and not np.array_equal(before0, before1)


def test_replicas_sharing_dense_gradients_take_the_same_dense_steps_and_merge_only_rows():
    (before0, after0, merged0, sent0), (before1, _, _, _) = launch_local(shared_dense_steps, 2)
    dense = [key for key in before0 if key.startswith(("w.", "exp_avg", "sum."))]
    assert dense and all(np.array_equal(before0[key], before1[key]) for key in dense)  # before any merge
    assert not np.array_equal(before0["rows"], before1["rows"]) or before0["ids"].shape != before1["ids"].shape
    assert merged0 == 0 and sent0 > 0  # the merge sent rows only; the steps sent compressed gradients
    for key in dense:
        np.testing.assert_array_equal(after0[key], before0[key])  # nothing dense left to average


def test_merged_parameters_and_moments_match_a_hand_computation():
    (before0, after0), (before1, after1) = launch_local(local_steps_then_merge, 2)
    assert_states_close(after0, after1, atol=0)
    for key in before0:
        if key.startswith(("w.", "exp_avg", "sum.")):
            np.testing.assert_allclose(after0[key], (before0[key] + before1[key]) / 2, atol=1e-6, err_msg=key)
    # rows: averaged over the replicas that updated them; a row only one replica has keeps its value
    rows0 = dict(zip(before0["ids"].tolist(), before0["rows"]))
    rows1 = dict(zip(before1["ids"].tolist(), before1["rows"]))
    after = dict(zip(after0["ids"].tolist(), after0["rows"]))
    assert set(after) == set(rows0) | set(rows1)
    only0 = set(rows0) - set(rows1)
    assert only0, "each replica has ids of its own"
    for key, row in after.items():
        held = [r[key] for r in (rows0, rows1) if key in r]
        np.testing.assert_allclose(row, np.mean(held, axis=0), atol=1e-6)


def test_sparse_merge_disjoint_overlapping_new_and_expired_rows():
    replica0, replica1 = launch_local(sparse_merge_case, 2)

    def value(rank: int, i: int) -> float:
        return 10.0 * rank + i

    expected_merged = {
        1: value(0, 1),  # expired on replica 1: replica 0's row, and replica 1 holds it again
        2: (value(0, 2) + value(1, 2)) / 2,  # overlapping: the mean
        3: value(0, 3),  # updated on 0 only: replica 1's stale copy does not dilute it
        4: value(1, 4),  # only on replica 1
        5: value(0, 5),  # new on replica 0 only: kept as learned, not pulled towards zero
    }
    for replica, rank in ((replica0, 0), (replica1, 1)):
        for i, v in expected_merged.items():
            np.testing.assert_allclose(replica[i], np.full(6, v), err_msg=f"replica {rank} row {i}")
        np.testing.assert_allclose(replica[7], np.full(6, value(rank, 7)))  # untouched: not merged
    assert 6 not in replica0 and 6 in replica1  # untouched rows do not travel


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize(
    ("layout", "per_event"),
    [("synchronous", False), ("synchronous", True), ("sharded", False), ("sharded", True)],
)
def test_a_lone_synchronous_step_equals_a_local_step(optimizer, layout, per_event):
    """Without a group every collective is the identity: a synchronous step == a local one, rows included (the
    wide part per event as well); and sharded over a group of one, the shard is the whole table."""
    local, sync = (Trainer(SCHEMA, settings(optimizer, per_event=per_event)) for _ in range(2))
    for batch in make_batches(seed=3):
        expected = local.learn(batch).probs
        probs, stats = (Synchronous if layout == "synchronous" else Sharded)(sync).step(batch)
        np.testing.assert_allclose(probs, expected, atol=1e-6)
        assert stats.bytes == 0
    assert_states_close(state(sync), state(local))


def test_an_average_over_touchers_counts_only_the_ranks_that_sent_a_row():
    from trainer.merge import counted, touchers_mean

    a = counted(torch.tensor([[2.0, 4.0]]), torch.tensor([0]), 3)  # rank a has row 0
    b = counted(torch.tensor([[4.0, 8.0], [1.0, 1.0]]), torch.tensor([0, 2]), 3)  # rank b rows 0 and 2
    mean, count = touchers_mean(a + b)
    assert count.tolist() == [2.0, 0.0, 1.0]
    assert mean.tolist() == [[3.0, 6.0], [0.0, 0.0], [1.0, 1.0]]  # row 1: no one sent it


@pytest.mark.parametrize(("power", "steps"), [(0.0, 2), (0.5, 2), (0.5, 1)])
@pytest.mark.parametrize("sparse", ["sgd", "ftrl"])
def test_the_deltas_rule_adds_the_replicas_changes_to_the_row_they_started_from(sparse, power, steps):
    """Two replicas learn the same batches from the same start: under row_merge "deltas" each row
    moves by the sum of both changes / 2^power (power 0: both changes; the mean would be one);
    FTRL's weights follow its merged z and n. After a single step the changes are one correction
    each replica made: their mean (power 1), not their sum."""
    from store.sparse_optim import column_lr, ftrl_weights, join_rows, split_rows

    replicas = launch_local(deltas_same_batch, 2, sparse, power, steps)
    alone = Trainer(load_schema("criteo"), settings("sgd", sparse))
    for batch in make_batches(seed=3, steps=steps):
        alone.learn(batch)
    ids, rows = alone.table.export()
    start = alone.table.fresh_rows(ids)  # every row is new: it started from its initial row
    expected = start + 2 ** (1 - (power if steps > 1 else 1.0)) * (rows - start)
    if sparse == "ftrl":
        cfg, dim = alone.table.config.optim, alone.table.dim
        _, z, n = split_rows(expected, dim)
        weights = ftrl_weights(z, (n + cfg.initial_accumulator).sqrt(), column_lr(cfg, dim), cfg)
        expected = join_rows(weights, z, n)
    for replica in replicas:
        np.testing.assert_array_equal(replica["ids"], ids)
        np.testing.assert_allclose(replica["rows"], expected.numpy(), rtol=1e-5, atol=1e-6)
        if steps > 1:
            assert not np.allclose(replica["rows"], rows.numpy())  # not the mean: that is one replica's rows


def test_the_deltas_rule_matches_a_hand_computation_on_a_tiny_table():
    """Rows 1..4 start alike on both replicas (the last merge); replica 0 steps rows 1, 2 and 4,
    replica 1 rows 2, 3 and 4 (SGD at rate 1: a row moves by minus its gradient). Merged: a row one
    replica wrote takes its whole change; one both wrote, the sum of the changes / 2^power; row 5,
    new on replica 1, starts from its initial row."""
    power = 0.5
    replica0, replica1 = launch_local(deltas_merge_case, 2, power)
    start = {i: np.array([float(i), -float(i)]) for i in (1, 2, 3, 4)}
    change = {r: {i: -deltas_grad(r, i) for i in DELTAS_WRITTEN[r]} for r in (0, 1)}
    fresh = EmbeddingTable(RamTier(6, 1 << 20), deltas_config()).fresh_rows(np.array([5]))[0, :2].numpy()
    expected = {
        1: start[1] + change[0][1],
        2: start[2] + (change[0][2] + change[1][2]) / 2**power,
        3: start[3] + change[1][3],
        4: start[4] + (change[0][4] + change[1][4]) / 2**power,
        5: fresh + change[1][5],
    }
    for replica in (replica0, replica1):
        assert sorted(replica) == [1, 2, 3, 4, 5]
        for i, row in expected.items():
            np.testing.assert_allclose(replica[i][:2], row, atol=1e-6, err_msg=f"row {i}")
            np.testing.assert_allclose(replica[i][2:], 0.0)  # SGD keeps no state


def capped_merge_case(power: float) -> dict[int, np.ndarray]:
    """Every rank steps row 1 (SGD at rate 1); rank 0 also row 2; then a "deltas" merge."""
    import torch.distributed as dist

    rank = dist.get_rank()
    table = EmbeddingTable(RamTier(6, 1 << 20), deltas_config())
    table.put(np.array([1, 2]), torch.zeros((2, 6)), step=1)
    table.keep_anchors()
    ids = np.array([1, 2] if rank == 0 else [1], dtype=np.int64)
    table.apply_grad(ids, torch.tensor(np.stack([deltas_grad(rank, i) for i in ids]), dtype=torch.float32), step=2)
    table.mark_touched(ids)
    average_rows(table, table.take_touched(), step=2, deltas_power=power)
    ids, rows = table.export()
    return {int(i): r.numpy() for i, r in zip(ids, rows)}


@pytest.mark.parametrize("power", [0.0, 0.5])
def test_the_deltas_rule_never_moves_a_row_more_than_twice_its_writers_mean_change(power):
    """4 writers of row 1: the sum of their changes / 4^power would be 4x (power 0) or 2x (0.5)
    their mean change; past MAX_DELTAS_GAIN (2) a hot row that every writer corrected by most of the
    same error would be pushed further past the answer each merge, so 2x is the most it moves.
    Row 2, one writer: its whole change."""
    from trainer.merge import MAX_DELTAS_GAIN

    mean_change = -np.mean([deltas_grad(r, 1) for r in range(4)], axis=0)
    for replica in launch_local(capped_merge_case, 4, power):
        expected_gain = min(4 ** (1 - power), MAX_DELTAS_GAIN)
        np.testing.assert_allclose(replica[1][:2], expected_gain * mean_change, rtol=1e-6)
        np.testing.assert_allclose(replica[2][:2], -deltas_grad(0, 2), rtol=1e-6)
    assert MAX_DELTAS_GAIN == 2.0


@pytest.mark.parametrize("sparse", ["sgd", "adagrad"])
def test_the_deltas_rule_at_power_1_is_the_mean_rule(sparse):
    """Power 1 adds the writers' mean change to where they started: the mean of their rows, which
    is row_merge "mean" (FTRL aside: "deltas" re-derives its weights from the merged z and n)."""
    for deltas, mean in launch_local(deltas_and_mean, 2, sparse):
        assert_states_close(deltas, mean)
