"""Rows sharded over the ranks (trainer/shard.py) on real torch.distributed (gloo) processes, pinned
to known answers: 2 sharded ranks == 2 replicated ranks in synchronous data parallel fed the same
batches (dense weights, optimizer state and every row); 2 sharded ranks fed the same batch == one
process alone; each rank stores only the ids it owns, about half of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from store.placement import shard_of
from stream.schema import load_schema
from tests.test_merge import assert_states_close, make_batches, settings, state
from trainer.group import launch_local
from trainer.replica import Trainer
from trainer.shard import exchange


def without_rows(s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in s.items() if k not in ("ids", "rows")}


def rows_of(states: list[dict[str, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The union of the ranks' shards, sorted by id."""
    ids = np.concatenate([s["ids"] for s in states])
    rows = np.concatenate([s["rows"] for s in states])
    order = np.argsort(ids)
    return ids[order], rows[order]


# --- what each rank runs (module level: the processes are spawned) ---------------------------
def sharded_vs_synchronous(sparse: str, lists: bool, idle_round: bool) -> tuple[dict, dict, int]:
    import torch.distributed as dist

    schema = load_schema("criteo_tags" if lists else "criteo")
    rank = dist.get_rank()
    batches: list = make_batches(seed=rank, steps=4, lists=lists)
    if idle_round and rank == 1:
        batches[2] = None  # a round where this rank has no batch: it still takes part
    syncing, sharded = Trainer(schema, settings("adam", sparse)), Trainer(schema, settings("adam", sparse))
    sent = 0
    for batch in batches:
        expected, _ = syncing.learn_sync(batch)
        probs, stats = sharded.learn_sharded(batch)
        if batch is not None:
            np.testing.assert_allclose(probs, expected, atol=1e-6)  # scored with the same rows
        sent += stats.sparse_bytes
    return state(syncing), state(sharded), sent


def same_batch_on_every_rank() -> dict:
    trainer = Trainer(load_schema("criteo"), settings("adam", "ftrl"))
    for batch in make_batches(seed=7, steps=5):
        trainer.learn_sharded(batch)
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


# --- the tests -------------------------------------------------------------------------------
def test_exchange_moves_parts_of_any_length_including_none():
    assert launch_local(exchange_case, 2) == [[[], [4.0, 5.0]], [[1.0, 2.0, 3.0], [6.0]]]


@pytest.mark.parametrize(
    ("sparse", "lists", "idle_round"), [("ftrl", False, False), ("adam", False, True), ("adagrad", True, False)]
)
def test_sharded_ranks_equal_synchronous_replicas_on_the_same_batches(sparse, lists, idle_round):
    results = launch_local(sharded_vs_synchronous, 2, sparse, lists, idle_round)
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


def test_sharded_ranks_fed_the_same_batch_equal_one_process():
    shard0, shard1 = launch_local(same_batch_on_every_rank, 2)
    alone = Trainer(load_schema("criteo"), settings("adam", "ftrl"))
    for batch in make_batches(seed=7, steps=5):
        alone.learn(batch)
    expected = state(alone)
    assert_states_close(without_rows(shard0), without_rows(expected))
    ids, rows = rows_of([shard0, shard1])
    np.testing.assert_array_equal(ids, expected["ids"])
    np.testing.assert_allclose(rows, expected["rows"], atol=1e-6, rtol=1e-5)
