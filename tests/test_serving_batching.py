"""serving/batching.py: requests that queue together are scored in one call, each answered with its
own CTRs, the same (to 1e-7) as scored alone; a swap between two requests scores each on the model
it read; a failed call fails its requests only."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from serving.batching import Batcher
from serving.loader import load_served_model
from serving.predict import predict_events
from stream.featurizer.decode import event_from_mapping
from tests.helpers import criteo_event, trained_trainer


@pytest.fixture
def models(schema, tmp_path):
    first = trained_trainer(schema, 2).checkpoints.publish_to(
        tmp_path / "a", trained_trainer(schema, 2).checkpoints.manifest()
    )
    second = trained_trainer(schema, 5)
    second_folder = second.checkpoints.publish_to(tmp_path / "b", second.checkpoints.manifest())
    return load_served_model(first, "1", schema), load_served_model(second_folder, "2", schema)


def requests(schema, sizes):
    at, out = 0, []
    for size in sizes:
        out.append([event_from_mapping(criteo_event(at + i), schema, require_label=False) for i in range(size)])
        at += size
    return out


def test_queued_requests_are_scored_together_and_each_gets_its_own_ctrs(schema, models):
    served = models[0]
    calls: list[int] = []

    def score(model, events):
        calls.append(len(events))
        return predict_events(model, events, schema)

    batch = requests(schema, [1, 3, 1, 8, 2])

    async def run():
        batcher = Batcher(score)
        together = await asyncio.gather(*(batcher.predict(served, r) for r in batch))
        alone = await batcher.predict(served, batch[1])  # nothing queued beside it: a call of its own
        return together, alone

    together, alone = asyncio.run(run())
    assert calls == [15, 3]  # five requests in one call, then one alone
    for request, ctrs in zip(batch, together):
        assert ctrs.shape == (len(request),)
        np.testing.assert_allclose(ctrs, predict_events(served, request, schema), atol=1e-7, rtol=0)
    np.testing.assert_allclose(alone, together[1], atol=1e-7, rtol=0)
    assert np.abs(together[0][0] - together[2][0]) > 0  # different events, different answers: slices not mixed


def test_a_swap_between_two_queued_requests_scores_each_on_the_model_it_read(schema, models):
    old, new = models
    batch = requests(schema, [2, 2])

    async def run():
        batcher = Batcher(lambda model, events: predict_events(model, events, schema))
        return await asyncio.gather(batcher.predict(old, batch[0]), batcher.predict(new, batch[1]))

    on_old, on_new = asyncio.run(run())
    np.testing.assert_allclose(on_old, predict_events(old, batch[0], schema), atol=1e-7, rtol=0)
    np.testing.assert_allclose(on_new, predict_events(new, batch[1], schema), atol=1e-7, rtol=0)
    assert np.abs(predict_events(old, batch[1], schema) - on_new).max() > 1e-4  # the two models differ


def test_a_failed_call_fails_its_requests_and_the_next_batch_is_scored(schema, models):
    served = models[0]
    failing = [True]

    def score(model, events):
        if failing.pop() if failing else False:
            raise RuntimeError("scoring failed")
        return predict_events(model, events, schema)

    batch = requests(schema, [1, 1])

    async def run():
        batcher = Batcher(score)
        first = await asyncio.gather(*(batcher.predict(served, r) for r in batch), return_exceptions=True)
        second = await batcher.predict(served, batch[0])
        return first, second

    first, second = asyncio.run(run())
    assert all(isinstance(x, RuntimeError) for x in first)
    np.testing.assert_allclose(second, predict_events(served, batch[0], schema), atol=1e-7, rtol=0)
