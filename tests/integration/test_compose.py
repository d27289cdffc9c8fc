"""docker-compose.yml really run: the stack up on podman (docker/podman/compose.sh, images from
`make images`), synthetic events replayed by the replayer service, CTRs from the serving container,
the same CTRs from `adstream serve` on the host, the trainer container restarted and resuming from
its snapshot volume, and the stack down leaving no containers.

Needs podman, docker-compose and the images: `make test` builds them first (docker/images.sh);
under CI=true a missing engine fails the test."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from adstream.config import build_config
from adstream.demo import wait_for_model
from adstream.processes import stop_process
from tests.helpers import criteo_event
from tests.integration.helpers import start_cli
from trainer.group import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "podman" / "compose.sh"
PROJECT = "adstreamtest"
SERVING = "http://127.0.0.1:18000"
MLFLOW = "http://127.0.0.1:15000"


def compose(
    env_file: Path, *args: str, timeout_s: float = 600, check: bool = True, project: str = PROJECT, file: str = ""
) -> str:
    """docker/podman/compose.sh on the test's project (`file`: another compose file than
    docker-compose.yml); its output (an assertion names a failure)."""
    files = ["-f", file] if file else []
    result = subprocess.run(
        [str(COMPOSE), *files, "--env-file", str(env_file), *args],
        cwd=ROOT,
        env={**os.environ, "COMPOSE_PROJECT_NAME": project},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if check:
        assert result.returncode == 0, (
            f"compose {' '.join(args)}: {result.returncode}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    return result.stdout + result.stderr


def containers() -> list[str]:
    out = subprocess.run(
        ["podman", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


def until(what: str, check, timeout_s: float, every_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


def require_engine() -> None:
    """podman and docker-compose here, or the test fails (CI=true) or skips (elsewhere)."""
    for tool in ("podman", "docker-compose"):
        if shutil.which(tool) is None:
            message = f"{tool} is not installed: `make images` installs it (apt-get)"
            if os.environ.get("CI") == "true":
                pytest.fail(message, pytrace=False)
            pytest.skip(message)


@pytest.fixture(scope="module")
def stack_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """The compose stack up (project adstreamtest), its serving token from an env file; down -v after
    (again, should the test have failed before its own)."""
    require_engine()
    token = uuid.uuid4().hex
    env_file = tmp_path_factory.mktemp("compose") / ".env"
    env_file.write_text(f"ADSTREAM_SERVING_TOKEN={token}\n")
    try:
        compose(env_file, "up", "-d")
        yield env_file, token
    finally:
        if containers():  # the test failed before its own down: show why
            print(compose(env_file, "logs", "--no-color", "--tail", "40")[-8000:])
        # always: down also ends compose.sh's podman socket and health loop
        compose(env_file, "down", "-v", "--timeout", "20", timeout_s=300, check=False)


def test_compose_stack_replays_trains_serves_and_resumes(stack_env, tmp_path):
    env_file, token = stack_env
    auth = {"Authorization": f"Bearer {token}"}
    # exposure: serving's routes need the env file's token
    until("serving up", lambda: httpx.get(f"{SERVING}/healthz", timeout=2).status_code == 200, 300)
    assert httpx.get(f"{SERVING}/model", timeout=5).status_code == 401

    compose(
        env_file,
        "--profile",
        "replay",
        "run",
        "--rm",
        "-T",
        "replay",
        "replay",
        "--synthetic",
        "100000",
        "--rate",
        "50000",
    )
    model = until(
        "a registered version served",
        lambda: (r := httpx.get(f"{SERVING}/model", headers=auth, timeout=5)).status_code == 200 and r.json(),
        600,
    )
    assert model["step"] > 0

    # the image is the product: the same snapshot served on the host gives the same CTRs; the trainer
    # stopped first, so neither side moves on to a newer version or delta meanwhile
    compose(env_file, "stop", "trainer")
    events = [{k: v for k, v in criteo_event(i).items() if k != "label"} for i in range(20)]
    port = free_port()
    # a download cache of its own (the product keys its cache by run and source too: test_serving_registry.py)
    serving = {"port": port, "cache_dir": str(tmp_path / "serving-cache"), "log_impressions": False}
    config = build_config({"mlflow": {"tracking_uri": MLFLOW}, "serving": serving})
    server, log = start_cli(config, tmp_path, "serve")
    try:
        host = f"http://127.0.0.1:{port}"

        def same_model() -> dict | None:
            ours = httpx.get(f"{SERVING}/model", headers=auth, timeout=5).json()
            theirs = wait_for_model(host, server, 120, log)
            keys = ("model_version", "step", "sequence")
            return ours if all(ours.get(k) == theirs.get(k) for k in keys) else None

        served = until("the container and the host serving one model", same_model, 120)
        ctr_container = httpx.post(f"{SERVING}/predict", json=events, headers=auth, timeout=30)
        ctr_host = httpx.post(f"{host}/predict", json=events, timeout=30)
        assert ctr_container.status_code == ctr_host.status_code == 200, ctr_container.text + ctr_host.text
        ours = [p["ctr"] for p in ctr_container.json()["predictions"]]
        theirs = [p["ctr"] for p in ctr_host.json()["predictions"]]
        assert ours == pytest.approx(theirs, abs=1e-6) and len(set(ours)) > 1
        assert ctr_container.json()["model_version"] == served["model_version"]
        # the loop in compose: what the container scored went to the joiner's topic
        until(
            "the container's impressions logged",
            lambda: httpx.get(f"{SERVING}/model", headers=auth, timeout=5).json()["log"]["delivered"] >= len(events),
            60,
        )
    finally:
        stop_process(server)

    # the trainer container restarted resumes from the newest snapshot on its volume
    compose(env_file, "start", "trainer")
    logs = until(
        "the restarted trainer resuming",
        lambda: "resumes from" in (out := compose(env_file, "logs", "--no-color", "trainer")) and out,
        180,
    )
    assert "/var/lib/adstream/snapshots/" in logs
    resumed_step = int(logs.rsplit("resumes from", 1)[1].split("(step ", 1)[1].split(")", 1)[0])
    assert resumed_step > 0

    assert containers(), "the stack's containers are listed while it runs"
    compose(env_file, "down", "-v", "--timeout", "20")
    assert containers() == []
