"""The learner's parts pinned to hand computations: each sparse optimizer's update (and its state
travelling with the row through every tier), CowClip, the calibration metric, online dense
normalization, and every model family served exactly as the trainer predicts."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest
import torch

from serving.loader import load_served_model
from serving.predict import predict_events
from store.configs import TableConfig
from store.ram import RamTier
from store.sparse_optim import SPARSE_OPTIMIZERS, SparseOptimConfig, cowclip, sparse_step
from store.table import EmbeddingTable
from stream.featurizer.decode import decode_event
from stream.featurizer.featurize import featurize
from stream.produce.synthetic import SyntheticCriteo
from stream.schema import load_schema
from tests.helpers import TIERS
from trainer.batch import batch_from_features
from trainer.metrics import calibration_summary, calibration_sums, ece
from trainer.model import MODEL_KINDS, OnlineNorm
from trainer.settings import ModelSettings, StoreSettings, TrainerSettings
from trainer.trainer import Trainer

W0, G1, G2 = 0.5, 0.2, -0.4  # one coordinate: initial weight, then two gradients


def hand(name: str, lr: float = 0.1) -> float:
    """The weight after two steps, computed coordinate-wise from the textbook formulas."""
    w, a, b = W0, 0.0, 0.0
    for t, g in enumerate((G1, G2), start=1):
        if name == "sgd":
            w -= lr * g
        elif name == "adagrad":
            a += g * g
            w -= lr * g / (math.sqrt(a) + 1e-8)
        elif name == "ftrl":  # FTRL-Proximal, alpha = lr, beta = 1, no L1 / L2 (McMahan et al. 2013)
            n_new = b + g * g
            sigma = (math.sqrt(n_new) - math.sqrt(b)) / lr
            a += g - sigma * w
            b = n_new
            w = -a / ((1.0 + math.sqrt(b)) / lr)
        else:  # adam
            a = 0.9 * a + 0.1 * g
            b = 0.999 * b + 0.001 * g * g
            w -= lr * (a / (1 - 0.9**t)) / (math.sqrt(b / (1 - 0.999**t)) + 1e-8)
    return w


@pytest.mark.parametrize("name", SPARSE_OPTIMIZERS)
def test_each_sparse_optimizer_equals_a_hand_computation(name):
    cfg = SparseOptimConfig(name=name, lr=0.1)
    rows = torch.tensor([[W0, 0.0, 0.0]])  # dim 1: [w | state_a | state_b]
    for step, g in enumerate((G1, G2), start=1):
        rows = sparse_step(rows, torch.tensor([[g]]), step, cfg)
    assert float(rows[0, 0]) == pytest.approx(hand(name), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("l1, l2", [(0.0, 0.5), (0.05, 0.5), (10.0, 0.0)])
def test_ftrl_with_l1_and_l2_equals_a_hand_computation(l1, l2):
    """McMahan et al.'s closed form with its L1 shrinkage (|z| <= l1: the weight is 0) and L2."""
    lr, beta, w, z, n = 0.1, 1.0, W0, 0.0, 0.0
    cfg = SparseOptimConfig(name="ftrl", lr=lr, ftrl_l1=l1, l2=l2, ftrl_beta=beta)
    rows = torch.tensor([[W0, 0.0, 0.0]])
    for step, g in enumerate((G1, G2), start=1):
        rows = sparse_step(rows, torch.tensor([[g]]), step, cfg)
        n_new = n + g * g
        z += g - (math.sqrt(n_new) - math.sqrt(n)) / lr * w
        n = n_new
        w = 0.0 if abs(z) <= l1 else -(z - math.copysign(l1, z)) / ((beta + math.sqrt(n)) / lr + l2)
        assert float(rows[0, 0]) == pytest.approx(w, rel=1e-5, abs=1e-7)
    assert (w == 0.0) == (l1 == 10.0)  # the large L1 zeroes the weight; the others do not


