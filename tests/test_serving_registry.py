"""The serving download cache: a version number names a publication only within one registry. Two
registries (a compose stack brought down with its volumes and up again, another MLflow on the same
port) both have a version 1; a cache keyed by the number alone served the first one's files under
the second one's name, with the second one's deltas on top (the compose test's two servers on "one
version" answered different CTRs). Artifacts read from file:// URIs, as MLflow reads its own."""

from __future__ import annotations

import numpy as np

from serving.loader import load_served_model
from serving.predict import predict_events
from serving.registry import VersionRef, cache_folder, download
from stream.featurizer.decode import event_from_mapping
from tests.helpers import criteo_event, trained_trainer
from tests.test_snapshot import learn_events


def test_two_registries_version_1_never_share_a_cached_download(schema, tmp_path):
    first, second = trained_trainer(schema, 2), trained_trainer(schema, 2)
    learn_events(second, schema, 1000, 3)  # another run: other rows, other weights, the same base step
    a = first.checkpoints.publish_to(tmp_path / "run-a", first.checkpoints.manifest())
    b = second.checkpoints.publish_to(tmp_path / "run-b", second.checkpoints.manifest())
    assert a is not None and b is not None
    ref_a = VersionRef("ctr", "1", a.as_uri(), "run-a")
    ref_b = VersionRef("ctr", "1", b.as_uri(), "run-b")
    cache = tmp_path / "cache"
    events = [event_from_mapping(criteo_event(i), schema) for i in range(20)]

    def ctrs(folder) -> np.ndarray:
        return np.asarray(predict_events(load_served_model(folder, "1", schema), events, schema))

    served_a = ctrs(download("file:///unused", ref_a, cache))
    served_b = ctrs(download("file:///unused", ref_b, cache))  # the same name and number, from elsewhere
    assert cache_folder(cache, ref_a) != cache_folder(cache, ref_b)
    np.testing.assert_allclose(served_a, ctrs(a), atol=1e-7)
    np.testing.assert_allclose(served_b, ctrs(b), atol=1e-7)
    assert np.abs(served_a - served_b).max() > 1e-3  # two models: a shared cache would have served one twice
