"""Run N worker processes of one kind (featurizer, joiner) and stop them together."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Sequence

from common.processes import die_with_parent, stop_requested


def _child(parent: int, target: Callable[..., object], args: tuple) -> None:
    die_with_parent(parent)  # a parent killed with SIGKILL takes its workers with it
    target(*args)


def run_children(target: Callable[..., object], args: Sequence[tuple], finite: bool = False) -> int:
    """One process per args tuple, each `target(*args)`. Returns when one exits (the others are
    stopped with SIGTERM, then SIGKILL after 30 s; with `finite`, children that end their work and
    exit 0 are waited for until all have, and only a failing one stops the rest) or on
    SIGINT/SIGTERM; the exit code is the first non-zero child's (0 when stopped by a signal).
    Children never outlive this process."""
    context = multiprocessing.get_context("spawn")
    children = []
    for child_args in args:
        child = context.Process(target=_child, args=(os.getpid(), target, child_args))
        child.start()
        children.append(child)
    stopping = stop_requested()

    def running() -> bool:
        if finite:
            return any(c.is_alive() for c in children) and not any(c.exitcode for c in children)
        return all(c.is_alive() for c in children)

    while not stopping() and running():
        time.sleep(0.2)
    for child in children:
        if child.is_alive():
            child.terminate()
    for child in children:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join()
    codes = [c.exitcode or 0 for c in children]
    return 0 if stopping() else next((c for c in codes if c), 0)
