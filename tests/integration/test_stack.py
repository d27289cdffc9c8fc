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


def test_a_command_that_needs_the_stack_leaves_it_as_it_found_it(stack, tmp_path):
    """`stack.running` (the benchmarks): a stack that was up stays up; one it started is stopped after
    (a bench once left a broker on the stack's ports, and the compose test could not take them)."""
    from dataclasses import replace

    from adstream import stack as local_stack
    from adstream.processes import port_open

    with local_stack.running(stack.stack, stack.kafka):
        pass
    assert all(service["up"] for service in local_stack.status(stack.stack).values())

    base = stack.stack.kafka_port + 7  # (free ports beside the session's stack)
    fresh = replace(
        stack.stack,
        state_dir=str(tmp_path / "stack"),
        kafka_port=base,
        controller_port=base + 1,
        mlflow_port=stack.stack.mlflow_port + 7,
    )
    ports = (fresh.kafka_port, fresh.mlflow_port)
    assert not any(port_open(p) for p in ports)
    try:
        with local_stack.running(fresh, replace(stack.kafka, bootstrap=fresh.bootstrap)):
            assert all(service["up"] for service in local_stack.status(fresh).values())
        assert not any(port_open(p) for p in ports)
        assert not any(service["pid"] for service in local_stack.status(fresh).values())
    finally:
        local_stack.down(fresh)
