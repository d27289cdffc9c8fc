"""The HTTP layer over a real snapshot on disk (the registry path is covered by the integration tests)."""

import json
import math
import os
from dataclasses import replace

import numpy as np
import pytest
from fastapi.testclient import TestClient

from serving.app import create_app
from serving.loader import load_served_model
from serving.predict import predict_events
from serving.settings import ServingSettings
from stream.featurizer.decode import event_from_mapping
from tests.helpers import criteo_event, trained_trainer, unlabelled


@pytest.fixture
def snapshots(schema, tmp_path):
    trainer = trained_trainer(schema, 2)
    first = trainer.checkpoints.save(tmp_path / "a")
    second = trained_trainer(schema, 4).checkpoints.save(tmp_path / "b")
    return [load_served_model(first, "1", schema), load_served_model(second, "2", schema)]


def make_client(schema, queue):
    def fetch(current):
        return queue.pop(0) if queue else None

    settings = replace(ServingSettings(), log_impressions=False, poll_s=0.05)
    return TestClient(create_app(settings, schema, fetch))


def test_predicts_one_or_many_with_the_version(schema, snapshots):
    expected = predict_events(
        snapshots[0], [event_from_mapping(unlabelled(i), schema, False) for i in range(3)], schema
    )
    with make_client(schema, [snapshots[0]]) as client:
        one = client.post("/predict", json=unlabelled(0)).json()
        many = client.post("/predict", json=[unlabelled(i) for i in range(3)]).json()
    assert one["model_version"] == "1" and one["predictions"][0]["event_id"] == "e0"
    np.testing.assert_allclose([p["ctr"] for p in many["predictions"]], expected, rtol=1e-6)
    assert all(0 < p["ctr"] < 1 for p in many["predictions"])


def test_bad_requests_get_422_naming_the_field(schema, snapshots):
    with make_client(schema, [snapshots[0]]) as client:
        r = client.post("/predict", json=unlabelled(0, C3="nothex!"))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "C3"]
        missing = unlabelled(0)
        del missing["I4"]
        r = client.post("/predict", json=[unlabelled(1), missing])
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", 1, "I4"]
        r = client.post("/predict", content=b"{nope")
        assert r.status_code == 422 and "not valid JSON" in r.json()["detail"][0]["msg"]
        assert client.post("/predict", json=[]).status_code == 422
        assert client.post("/predict", json=unlabelled(2)).status_code == 200  # the server lives on


def test_503_until_a_model_then_hot_swap(schema, snapshots):
    import time

    queue: list = []
    with make_client(schema, queue) as client:
        assert client.get("/healthz").json() == {"status": "ok", "model_loaded": False, "worker": os.getpid()}
        assert client.post("/predict", json=unlabelled(0)).status_code == 503
        assert client.get("/model").status_code == 503
        queue.append(snapshots[0])
        versions = set()
        deadline = time.monotonic() + 10
        while "2" not in versions and time.monotonic() < deadline:
            r = client.post("/predict", json=unlabelled(0))
            if r.status_code == 200:
                versions.add(r.json()["model_version"])
                if versions == {"1"}:
                    queue.append(snapshots[1])
            time.sleep(0.02)
        assert versions == {"1", "2"}
        info = client.get("/model").json()
        assert info["model_version"] == "2" and info["step"] == 4 and info["schema_hash"] == schema.hash
        assert info["family"] == snapshots[1].manifest.model["kind"] and info["champion"] == "default"
        metrics = client.get("/metrics").text
        assert "adstream_serving_model_swaps_total" in metrics
        ece = snapshots[1].manifest.metrics["progressive_ece"]
        assert f'adstream_serving_model_metric{{metric="progressive_ece"}} {ece}' in metrics
        # what is served and how fresh it is (#29 item 10)
        from prometheus_client.parser import text_string_to_metric_families

        samples = {
            (sample.name, sample.labels.get("field")): sample.value
            for family in text_string_to_metric_families(metrics)
            for sample in family.samples
        }
        newest = snapshots[1].manifest.newest_event_ms / 1000
        assert samples["adstream_serving_model", "version"] == 2 and samples["adstream_serving_model", "step"] == 4
        assert samples["adstream_serving_model", "newest_event_seconds"] == newest
        assert abs(samples["adstream_serving_model_age_seconds", None] - (time.time() - newest)) < 60


