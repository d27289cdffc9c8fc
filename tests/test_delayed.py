"""The fake-negative corrections against a hand computation, and the reason they exist: under the
fake-negative labels FNW's expected loss is the true labels' logloss, and FNC maps the biased
probability back to the true one."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from trainer.delayed import fn_calibrated, fn_weighted_logloss, fn_weights


def test_fnw_equals_a_hand_computation():
    logits = torch.tensor([0.0, 2.0, -1.0])
    labels = torch.tensor([1.0, 0.0, 1.0])
    p = [1 / (1 + math.exp(-z)) for z in (0.0, 2.0, -1.0)]
    expected = -(
        (1 + p[0]) * math.log(p[0]) + (1 - p[1]) * (1 + p[1]) * math.log(1 - p[1]) + (1 + p[2]) * math.log(p[2])
    )
    # per impression: the mean over the events, times the 1 + p events an impression brings on average
    per_impression = 1 + sum(p) / 3
    assert math.isclose(float(fn_weighted_logloss(logits, labels)), expected / 3 * per_impression, rel_tol=1e-6)
    torch.testing.assert_close(fn_weights(logits, labels), torch.tensor([1 + p[0], (1 - p[1]) * (1 + p[1]), 1 + p[2]]))


def test_fnw_weights_are_constants_for_the_gradient():
    logits = torch.tensor([0.3, -0.7], requires_grad=True)
    labels = torch.tensor([1.0, 0.0])
    fn_weighted_logloss(logits, labels).backward()
    p = torch.sigmoid(logits.detach())
    weights = fn_weights(logits, labels)
    # d/dz of w * BCE, w and the per-impression factor held
    torch.testing.assert_close(logits.grad, weights * (p - labels) / 2 * (1 + p.mean()))


def test_under_fake_negative_labels_fnw_expects_the_true_logloss_and_fnc_recovers_p():
    for p in (0.01, 0.1, 0.3):
        b = p / (1 + p)  # each impression comes as a negative, and once more as a positive with chance p
        z = torch.tensor([math.log(p / (1 - p))])  # a model that predicts the true p
        biased = b * fn_weighted_logloss(z, torch.ones(1)) + (1 - b) * fn_weighted_logloss(z, torch.zeros(1))
        true = -(p * math.log(p) + (1 - p) * math.log(1 - p))
        # per event seen, the true labels' logloss (Ktena et al.), scaled by the 1 + p events each
        # impression comes as: per impression, the true labels' logloss
        assert math.isclose(float(biased), true * (1 + p), rel_tol=1e-5)
        assert math.isclose(float(fn_calibrated(torch.tensor([b]))), p, rel_tol=1e-5)
    assert float(fn_calibrated(torch.tensor([0.9]))) == 1.0  # clipped


def _model(delayed: str):
    from store.configs import TableConfig
    from store.ram import RamTier
    from store.sparse_optim import SparseOptimConfig
    from store.table import EmbeddingTable
    from trainer.model import CtrModel, ModelConfig

    config = ModelConfig(
        num_fields=39,
        num_dense=13,
        embed_dim=4,
        hidden=(16,),
        dense_norm=False,
        delayed_feedback=delayed,
        kind="deepfm",
    )
    table = EmbeddingTable(
        RamTier(3 * config.row_dim, 1 << 24), TableConfig(dim=config.row_dim, optim=SparseOptimConfig("sgd", lr=0.1))
    )
    model = CtrModel(config)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), table


def test_the_trainer_weights_its_loss_under_fnw_and_serves_b_over_1_minus_b_under_fnc():
    from tests.helpers import random_feature_batch
    from trainer.batch import batch_from_features
    from trainer.step import backward, forward, predict

    batch = batch_from_features([random_feature_batch(32, seed=1)])
    assert 0 < float(batch.labels.mean()) < 1
    model, optimizer, table = _model("fnw")
    backward(model, optimizer, table, batch)
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.zero_grad()
    logits, _, _ = forward(model, table, batch)
    fn_weighted_logloss(logits, batch.labels).backward()  # the loss by hand, same model and rows
    for name, param in model.named_parameters():
        if name in got:
            torch.testing.assert_close(got[name], param.grad, msg=name)
    optimizer.zero_grad()
    torch.nn.functional.binary_cross_entropy_with_logits(forward(model, table, batch)[0], batch.labels).backward()
    assert any(not torch.allclose(got[n], p.grad) for n, p in model.named_parameters() if n in got)

    plain, _, plain_table = _model("none")
    fnc, _, fnc_table = _model("fnc")
    b = torch.from_numpy(predict(plain, plain_table, batch))
    torch.testing.assert_close(torch.from_numpy(predict(fnc, fnc_table, batch)), fn_calibrated(b))


def test_final_labels_score_each_impression_once_with_its_first_prediction():
    from trainer.delayed import FinalLabels

    held = FinalLabels(wait_ms=1000)
    got = held.add(("a", "b"), np.array([0.0, 0.0]), np.array([0.3, 0.6]), now_ms=0)
    assert len(got[0]) == 0 and len(held) == 2  # both wait for their final label
    got = held.add(("a", "ghost", "b"), np.array([1.0, 1.0, 0.0]), np.array([0.9, 0.8, 0.1]), now_ms=10)
    assert len(got[0]) == 0  # a copy marks a clicked; one for no held impression and a repeat change nothing
    labels, probs = held.add(("c",), np.array([0.0]), np.array([0.2]), now_ms=1011)
    assert labels.tolist() == [1.0, 0.0] and probs.tolist() == [0.3, 0.6]  # first predictions, final labels
    assert len(held) == 1
    capped = FinalLabels(wait_ms=10**9, max_held=1)
    assert capped.add(("x", "y"), np.zeros(2), np.array([0.1, 0.2]), 0)[1].tolist() == [0.1]  # oldest scored early


def test_the_trainer_scores_a_clicked_impression_once_under_fake_negative(schema):
    from stream.featurizer.decode import event_from_mapping
    from stream.featurizer.featurize import featurize
    from tests.helpers import criteo_event
    from trainer.batch import batch_from_features
    from trainer.settings import ModelSettings, OptimSettings, StoreSettings, TrainerSettings
    from trainer.trainer import Trainer

    settings = TrainerSettings(
        model=ModelSettings(embed_dim=4, hidden=(16,)),
        store=StoreSettings(ram_bytes=1 << 26),
        optim=OptimSettings(delayed_feedback="fnw"),
        label_wait_s=1.0,
    )
    trainer = Trainer(schema, settings)

    def batch(rows: list[tuple[int, int]], now_ms: int):
        events = [event_from_mapping(criteo_event(i, label=label, ts=now_ms), schema) for i, label in rows]
        fb = featurize(events, schema)
        return replace(batch_from_features([fb]), newest_ms=now_ms)

    trainer.learn(batch([(i, 0) for i in range(20)], 0))  # 20 impressions, all fake negatives
    trainer.learn(batch([(i, 1) for i in range(5)], 500))  # 5 of them clicked: positive copies
    assert trainer.metrics.count == 0  # nothing final yet
    trainer.learn(batch([(i, 0) for i in range(20, 30)], 2000))  # later impressions: the first 20 are final
    assert trainer.metrics.count == 20 and trainer.metrics.pos_hist.sum() == 5


def test_final_labels_keep_a_clock_that_never_goes_back():
    """A batch of a lagging partition (older event time) must not stall or reorder the waits."""
    from trainer.delayed import FinalLabels

    held = FinalLabels(wait_ms=100)
    held.add(("a",), np.zeros(1), np.array([0.1]), now_ms=1000)
    held.add(("b",), np.zeros(1), np.array([0.2]), now_ms=500)  # late partition: seen at clock 1000
    assert held.add((), np.zeros(0), np.zeros(0), now_ms=1050)[1].tolist() == []
    assert held.add((), np.zeros(0), np.zeros(0), now_ms=1101)[1].tolist() == [0.1, 0.2]


def test_final_labels_at_idle_score_up_to_the_newest_time_read():
    """Partition 1's stream ended a minute before partition 0's: the clock (the oldest partition's
    newest) stays there, and partition 0's last minute of impressions was never scored; once the
    replica has read everything (idle), the newest time read is the clock."""
    from trainer.delayed import FinalLabels

    held = FinalLabels(wait_ms=100)
    held.add(("a",), np.zeros(1), np.array([0.1]), now_ms=1000, partitions=[1])
    for t in range(1000, 61_001, 1000):
        held.add((f"x{t}",), np.zeros(1), np.array([0.5]), now_ms=t, partitions=[0])
    assert len(held) == 62 and held.clock == 1000  # all wait behind partition 1's end
    labels, probs = held.idle()
    assert len(probs) == 62 and probs[0] == 0.1 and len(held) == 0 and held.clock == 61_000
    held.add(("late",), np.zeros(1), np.array([0.7]), now_ms=2000, partitions=[1])
    assert held.clock == 61_000  # never back


def test_a_copy_read_before_its_negative_still_scores_its_impression_as_clicked():
    """Copies and negatives may come through different partitions, read in another order: the copy
    waits for its negative, which is then scored once, clicked, with the copy's prediction (the
    negative's own came after the model learned the copy). A copy whose negative never follows
    within the wait is dropped, unscored; the result does not depend on which came first."""
    from trainer.delayed import FinalLabels

    def final(order: list[tuple[str, float, float]]) -> list[tuple[float, float]]:
        held = FinalLabels(wait_ms=1000)
        for t, (event_id, label, prob) in enumerate(order):
            held.add((event_id,), np.array([label]), np.array([prob]), now_ms=t)
        labels, probs = held.add((), np.zeros(0), np.zeros(0), now_ms=5000)
        return list(zip(labels.tolist(), probs.tolist(), strict=True))

    copy_first = final([("a", 1.0, 0.4), ("a", 0.0, 0.9), ("b", 0.0, 0.2)])
    assert copy_first == [(1.0, 0.4), (0.0, 0.2)]  # a: clicked, the copy's prediction; b: unclicked
    negative_first = final([("a", 0.0, 0.4), ("a", 1.0, 0.9), ("b", 0.0, 0.2)])
    assert negative_first == copy_first
    held = FinalLabels(wait_ms=100)
    held.add(("lonely",), np.array([1.0]), np.array([0.5]), now_ms=0)  # its negative was scored before
    held.add(("c",), np.array([0.0]), np.array([0.1]), now_ms=500)
    held.add(("lonely",), np.array([0.0]), np.array([0.3]), now_ms=500)  # a new impression with an old id
    assert held.add((), np.zeros(0), np.zeros(0), now_ms=700)[0].tolist() == [0.0, 0.0]  # the copy expired
