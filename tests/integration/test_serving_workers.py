"""`serving.workers = 2`: two processes on one port, each following the real MLflow registry and
mapping the same table from the shared download cache, answer the same CTRs (to 1e-7) as each other
and as the trainer, before and after a delta lands (written copy-on-write into each worker's own
pages, never into the file the other one maps); /metrics sums both workers' requests."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest

from adstream.config import Config
from adstream.demo import wait_for_model
from stream.schema import load_schema
from tests.helpers import criteo_event, trained_trainer
from tests.integration.helpers import free_port, start_cli, stop_process
from tests.test_deltas import PROBE, learn_more, publish_base, publish_delta, trainer_predictions
from trainer.publish import Publisher

pytestmark = pytest.mark.integration


def by_worker(url: str, body: list[dict], sequence: int, timeout_s: float = 60) -> dict[int, np.ndarray]:
    """CTRs of `body` from each worker serving delta `sequence`: fresh connections until both
    workers (told apart by /healthz on the same connection) answered on that delta."""
    answers: dict[int, np.ndarray] = {}
    deadline = time.monotonic() + timeout_s
    while len(answers) < 2 and time.monotonic() < deadline:
        with httpx.Client(timeout=10) as client:  # one connection: one worker answers all three
            pid = client.get(f"{url}/healthz").json()["worker"]
            if client.get(f"{url}/model").json()["sequence"] != sequence:
                time.sleep(0.1)
                continue
            response = client.post(f"{url}/predict", json=body)
            assert response.status_code == 200, response.text
            answers[pid] = np.array([p["ctr"] for p in response.json()["predictions"]])
    assert len(answers) == 2, f"only workers {sorted(answers)} answered on delta {sequence} within {timeout_s}s"
    return answers


def test_two_workers_answer_the_same_ctrs_as_the_trainer_before_and_after_a_delta(isolated: Config, tmp_path: Path):
    schema = load_schema(isolated.stream.schema)
    trainer = trained_trainer(schema, 3)
    publisher = Publisher(isolated.mlflow, run_name="workers")
    publisher.publish(publish_base(trainer, tmp_path), trainer.step)
    body = [{k: v for k, v in criteo_event(i).items() if k != schema.label} for i in PROBE]
    config = replace(isolated, serving=replace(isolated.serving, port=free_port(), workers=2, poll_s=0.2))
    server, log = start_cli(config, tmp_path, "serve")
    url = f"http://127.0.0.1:{config.serving.port}"
    try:
        wait_for_model(url, server, 120, log)
        for sequence in (0, 1):
            if sequence:
                learn_more(trainer, schema, 150, 2)
                delta, changed = publish_delta(trainer, tmp_path, publisher.base_step, sequence)
                publisher.publish_delta(delta, sequence, trainer.step, len(changed))
            first, second = by_worker(url, body, sequence).values()
            np.testing.assert_allclose(first, second, atol=1e-7, rtol=0)
            np.testing.assert_allclose(first, trainer_predictions(trainer, schema), rtol=1e-5, atol=1e-6)
        sent = 0
        for _ in range(20):
            with httpx.Client(timeout=10) as client:
                assert client.post(f"{url}/predict", json=body[0]).status_code == 200
                sent += 1
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        counted = [
            line for line in metrics.splitlines() if line.startswith('adstream_serving_requests_total{status="200"}')
        ]
        assert counted and float(counted[0].rsplit(" ", 1)[1]) >= sent + 2, counted  # summed over the workers
    finally:
        stop_process(server)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
