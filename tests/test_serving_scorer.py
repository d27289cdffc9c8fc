"""serving/scorer.py, the numpy form of a network that serves requests, == CtrModel's forward and
its served CTR (trainer.step.ctr_of), for every family and option, at one event and at 64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from serving.scorer import score, scorer_of
from trainer.model import FAMILIES, CtrModel, ModelConfig
from trainer.step import ctr_of


def random_model(config: ModelConfig, seed: int) -> CtrModel:
    """Every weight and buffer random (the MLP's head and the norm's statistics start at 0 and 1:
    a scorer that ignored them would still pass at init)."""
    model = CtrModel(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.copy_(torch.rand(tensor.shape, generator=generator) * 0.6 - 0.2)
        if config.dense_norm:
            model.norm.var.copy_(torch.rand(config.num_dense, generator=generator) + 0.5)
    return model


@pytest.mark.parametrize("kind", sorted(FAMILIES))
@pytest.mark.parametrize(("cross_rank", "feedback", "dense_norm"), [(0, "none", True), (4, "fnc", False)])
@pytest.mark.parametrize("events", [1, 64])
def test_the_scorer_is_the_models_forward(kind, cross_rank, feedback, dense_norm, events):
    config = ModelConfig(
        num_fields=7,
        num_dense=3,
        embed_dim=4,
        hidden=(16, 8),
        kind=kind,
        cross_rank=cross_rank,
        delayed_feedback=feedback,
        dense_norm=dense_norm,
    )
    model = random_model(config, seed=events)
    width = config.row_dim if model.reads_factors else 1
    generator = torch.Generator().manual_seed(7)
    rows = torch.randn((events, config.num_fields, width), generator=generator) * 0.5
    dense = torch.randn((events, config.num_dense), generator=generator) * 3
    with torch.inference_mode():
        expected = ctr_of(model(rows, dense), config).numpy()
    served = score(scorer_of(model), rows.numpy(), dense.numpy())
    assert served.dtype == np.float32 and served.shape == (events,) and np.isfinite(expected).all()
    np.testing.assert_allclose(served, expected, atol=1e-6, rtol=1e-5)
    assert expected.std() > 1e-3 or events == 1  # the events score differently: a real comparison


def test_an_extreme_logit_scores_0_or_1_without_a_warning():
    model = random_model(ModelConfig(num_fields=2, num_dense=1, embed_dim=2, kind="lr"), seed=0)
    rows = np.array([[[200.0], [0.0]], [[-200.0], [0.0]]], dtype=np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        served = score(scorer_of(model), rows, np.zeros((2, 1), dtype=np.float32))
    np.testing.assert_allclose(served, [1.0, 0.0], atol=1e-7)
