import numpy as np
import torch

from store.configs import TableConfig
from store.ram import RamTier
from store.sparse_optim import SparseOptimConfig
from store.table import EmbeddingTable
from tests.helpers import random_feature_batch
from trainer.batch import Batch, batch_from_features
from trainer.metrics import ProgressiveMetrics, auc_exact, logloss
from trainer.model import CtrModel, ModelConfig
from trainer.step import predict, train_step


def small(seed: int = 0):
    config = ModelConfig(num_fields=39, num_dense=13, embed_dim=4, hidden=(16,), seed=seed, kind="deepfm")
    table = EmbeddingTable(
        RamTier(3 * config.row_dim, 1 << 24), TableConfig(dim=config.row_dim, optim=SparseOptimConfig("adam", lr=0.05))
    )
    model = CtrModel(config)
    return model, torch.optim.Adam(model.parameters(), lr=0.01), table


def fixed_batch(n: int = 64) -> Batch:
    fb = random_feature_batch(n, seed=1)
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 50, size=fb.ids.shape) + (np.arange(39) << 33)[None, :]
    return Batch(torch.from_numpy(fb.labels), torch.from_numpy(fb.dense), ids.astype(np.int64))


def test_deepfm_shapes_and_seeded_init():
    model, _, _ = small()
    logits = model(torch.zeros(8, 39, 5), torch.zeros(8, 13))
    assert logits.shape == (8,)
    other = CtrModel(ModelConfig(39, 13, 4, (16,), seed=0, kind="deepfm"))
    for a, b in zip(model.parameters(), other.parameters()):  # buffers hold the dense statistics seen
        assert torch.equal(a, b)


def test_each_family_builds_the_parts_its_table_entry_names():
    import pytest

    from trainer.errors import TrainerError
    from trainer.model import FAMILIES, Family

    for kind, family in FAMILIES.items():
        model = CtrModel(ModelConfig(39, 13, 4, (16,), kind=kind))
        assert (hasattr(model, "cross"), hasattr(model, "mlp")) == (family.cross, family.mlp), kind
        rows, dense = torch.randn(8, 39, 5), torch.randn(8, 13)
        wide = model.bias + rows[..., 4].sum(dim=1) + model.dense_linear(model.norm.eval()(dense)).squeeze(1)
        model.eval()
        added = model(rows, dense) - wide  # what the family adds to the wide part (its MLP head starts at 0)
        assert bool(added.abs().max() > 1e-4) == family.fm, kind
    with pytest.raises(TrainerError, match="cross layers feed an MLP"):
        Family(fm=False, cross=True, mlp=False, embed_dim=8, sparse_lr=0.1)


def test_fm_term_is_pairwise_dot_products():
    config = ModelConfig(num_fields=3, num_dense=1, embed_dim=2, hidden=(4,), kind="deepfm")
    model = CtrModel(config)
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    rows = torch.tensor([[[1.0, 2.0, 0.0], [3.0, 4.0, 0.0], [5.0, 6.0, 0.0]]])
    expected = (1 * 3 + 2 * 4) + (1 * 5 + 2 * 6) + (3 * 5 + 4 * 6)
    assert float(model(rows, torch.zeros(1, 1)).detach()) == expected


def test_train_step_scores_before_learning_and_learns():
    model, opt, table = small()
    batch = fixed_batch()
    before = predict(model, table, batch)
    first = train_step(model, opt, table, batch, step=1)
    np.testing.assert_allclose(first.probs, before, rtol=1e-5, atol=1e-6)  # test-then-train
    losses = [train_step(model, opt, table, batch, step=s).loss for s in range(2, 40)]
    assert losses[-1] < 0.5 * first.loss
    assert len(table) == len(np.unique(batch.ids))


def test_batch_from_features_concatenates_and_keeps_offsets():
    a, b = random_feature_batch(3, 1), random_feature_batch(5, 2)
    batch = batch_from_features([a, b], {0: 7, 1: 3})
    assert len(batch) == 8 and batch.parts == 2 and batch.source_offsets == {0: 7, 1: 3}
    assert batch.ids.shape == (8, 39) and batch.event_ids == a.event_ids + b.event_ids


def test_auc_exact_matches_pairs_and_histogram_auc_is_close():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 3000).astype(np.float32)
    probs = np.clip(0.3 * labels + rng.normal(0.4, 0.2, 3000), 0, 1).astype(np.float32)
    pos, neg = probs[labels == 1], probs[labels == 0]
    pairs = ((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean()
    assert abs(auc_exact(labels, probs) - pairs) < 1e-9
    metrics = ProgressiveMetrics(window=1000)
    for i in range(0, 3000, 500):
        metrics.update(labels[i : i + 500], probs[i : i + 500])
    summary = metrics.summary()
    assert abs(summary["progressive_auc"] - pairs) < 1e-3
    assert abs(summary["progressive_logloss"] - logloss(labels, probs)) < 1e-6
    assert abs(summary["window_auc"] - auc_exact(labels[-1000:], probs[-1000:])) < 1e-9


def test_a_schema_without_dense_fields_builds_its_model_quietly():
    """Every avazu run printed torch's 'Initializing zero-element tensors is a no-op' (#29 item 7)."""
    import warnings

    from stream.schema import load_schema
    from trainer.settings import StoreSettings, TrainerSettings
    from trainer.trainer import Trainer

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = Trainer(load_schema("avazu"), TrainerSettings(store=StoreSettings(ram_bytes=1 << 26)))
    assert trainer.model.dense_linear.weight.shape == (1, 0)


def _lr_run(monkeypatch, full_rows: bool) -> tuple[list[np.ndarray], np.ndarray]:
    """Five lr steps from one seed; full_rows gathers every column as the other families do."""
    if full_rows:
        monkeypatch.setattr(CtrModel, "reads_factors", property(lambda self: True))
    config = ModelConfig(num_fields=39, num_dense=13, embed_dim=4, kind="lr")
    table = EmbeddingTable(
        RamTier(3 * config.row_dim, 1 << 24), TableConfig(dim=config.row_dim, optim=SparseOptimConfig("ftrl", lr=0.05))
    )
    model = CtrModel(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    batch = fixed_batch()
    probs = [train_step(model, optimizer, table, batch, step).probs for step in range(1, 6)]
    rows, _ = table.tier.read(np.unique(batch.ids))
    return probs, rows.numpy()


def test_the_lr_family_gathers_only_first_order_weights_and_learns_the_same(monkeypatch):
    """lr reads no factors, so its step gathers (u, 1) rows, not (u, E+1): the same scores and rows
    (the factor columns' gradient is zero either way)."""
    assert not CtrModel(ModelConfig(39, 13, 4, kind="lr")).reads_factors
    assert all(CtrModel(ModelConfig(39, 13, 4, kind=kind)).reads_factors for kind in ("fm", "deepfm", "dcn"))
    narrow_probs, narrow_rows = _lr_run(monkeypatch, full_rows=False)
    full_probs, full_rows = _lr_run(monkeypatch, full_rows=True)
    # equal to float rounding: a sum over a contiguous (B, F) and over a strided view adds in another order
    for a, b in zip(narrow_probs, full_probs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(narrow_rows, full_rows, rtol=1e-5, atol=1e-7)
    assert not np.array_equal(narrow_probs[0], narrow_probs[-1])  # it learned
