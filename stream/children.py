"""Run N worker processes of one kind (featurizer, joiner) and stop them together."""

from __future__ import annotations

import multiprocessing
import signal
import time
from collections.abc import Callable, Sequence


def run_children(target: Callable[..., object], args: Sequence[tuple]) -> int:
    """One process per args tuple, each `target(*args)`. Returns when one exits (the others are
    stopped with SIGTERM, then SIGKILL after 30 s) or on SIGINT/SIGTERM; the exit code is the first
    non-zero child's (0 when stopped by a signal)."""
    context = multiprocessing.get_context("spawn")
    children = []
    for child_args in args:
        child = context.Process(target=target, args=child_args)
        child.start()
        children.append(child)
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping and all(c.is_alive() for c in children):
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
    return 0 if stopping else next((c for c in codes if c), 0)
