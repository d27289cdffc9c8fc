"""Rows sharded over the ranks (trainer/shard.py) on real torch.distributed (gloo) processes, pinned
to known answers: 2 sharded ranks == 2 replicated ranks in synchronous data parallel fed the same
batches (dense weights, optimizer state and every row); 2 sharded ranks fed the same batch == one
process alone; each rank stores only the ids it owns, about half of them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from serving.loader import load_served_model
from store.placement import shard_of
from stream.schema import load_schema
from tests.test_merge import assert_states_close, make_batches, settings, state
from trainer.errors import TrainerError
from trainer.group import Control, launch_local
from trainer.layouts import Sharded, SharedDense, Synchronous
from trainer.settings import GroupSettings
from trainer.shard import exchange
from trainer.snapshot import read_embeddings, read_manifest
from trainer.trainer import Trainer


def sharded_settings(sparse: str = "ftrl", row_merge: str = "mean"):
    from dataclasses import replace

    group = GroupSettings(merge_every_steps=0, row_merge=row_merge)
    return replace(settings("adam", sparse), shard_within_node=True, group=group)


def without_rows(s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in s.items() if k not in ("ids", "rows")}


def rows_of(states: list[dict[str, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The union of the ranks' shards, sorted by id."""
    ids = np.concatenate([s["ids"] for s in states])
    rows = np.concatenate([s["rows"] for s in states])
    order = np.argsort(ids)
    return ids[order], rows[order]


# --- what each rank runs (module level: the processes are spawned) ---------------------------
def sharded_vs_synchronous(sparse: str, lists: bool, idle_round: bool, per_event: bool) -> tuple[dict, dict, int]:
    import torch.distributed as dist

    schema = load_schema("criteo_tags" if lists else "criteo")
    rank = dist.get_rank()
    batches: list = make_batches(seed=rank, steps=4, lists=lists)
    if idle_round and rank == 1:
        batches[2] = None  # a round where this rank has no batch: it still takes part
    syncing, sharded = (Trainer(schema, settings("adam", sparse, per_event=per_event)) for _ in range(2))
    sent = 0
    for batch in batches:
        expected, _ = Synchronous(syncing).step(batch)
        probs, stats = Sharded(sharded).step(batch)
        if batch is not None:
            np.testing.assert_allclose(probs, expected, atol=1e-6)  # scored with the same rows
        sent += stats.sparse_bytes
    return state(syncing), state(sharded), sent


def same_batch_on_every_rank(per_event: bool) -> dict:
    trainer = Trainer(load_schema("criteo"), settings("adam", "ftrl", per_event=per_event))
    for batch in make_batches(seed=7, steps=5):
        Sharded(trainer).step(batch)
    return state(trainer)


def exchange_case() -> list[list[float]]:
    import torch.distributed as dist

    rank = dist.get_rank()
    # rank 0 sends nothing to itself and 3 values to rank 1; rank 1 sends 2 to rank 0 and 1 to itself
    parts = (
        [torch.zeros(0), torch.tensor([1.0, 2.0, 3.0])]
        if rank == 0
        else [torch.tensor([4.0, 5.0]), torch.tensor([6.0])]
    )
    received, _ = exchange(parts)
    return [r.tolist() for r in received]


def snapshot_delta_and_restore(root: str) -> dict:
    """Sharded ranks write a snapshot and a base publication (each rank its own rows' file) and a
    delta of every rank's changes (on rank 0); fresh sharded ranks restore the snapshot and keep
    their own ids."""
    import torch.distributed as dist

    rank, schema = dist.get_rank(), load_schema("criteo")
    syncing, sharded = Trainer(schema, settings("adam", "ftrl")), Trainer(schema, sharded_settings())
    batches = make_batches(seed=rank, steps=4)
    for batch in batches[:3]:
        Synchronous(syncing).step(batch)
        Sharded(sharded).step(batch)
    # every rank writes its own rows' file (nobody gathers the table), rank 0 the rest
    path = sharded.checkpoints.save(root, manifest=sharded.checkpoints.manifest())
    publication = sharded.checkpoints.publish_to(f"{root}/publications", sharded.checkpoints.manifest())
    syncing.table.take_changed(), sharded.table.take_changed()
    after_three = state(syncing)
    Synchronous(syncing).step(batches[3])
    Sharded(sharded).step(batches[3])
    changes = sharded.changes_since_publication(Control(dist.get_world_size()))
    out: dict = {"sync3": after_three, "sync": state(syncing), "sync_changed": syncing.table.take_changed()}
    if changes is not None:
        table, changed = changes
        out["delta_ids"], out["delta_rows"] = changed, table.stored_rows(changed)[0].numpy()
    dist.barrier()  # rank 0's snapshot is on disk
    restored = Trainer(schema, sharded_settings())
    snapshot = sorted(__import__("pathlib").Path(root).glob("step-*"))[-1]
    restored.checkpoints.restore(snapshot)
    out["snapshot"] = str(snapshot) if path is not None else None
    out["publication"] = str(publication) if publication is not None else None
    out["restored"] = state(restored)
    return out