def test_refresh_errors_keep_the_old_model(schema, snapshots):
    calls = {"n": 0}

    def fetch(current):
        calls["n"] += 1
        if calls["n"] == 1:
            return snapshots[0]
        raise RuntimeError("registry down")

    with TestClient(
        create_app(replace(ServingSettings(), log_impressions=False, poll_s=0.05), schema, fetch)
    ) as client:
        import time

        time.sleep(0.3)
        r = client.post("/predict", json=unlabelled(0))
        assert r.status_code == 200 and r.json()["model_version"] == "1" and calls["n"] > 1


def test_a_broken_publication_is_refused_and_the_last_model_keeps_serving(schema, snapshots):
    from prometheus_client import REGISTRY

    from trainer.errors import SnapshotError

    def refused() -> float:
        return REGISTRY.get_sample_value("adstream_serving_refused_total") or 0.0

    queue: list = [snapshots[0]]

    def fetch(current):
        if queue:
            return queue.pop(0)
        raise SnapshotError("snapshot /x: embeddings.safetensors is unreadable (truncated); refusing it")

    before = refused()
    with TestClient(
        create_app(replace(ServingSettings(), log_impressions=False, poll_s=0.05), schema, fetch)
    ) as client:
        import time

        time.sleep(0.3)  # a few polls, each one refused
        r = client.post("/predict", json=unlabelled(0))
        info = client.get("/model").json()
    assert r.status_code == 200 and r.json()["model_version"] == "1"
    assert info["model_version"] == "1" and "unreadable" in info["last_error"]
    assert info["kind"] == "recovery" and info["newest_event_ms"] == criteo_event(99)["ts"]  # 2 x 50 events learned
    assert refused() > before


