"""The ids' wide weights learned event by event inside a batch (trainer/wide.py), pinned to the
per-batch rule applied one event at a time, and to the per-batch trainer at batch size 1."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from store.configs import TableConfig
from store.ram import RamTier
from store.sparse_optim import SPARSE_OPTIMIZERS, SparseOptimConfig, sparse_step, wide_columns
from store.table import EmbeddingTable
from stream.featurizer.decode import event_from_mapping
from stream.featurizer.featurize import featurize
from stream.produce.synthetic import SyntheticConfig, SyntheticCriteo
from stream.schema import load_schema
from tests.helpers import criteo_event
from trainer.batch import Batch, batch_from_features
from trainer.settings import ModelSettings, OptimSettings, TrainerSettings
from trainer.trainer import Trainer
from trainer.wide import learn_wide, occurrences

TAGS = load_schema("criteo_tags")


def test_occurrences_group_each_events_rows_with_its_pooling_share():
    ids = np.array([[10], [11], [12]])
    starts = np.array([0, 3, 4, 4])  # event 0 has 3 list values, event 1 one, event 2 none
    batch = Batch(torch.zeros(3), torch.zeros(3, 0), ids, lists=((starts, np.array([20, 21, 22, 23])),))
    inverse = np.array([0, 1, 2, 3, 4, 5, 6])  # positions: 3 single ids, then the 4 list values
    for pooling, share in (("mean", 1 / 3), ("sum", 1.0)):
        first, rows_of, weights = occurrences(batch, (pooling,), inverse)
        np.testing.assert_array_equal(first, [0, 4, 6, 7])
        np.testing.assert_array_equal(rows_of, [0, 3, 4, 5, 1, 6, 2])
        np.testing.assert_allclose(weights, [1, share, share, share, 1, 1, 1])


@pytest.mark.parametrize("name", SPARSE_OPTIMIZERS)
def test_each_event_is_scored_after_the_earlier_events_steps(name):
    """Four events over three ids (two shared) equal the per-batch rule (store/sparse_optim.py,
    pinned to hand computations) taken once per event, each event scored with the weights so far."""
    cfg = SparseOptimConfig(name=name, lr=0.02, wide_lr=0.5, l2=0.01, wide_per_event=True)
    table = EmbeddingTable(RamTier(3 * 2, 1 << 20), TableConfig(dim=2, seed=1, init_std=0.3, optim=cfg))
    ids = np.array([[1, 2], [1, 3], [2, 3], [1, 2]])
    labels = torch.tensor([1.0, 0.0, 1.0, 1.0])
    logits = torch.tensor([0.3, -0.2, 0.1, 0.0])  # the batch's scores before any step
    lookup = table.lookup(ids)
    update = learn_wide(logits, Batch(labels, torch.zeros(4, 0), ids), lookup, cfg, (), step=3)

    wide = wide_columns(2)  # the last column of [vector | state_a | state_b]: only it is this pass's
    rows = {int(i): lookup.rows[k : k + 1].clone() for k, i in enumerate(lookup.unique_ids)}
    start = {i: float(r[0, 1]) for i, r in rows.items()}
    for event, (a, b) in enumerate(ids):
        shift = sum(float(rows[i][0, 1]) - start[i] for i in (a, b))
        assert float(update.logit_shift[event]) == pytest.approx(shift, abs=1e-6)
        g = float(torch.sigmoid(logits[event] + shift)) - float(labels[event])
        for i in (a, b):
            rows[i][:, wide] = sparse_step(rows[i], torch.tensor([[0.0, g]]), 3, cfg)[:, wide]
    for k, i in enumerate(lookup.unique_ids):
        torch.testing.assert_close(update.columns[k], rows[int(i)][0, wide], atol=1e-6, rtol=1e-5)
    assert float(update.logit_shift[1]) != 0.0  # event 1 shares id 1 with event 0: its score moved


def tagged_batches(n: int) -> list[Batch]:
    """Single-event batches of the tags schema, each event's tags distinct (one step per occurrence
    is then the same as the summed gradient)."""
    events, _ = SyntheticCriteo(TAGS, SyntheticConfig(seed=5)).generate(n)
    out = []
    for i, event in enumerate(events):
        tags = list(dict.fromkeys(event.get("tags") or [])) or [f"{i:x}"]
        decoded = event_from_mapping({**criteo_event(i), **event, "tags": tags}, TAGS)
        out.append(batch_from_features([featurize([decoded], TAGS)]))
    return out


@pytest.mark.parametrize("name", SPARSE_OPTIMIZERS)
def test_at_batch_size_one_the_per_event_path_is_the_per_batch_path(name):
    base = TrainerSettings(
        batch_size=1,
        threads=1,
        model=ModelSettings(embed_dim=3, hidden=(8,)),
        optim=OptimSettings(sparse_optimizer=name),
    )
    trainers = [Trainer(TAGS, replace(base, optim=replace(base.optim, wide_per_event=on))) for on in (True, False)]
    batches = tagged_batches(40)
    probs = [[float(t.learn(b).probs[0]) for b in batches] for t in trainers]
    np.testing.assert_allclose(probs[0], probs[1], atol=1e-5)
    (ids, rows), (ref_ids, ref_rows) = (t.table.export() for t in trainers)
    np.testing.assert_array_equal(ids, ref_ids)
    torch.testing.assert_close(rows, ref_rows, atol=1e-5, rtol=1e-4)


def test_a_larger_batch_learns_inside_itself():
    """The same 64 events as one batch: per event, a later event with an id seen earlier in the
    batch is scored differently from the per-batch path (which scores all 64 before any step)."""
    base = TrainerSettings(threads=1, model=ModelSettings(kind="lr"))
    events, _ = SyntheticCriteo(load_schema("criteo"), SyntheticConfig(seed=2)).generate(64)
    schema = load_schema("criteo")
    batch = batch_from_features([featurize([event_from_mapping(e, schema) for e in events], schema)])
    on, off = (Trainer(schema, replace(base, optim=replace(base.optim, wide_per_event=v))) for v in (True, False))
    p_on, p_off = on.learn(batch).probs, off.learn(batch).probs
    assert p_on[0] == pytest.approx(p_off[0], abs=1e-6)  # the first event: nothing learned before it
    assert np.abs(p_on[1:] - p_off[1:]).max() > 1e-3