def test_the_wide_column_has_its_own_learning_rate():
    cfg = SparseOptimConfig(name="sgd", lr=0.1, wide_lr=1.0)
    rows = sparse_step(torch.zeros(1, 6), torch.ones(1, 2), 1, cfg)
    assert rows[0, :2].tolist() == pytest.approx([-0.1, -1.0])


def test_cowclip_bounds_each_ids_gradient_by_its_count_and_norm():
    cfg = SparseOptimConfig(clip_ratio=1.0, clip_floor=0.01)
    vectors = torch.tensor([[3.0, 4.0], [0.0, 0.0], [3.0, 4.0]])  # norms 5, 0, 5
    grad = torch.tensor([[30.0, 40.0], [1.0, 0.0], [0.3, 0.4]])  # norms 50, 1, 0.5
    counts = torch.tensor([2.0, 1.0, 1.0])
    out = cowclip(grad, vectors, counts, cfg)
    assert out[0].norm().item() == pytest.approx(10.0)  # 2 occurrences * 1.0 * |w| = 10
    assert out[1].norm().item() == pytest.approx(0.01)  # the floor
    torch.testing.assert_close(out[2], grad[2])  # under the limit: untouched


@pytest.mark.parametrize("tier_name", sorted(TIERS))
@pytest.mark.parametrize("name", ["adagrad", "ftrl"])
def test_optimizer_state_travels_with_the_row_through_every_tier(tmp_path, tier_name, name):
    from tests.helpers import WIDTH

    cfg = TableConfig(dim=WIDTH // 3, seed=3, optim=SparseOptimConfig(name=name, lr=0.1))
    reference = EmbeddingTable(RamTier(WIDTH, 1 << 24), cfg)
    table = EmbeddingTable(TIERS[tier_name](tmp_path), cfg)
    rng = np.random.default_rng(0)
    for step in range(1, 30):
        ids = rng.integers(0, 60, size=8).astype(np.int64)
        grad = torch.from_numpy(rng.normal(size=(len(np.unique(ids)), WIDTH // 3)).astype(np.float32))
        for t in (reference, table):
            t.update(t.lookup(ids), grad, step)
    ids, rows = table.export()
    ref_ids, ref_rows = reference.export()
    np.testing.assert_array_equal(ids, ref_ids)
    torch.testing.assert_close(rows, ref_rows)
    assert (rows[:, WIDTH // 3 :].abs().sum(dim=1) > 0).all()  # every row carries its optimizer state


def test_the_dense_optimizer_is_torch_adam_on_the_deep_part_and_adagrad_on_the_wide_part():
    from trainer.model import CtrModel, ModelConfig
    from trainer.optim import wide_deep_optimizer, wide_parameters

    models = [CtrModel(ModelConfig(4, 3, 2, (5,), seed=1, kind="deepfm")) for _ in range(2)]
    ours = wide_deep_optimizer(models[0], lr=0.01, wide_lr=0.1)
    wide = {id(p) for p in wide_parameters(models[1])}
    deep = [p for p in models[1].parameters() if id(p) not in wide]
    reference = [
        torch.optim.Adagrad(wide_parameters(models[1]), lr=0.1, eps=1e-10),
        torch.optim.Adam(deep, lr=0.01),
    ]
    rng = np.random.default_rng(0)
    for _ in range(5):
        rows = torch.from_numpy(rng.normal(size=(8, 4, 3)).astype(np.float32))
        dense = torch.from_numpy(rng.normal(size=(8, 3)).astype(np.float32))
        labels = torch.from_numpy((rng.random(8) < 0.3).astype(np.float32))
        for model in models:
            model.zero_grad()
            torch.nn.functional.binary_cross_entropy_with_logits(model(rows, dense), labels).backward()
        ours.step()
        for opt in reference:
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_calibration_metric_against_a_hand_example():
    labels = np.array([0, 1, 0, 1, 1])
    probs = np.array([0.05, 0.15, 0.55, 0.58, 0.95])
    # bins: [0.0,0.1): p .05, y 0 | [0.1,0.2): p .15, y 1 | [0.5,0.6): p 1.13, y 1 | [0.9,1.0): p .95, y 1
    expected = (abs(0.05 - 0) + abs(0.15 - 1) + abs(1.13 - 1) + abs(0.95 - 1)) / 5
    assert ece(labels, probs) == pytest.approx(expected)
    summary = calibration_summary(calibration_sums(labels, probs), "x")
    assert summary["x_mean_ctr"] == pytest.approx(probs.mean()) and summary["x_observed_ctr"] == pytest.approx(0.6)
    assert ece(np.array([1, 0]), np.array([0.5, 0.5])) == 0.0  # calibrated on average within the bin


def test_online_norm_standardizes_with_the_statistics_before_the_batch():
    norm = OnlineNorm(2)
    first = torch.tensor([[1.0, 10.0], [3.0, 30.0]])
    torch.testing.assert_close(norm(first), first / math.sqrt(1 + 1e-5))  # no statistics yet: mean 0, var 1
    second = torch.tensor([[5.0, 50.0], [7.0, 70.0]])
    out = norm(second)
    torch.testing.assert_close(norm.mean, torch.tensor([4.0, 40.0]))
    torch.testing.assert_close(norm.var, torch.tensor([5.0, 500.0]))
    torch.testing.assert_close(
        out, (second - torch.tensor([2.0, 20.0])) / torch.sqrt(torch.tensor([1.0, 100.0]) + 1e-5)
    )
    norm.eval()
    norm(second)
    torch.testing.assert_close(norm.mean, torch.tensor([4.0, 40.0]))  # eval mode learns nothing


@pytest.mark.parametrize("kind", [*MODEL_KINDS, "dcn-low-rank"])
@pytest.mark.parametrize("min_count", [1, 2])
def test_serving_returns_the_trainers_predictions_for_every_family(tmp_path, kind, min_count):
    schema = load_schema("criteo")
    generator = SyntheticCriteo(schema)
    model = ModelSettings(kind="dcn", embed_dim=4, hidden=(16,), cross_rank=3) if kind == "dcn-low-rank" else None
    settings = TrainerSettings(
        model=model or ModelSettings(kind=kind, embed_dim=4, hidden=(16,)),
        store=StoreSettings(min_count=min_count),
        threads=1,
    )
    trainer = Trainer(schema, settings)
    for _ in range(4):
        events, _ = generator.generate(256)
        trainer.learn(batch_from_features([featurize([decode_event(orjson.dumps(e), schema) for e in events], schema)]))
    path = trainer.checkpoints.save(tmp_path / "snapshots")
    served = load_served_model(path, "1", schema)
    events, _ = generator.generate(300)  # seen, pending and brand-new ids alike
    decoded = [decode_event(orjson.dumps(e), schema) for e in events]
    expected = trainer.predict(batch_from_features([featurize(decoded, schema)]))
    np.testing.assert_allclose(predict_events(served, decoded, schema), expected, atol=1e-5)


def test_a_low_rank_cross_layer_is_u_v_transposed_of_that_rank():
    from trainer.model import CtrModel, ModelConfig

    full = CtrModel(ModelConfig(num_fields=3, num_dense=2, embed_dim=4, kind="dcn"))
    low = CtrModel(ModelConfig(num_fields=3, num_dense=2, embed_dim=4, kind="dcn", cross_rank=2))
    width = 3 * 4 + 2
    assert full.cross[0].weight.shape == (width, width)
    down, up = low.cross[0]
    assert down.weight.shape == (2, width) and up.weight.shape == (width, 2)
    x = torch.randn(5, width)
    torch.testing.assert_close(low.cross[0](x), x @ (up.weight @ down.weight).T + up.bias)
