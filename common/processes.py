"""Child processes that never outlive their parent.

Every command that runs N workers (`adstream train --workers N`, `stream --workers N`, `join
--workers N`, the benchmarks' replica groups) starts them as children. Killed with SIGKILL, a parent
runs no handler, and its children would go on as orphans: replicas training and committing offsets
beside the group a restarted supervisor starts, featurizers holding partitions. So each child asks
the kernel first thing for SIGTERM when its parent dies, which its own handlers turn into an
orderly stop.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


def die_with_parent(parent: int) -> None:
    """Ask Linux to send this process SIGTERM when its parent dies, and exit now if the parent
    `parent` (a pid) is already gone (it may die before the request is made). Call it first thing
    in a child. No-op off Linux."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "die_with_parent: prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os._exit(128 + signal.SIGTERM)


def stop_requested() -> Callable[[], int]:
    """Catch SIGTERM and SIGINT from now on (an operator's stop; call it from the main thread); the
    returned function gives the first signal caught, 0 while none has come."""
    caught: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        caught.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return lambda: caught[0] if caught else 0


def process_tree(pid: int) -> dict[int, list[str]]:
    """A process and all its descendants: pid -> the fields of its /proc/PID/stat after the command
    name (fields[0] is the state, fields[1] the parent, fields[11:13] user and system ticks). Linux."""
    stats: dict[int, list[str]] = {}
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        stats[int(stat.parent.name)] = fields
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = {}, [pid]
    while todo:
        current = todo.pop()
        if current in stats:
            tree[current] = stats[current]
            todo += children.get(current, [])
    return tree
