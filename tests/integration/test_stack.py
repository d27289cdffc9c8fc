"""The local stack's footprint: MLflow runs without its job runner (huey consumers beside the
server: 10 processes and 2.35 GB before), since adstream uses no MLflow jobs; `adstream status`
shows each service's processes and memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from adstream.processes import pid_alive, tree_memory

pytestmark = pytest.mark.integration


def test_the_stacks_mlflow_is_a_server_without_a_job_runner(stack):
    pid = pid_alive(Path(stack.stack.state_dir) / "mlflow.pid")
    assert pid
    count, rss = tree_memory(int(pid))
    assert count <= 3, f"mlflow runs {count} processes"  # the CLI, the server, its one uvicorn worker
    assert rss > 0