def two_nodes_merging(k: int, row_merge: str, dense: str = "merge") -> dict:
    """4 ranks as 2 nodes of 2 (LOCAL_WORLD_SIZE=2): both ranks of node n learn node n's batches
    (seed n) over rows sharded within the node; the nodes merge every k steps, shard by shard.
    dense "powersgd": the dense gradients also averaged between the nodes every step, compressed."""
    import os
    from dataclasses import replace

    import torch.distributed as dist

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    base = sharded_settings(row_merge=row_merge)
    group = replace(base.group, merge_every_steps=k, dense_exchange=dense, dense_rank=2)
    trainer = Trainer(load_schema("criteo"), replace(base, group=group))
    assert trainer.nodes == 2 and (trainer.compressor is not None) == (dense == "powersgd")
    for i, batch in enumerate(make_batches(seed=dist.get_rank() // 2, steps=6), start=1):
        Sharded(trainer).step(batch)
        if i % k == 0:
            stats = trainer.merge()
            assert stats.rows > 0 and stats.bytes > 0
    return state(trainer)


def replicas_merging(k: int, row_merge: str, dense: str = "merge") -> dict:
    """The reference: 2 replicas (one per node) learning seed-rank batches, merged every k steps
    (dense "powersgd": their dense gradients averaged every step, compressed, as learn_step does)."""
    from dataclasses import replace

    import torch.distributed as dist

    base = settings("adam", "ftrl", row_merge=row_merge)
    group = replace(base.group, merge_every_steps=k, dense_exchange=dense, dense_rank=2)
    trainer = Trainer(load_schema("criteo"), replace(base, group=group))
    for i, batch in enumerate(make_batches(seed=dist.get_rank(), steps=6), start=1):
        if dense == "powersgd":
            SharedDense(trainer).learn(batch)
        else:
            trainer.learn(batch)
        if i % k == 0:
            trainer.merge()
    return state(trainer)


# --- the tests -------------------------------------------------------------------------------
def test_exchange_moves_parts_of_any_length_including_none():
    assert launch_local(exchange_case, 2) == [[[], [4.0, 5.0]], [[1.0, 2.0, 3.0], [6.0]]]


@pytest.mark.parametrize(
    ("sparse", "lists", "idle_round", "per_event"),
    [
        ("ftrl", False, False, False),
        ("adam", False, True, False),
        ("adagrad", True, False, False),
        ("ftrl", True, True, True),  # the wide part per event: its states travel with the rows and changes
        ("adam", False, False, True),
    ],
)
def test_sharded_ranks_equal_synchronous_replicas_on_the_same_batches(sparse, lists, idle_round, per_event):
    results = launch_local(sharded_vs_synchronous, 2, sparse, lists, idle_round, per_event)
    (sync0, shard0, sent0), (sync1, shard1, _) = results
    assert_states_close(without_rows(shard0), without_rows(sync0))
    assert_states_close(without_rows(shard1), without_rows(sync1))
    # the replicated ranks each hold every row; the sharded ones hold one owner's share each
    np.testing.assert_array_equal(sync0["ids"], sync1["ids"])
    ids, rows = rows_of([shard0, shard1])
    np.testing.assert_array_equal(ids, sync0["ids"])
    np.testing.assert_allclose(rows, sync0["rows"], atol=1e-6, rtol=1e-5)
    for rank, shard in enumerate((shard0, shard1)):
        assert (shard_of(shard["ids"], 2) == rank).all()
        assert 0.35 < len(shard["ids"]) / len(ids) < 0.65  # per-rank rows ~ table / ranks
    assert sent0 > 0


@pytest.mark.parametrize("per_event", [False, True])
def test_sharded_ranks_fed_the_same_batch_equal_one_process(per_event):
    shard0, shard1 = launch_local(same_batch_on_every_rank, 2, per_event)
    alone = Trainer(load_schema("criteo"), settings("adam", "ftrl", per_event=per_event))
    for batch in make_batches(seed=7, steps=5):
        alone.learn(batch)
    expected = state(alone)
    assert_states_close(without_rows(shard0), without_rows(expected))
    ids, rows = rows_of([shard0, shard1])
    np.testing.assert_array_equal(ids, expected["ids"])
    np.testing.assert_allclose(rows, expected["rows"], atol=1e-6, rtol=1e-5)


def test_snapshots_and_deltas_of_sharded_rows_hold_every_rank_s_rows_and_restore_into_shards(tmp_path):
    (first, second) = launch_local(snapshot_delta_and_restore, 2, str(tmp_path))
    assert second["snapshot"] is None and second["publication"] is None  # rank 0 completes the folders
    # one rows file per rank, each holding what its rank owns (at the snapshot: after 3 steps)
    snapshot = Path(first["snapshot"])
    assert read_manifest(snapshot).shards == 2 and not (snapshot / "embeddings.safetensors").exists()
    for rank in (0, 1):
        part = load_file(str(snapshot / f"embeddings-{rank:05d}-of-00002.safetensors"))["ids"].numpy()
        assert len(part) and (shard_of(part, 2) == rank).all()
    # together (read_embeddings joins the files) == the replicated rows after 3 steps
    written = read_embeddings(first["snapshot"])
    ids = written["ids"].numpy()
    assert len(ids) > 100
    np.testing.assert_array_equal(ids, first["sync3"]["ids"])
    np.testing.assert_allclose(written["vectors"].numpy(), first["sync3"]["rows"][:, :5], atol=1e-6, rtol=1e-5)
    # restored: each rank holds exactly its owned share of the snapshot, rows as written
    for rank, out in enumerate((first, second)):
        mine = ids[shard_of(ids, 2) == rank]
        np.testing.assert_array_equal(out["restored"]["ids"], mine)
        np.testing.assert_allclose(out["restored"]["rows"][:, :5], written["vectors"].numpy()[shard_of(ids, 2) == rank])
    np.testing.assert_array_equal(np.sort(np.concatenate([first["restored"]["ids"], second["restored"]["ids"]])), ids)
    # the delta: every rank's changed rows, == what the replicated run changed in that step
    np.testing.assert_array_equal(first["delta_ids"], first["sync_changed"])
    sync_rows = dict(zip(first["sync"]["ids"].tolist(), first["sync"]["rows"]))
    np.testing.assert_allclose(
        first["delta_rows"], np.stack([sync_rows[i] for i in first["delta_ids"].tolist()]), atol=1e-6
    )
    assert "delta_ids" not in second  # only rank 0 writes
    # the base publication: the same rows, vectors only, in two files; serving loads them whole
    served = load_served_model(first["publication"], "1", load_schema("criteo"))
    np.testing.assert_array_equal(np.sort(served.table.tier.all_ids()), ids)
    assert set(read_embeddings(first["publication"])) == {"ids", "vectors"}


def test_sharding_needs_no_admission_yet():
    from dataclasses import replace

    with pytest.raises(TrainerError, match="min_count = 1"):
        replace(sharded_settings(), store=replace(sharded_settings().store, min_count=2))


@pytest.mark.parametrize(("row_merge", "dense"), [("mean", "merge"), ("deltas", "merge"), ("deltas", "powersgd")])
def test_two_nodes_of_sharded_ranks_merging_every_k_steps_equal_two_merging_replicas(row_merge, dense):
    """2 nodes x 2 ranks: within a node the rows are sharded and steps synchronous (the node acts
    as one process on its batches); between the nodes the k-step merge of replicas, shard by shard,
    by either rule (under "deltas" each shard owner keeps its rows' anchors), and the dense part
    merged or, under "powersgd", its gradients compressed between the nodes every step."""
    ranks = launch_local(two_nodes_merging, 4, 3, row_merge, dense)
    replicas = launch_local(replicas_merging, 2, 3, row_merge, dense)
    for node, replica in enumerate(replicas):
        mine = ranks[2 * node : 2 * node + 2]
        for rank in mine:
            assert_states_close(without_rows(rank), without_rows(replica))
        ids, rows = rows_of(mine)
        np.testing.assert_array_equal(ids, replica["ids"])
        np.testing.assert_allclose(rows, replica["rows"], atol=1e-6, rtol=1e-5)
        for local, rank in enumerate(mine):
            assert (shard_of(rank["ids"], 2) == local).all()
