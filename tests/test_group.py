"""A local group of replicas (`adstream train --workers N`, launch_local) listens on nothing another
machine can reach: it meets through a FileStore, and gloo's connections stay on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import gone_within, pid_files, running
from trainer.group import launch_local

LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::1


def listening_addresses() -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) this process listens on."""
    mine = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in mine:  # state LISTEN, socket inode ours
                found.append(fields[1].split(":")[0])
    return found


def collective_then_sockets() -> list[str]:
    total = torch.ones(1)
    dist.all_reduce(total)  # the group is formed and gloo's pairs are connected
    assert total.item() == dist.get_world_size()
    return listening_addresses()


def test_a_local_group_listens_on_loopback_only():
    for addresses in launch_local(collective_then_sockets, 2):
        assert all(a in LOOPBACK for a in addresses), addresses


PEER = """
import sys, time
import torch, torch.distributed as dist
from trainer.group import in_group

def work(rank, world):
    if rank == 0:
        raise ValueError("rank 0 fails before its first collective")
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError:
        print(f"peer failed after {time.monotonic() - start:.1f}s")
        sys.exit(3)

in_group("cpu", work)
"""


def test_a_rank_that_fails_lets_its_peers_fail_at_once_not_after_the_collective_timeout(tmp_path):
    """A rank's error abandons the group (no barrier): its peer's collective fails in seconds, and a
    supervisor can restart the group, instead of both waiting out COLLECTIVE_TIMEOUT (5 minutes)."""
    import subprocess
    import sys
    import time

    from trainer.group import group_env, new_store_file, remove_store_file

    store = new_store_file()
    root = Path(__file__).resolve().parent.parent
    start = time.monotonic()
    procs: list[subprocess.Popen[str]] = []
    try:
        procs += [
            subprocess.Popen(
                [sys.executable, "-c", PEER],
                env={**os.environ, **group_env(rank, 2, store), "PYTHONPATH": str(root)},
                cwd=root,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for rank in range(2)
        ]
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        remove_store_file(store)
    assert [p.returncode for p in procs] == [1, 3]  # rank 0 raised; rank 1's collective failed
    assert "peer failed after" in outputs[1] and time.monotonic() - start < 60


REPLICA = (  # writes its pid to a file named attempt-rank in the folder argv[1] (whole: renamed in), sleeps
    "import os, sys, time; "
    "name = os.path.join(sys.argv[1], os.environ['ADSTREAM_ATTEMPT'] + '-' + os.environ['RANK']); "
    "open(name + '.new', 'w').write(str(os.getpid())); os.replace(name + '.new', name); "
    "time.sleep(120)"
)


def start_supervisor(folder: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """A supervisor of 2 replicas that write their pid to `folder` and sleep; returns it and their pids."""
    script = (
        "import sys; from trainer.group import supervise; "
        f"code = supervise([{str(folder)!r}], 2, 3, poll_s=0.1, program=(sys.executable, '-c', {REPLICA!r})); "
        "print('exit', code, flush=True)"
    )
    sup = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(pid_files(folder)) < 2:
        assert time.monotonic() < deadline, "the replicas never started"
        time.sleep(0.1)
    return sup, [int(p.read_text()) for p in pid_files(folder)]


def test_replicas_die_with_a_supervisor_killed_with_sigkill(tmp_path):
    sup, replicas = start_supervisor(tmp_path)
    try:
        sup.kill()  # no handler runs: only the kernel's parent-death signal can stop the replicas
        sup.wait(timeout=10)
        assert gone_within(replicas, 10), f"replicas {replicas} outlived their supervisor"
    finally:
        for pid in replicas:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_operators_stop_to_the_supervisor_stops_the_replicas_without_a_restart(tmp_path, stop):
    sup, replicas = start_supervisor(tmp_path)
    try:
        sup.send_signal(stop)
        out, err = sup.communicate(timeout=30)
        assert f"exit {128 + stop}" in out, (out, err)
        assert "restart" not in err
        assert gone_within(replicas, 5)
        assert [p.name for p in pid_files(tmp_path)] == ["0-0", "0-1"]  # no second attempt started
    finally:
        for pid in replicas:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
