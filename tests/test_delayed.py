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
