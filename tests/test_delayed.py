"""The fake-negative corrections against a hand computation, and the reason they exist: under the
fake-negative labels FNW's expected loss is the true labels' logloss, and FNC maps the biased
probability back to the true one."""

from __future__ import annotations

import math

import torch

from trainer.delayed import fn_calibrated, fn_weighted_logloss, fn_weights


def test_fnw_equals_a_hand_computation():
    logits = torch.tensor([0.0, 2.0, -1.0])
    labels = torch.tensor([1.0, 0.0, 1.0])
    p = [1 / (1 + math.exp(-z)) for z in (0.0, 2.0, -1.0)]
    expected = -(
        (1 + p[0]) * math.log(p[0]) + (1 - p[1]) * (1 + p[1]) * math.log(1 - p[1]) + (1 + p[2]) * math.log(p[2])
    )
    assert math.isclose(float(fn_weighted_logloss(logits, labels)), expected / 3, rel_tol=1e-6)
    torch.testing.assert_close(fn_weights(logits, labels), torch.tensor([1 + p[0], (1 - p[1]) * (1 + p[1]), 1 + p[2]]))


def test_fnw_weights_are_constants_for_the_gradient():
    logits = torch.tensor([0.3, -0.7], requires_grad=True)
    labels = torch.tensor([1.0, 0.0])
    fn_weighted_logloss(logits, labels).backward()
    p = torch.sigmoid(logits.detach())
    weights = fn_weights(logits, labels)
    torch.testing.assert_close(logits.grad, weights * (p - labels) / 2)  # d/dz of w * BCE with w held


def test_under_fake_negative_labels_fnw_expects_the_true_logloss_and_fnc_recovers_p():
    for p in (0.01, 0.1, 0.3):
        b = p / (1 + p)  # each impression comes as a negative, and once more as a positive with chance p
        z = torch.tensor([math.log(p / (1 - p))])  # a model that predicts the true p
        biased = b * fn_weighted_logloss(z, torch.ones(1)) + (1 - b) * fn_weighted_logloss(z, torch.zeros(1))
        true = -(p * math.log(p) + (1 - p) * math.log(1 - p))
        assert math.isclose(float(biased), true, rel_tol=1e-5)  # per event seen, the true labels' logloss
        assert math.isclose(float(fn_calibrated(torch.tensor([b]))), p, rel_tol=1e-5)
    assert float(fn_calibrated(torch.tensor([0.9]))) == 1.0  # clipped


def _model(delayed: str):
    from store.ram import RamTier
    from store.sparse_optim import SparseOptimConfig
    from store.table import EmbeddingTable, TableConfig
    from trainer.model import CtrModel, ModelConfig

    config = ModelConfig(
        num_fields=39, num_dense=13, embed_dim=4, hidden=(16,), dense_norm=False, delayed_feedback=delayed
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
