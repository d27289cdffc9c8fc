"""Worker processes (`stream --workers N`, `join --workers N`: stream/kafka/children.py) never outlive
the process that started them, even one killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import gone_within, pid_files, running


def nap(folder: str, name: str) -> None:
    """A worker: writes its pid to folder/name (whole: renamed in), then sleeps."""
    path = Path(folder, name)
    Path(f"{path}.new").write_text(str(os.getpid()))
    os.replace(f"{path}.new", path)
    time.sleep(120)


def test_workers_die_with_a_parent_killed_with_sigkill(tmp_path):
    script = (
        "from stream.kafka.children import run_children; from tests.test_children import nap; "
        f"run_children(nap, [({str(tmp_path)!r}, 'a'), ({str(tmp_path)!r}, 'b')])"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(pid_files(tmp_path)) < 2:
            assert time.monotonic() < deadline and parent.poll() is None, "the workers never started"
            time.sleep(0.1)
        workers = [int(p.read_text()) for p in pid_files(tmp_path)]
        parent.kill()
        parent.wait(timeout=10)
        assert gone_within(workers, 10), f"workers {workers} outlived their parent"
    finally:
        parent.kill()
        for pid in workers:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