def test_a_token_guards_predict_and_model_and_is_never_shown(schema, snapshots, caplog):
    settings = replace(ServingSettings(), log_impressions=False, poll_s=0.05, token="s3cret-token")
    assert "s3cret" not in repr(settings)
    queue = [snapshots[0]]
    with TestClient(create_app(settings, schema, lambda current: queue.pop(0) if queue else None)) as client:
        assert client.post("/predict", json=unlabelled(0)).status_code == 401
        wrong = client.post("/predict", json=unlabelled(0), headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "bearer token" in wrong.json()["detail"]
        assert client.get("/model").status_code == 401
        auth = {"Authorization": "Bearer s3cret-token"}
        assert client.post("/predict", json=unlabelled(0), headers=auth).status_code == 200
        assert client.get("/model", headers=auth).status_code == 200
        assert client.get("/healthz").status_code == 200 and client.get("/metrics").status_code == 200
        for page in ("/docs", "/openapi.json", "/redoc"):  # the API's description is not open beside the token
            assert client.get(page).status_code == 404 and client.get(page, headers=auth).status_code == 404
    assert "s3cret" not in caplog.text
    with make_client(schema, [snapshots[0]]) as client:  # without a token they are there
        assert client.get("/openapi.json").status_code == 200


def test_a_body_over_the_limit_is_refused_with_413_naming_the_setting(schema, snapshots):
    settings = replace(ServingSettings(), log_impressions=False, poll_s=0.05, max_body_bytes=4096)
    queue = [snapshots[0]]
    with TestClient(create_app(settings, schema, lambda current: queue.pop(0) if queue else None)) as client:
        big = client.post("/predict", json=[unlabelled(i) for i in range(20)])  # ~20 KB
        assert big.status_code == 413 and "serving.max_body_bytes=4096" in big.json()["detail"]

        def chunks():  # no Content-Length: the limit holds while the body streams in
            yield b"["
            for i in range(20):
                yield json.dumps(unlabelled(i)).encode() + (b"," if i < 19 else b"]")

        streamed = client.post("/predict", content=chunks(), headers={"Content-Type": "application/json"})
        assert streamed.status_code == 413
        assert client.post("/predict", json=unlabelled(0)).status_code == 200
        long_id = client.post("/predict", json=unlabelled(0, event_id="x" * 1000))
        assert long_id.status_code == 422 and long_id.json()["detail"][0]["loc"] == ["body", "event_id"]
        assert "x" * 300 not in long_id.text  # a long id is named, not echoed


def test_a_thousand_fuzzed_requests_get_4xx_naming_the_field_never_5xx(schema, snapshots):
    """Wrong types, missing fields, huge values, garbage bytes, odd shapes: every answer is 200 or
    a 4xx; a 422 for a bad field of an event names that field; the server answers well after."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    fields = [schema.event_id, *schema.integer_fields, *schema.categorical_fields]
    junk = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**80), max_value=2**80),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=40),
        st.lists(st.integers(), max_size=3),
        st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    )
    mutated = st.tuples(st.sampled_from(fields), junk, st.booleans())
    raw = st.one_of(st.binary(max_size=200), st.just(b"[]"), st.just(b"{}"), st.just(b"null"), st.just(b'"x"'))
    statuses: list[int] = []
    with make_client(schema, [snapshots[0]]) as client:

        @settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(st.one_of(mutated, raw), st.integers(0, 50))
        def check(case, i):
            if isinstance(case, bytes):
                response = client.post("/predict", content=case, headers={"Content-Type": "application/json"})
                assert 400 <= response.status_code < 500 or response.status_code == 200, response.text
                statuses.append(response.status_code)
                return
            field, value, drop = case
            event = unlabelled(i)
            if drop:
                del event[field]
            else:
                event[field] = value
            response = client.post("/predict", content=json.dumps(event))  # huge ints, NaN: not orjson's
            statuses.append(response.status_code)
            assert response.status_code in (200, 422), response.text
            if response.status_code == 422:  # NaN / Infinity make the body itself invalid JSON
                not_json = isinstance(value, float) and not math.isfinite(value) and not drop
                assert response.json()["detail"][0]["loc"] == (["body"] if not_json else ["body", field])

        check()
        assert client.post("/predict", json=unlabelled(3)).status_code == 200  # still serving
    assert len(statuses) >= 1000 and max(statuses) < 500 and statuses.count(422) > 500


def test_a_metric_not_measured_yet_is_null_in_model_info_not_an_error(schema, snapshots):
    """A snapshot whose metrics are NaN (no final label yet under fake_negative, or one class only)."""
    import time

    served = snapshots[0]
    nan_manifest = replace(served.manifest, metrics={**served.manifest.metrics, "progressive_auc": float("nan")})
    queue: list = [replace(served, manifest=nan_manifest)]
    with make_client(schema, queue) as client:
        deadline = time.monotonic() + 10
        while client.get("/healthz").json()["model_loaded"] is False and time.monotonic() < deadline:
            time.sleep(0.02)
        response = client.get("/model")
        assert response.status_code == 200
        assert response.json()["metrics"]["progressive_auc"] is None


def test_the_server_says_which_version_it_serves_once_per_version(schema, snapshots, capsys):
    import time

    queue: list = [snapshots[0]]
    with make_client(schema, queue) as client:
        deadline = time.monotonic() + 10
        while client.get("/healthz").json()["model_loaded"] is False and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # more polls: nothing new, nothing printed
    out = capsys.readouterr().out
    assert out.count("serving: now serving version 1 (step 2, schema criteo") == 1


def test_the_schema_route_shows_a_request_that_predicts_and_time_is_optional(schema, snapshots):
    """GET /schema says what a request looks like; an event without its time is scored as of now
    (time is no feature: the same CTR)."""
    import time

    with make_client(schema, [snapshots[0]]) as client:
        shown = client.get("/schema").json()
        assert shown["name"] == schema.name and shown["hash"] == schema.hash
        assert set(shown["fields"]) >= {schema.event_id, schema.timestamp, *schema.categorical_fields}
        deadline = time.monotonic() + 10
        while client.post("/predict", json=shown["example"]).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        with_time = client.post("/predict", json=shown["example"]).json()
        timeless = {k: v for k, v in shown["example"].items() if k != schema.timestamp}
        without = client.post("/predict", json=timeless)
        assert without.status_code == 200
        assert without.json()["predictions"] == with_time["predictions"]
