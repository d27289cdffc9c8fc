"""RocksPipeline: the hierarchy's RocksDB reads ahead of need and its write-backs behind, on one
IO thread, so disk time hides behind the training step.

- prefetch(ids): while batch i trains, batch i+1's cold ids (held by neither the device nor the
  RAM tier) are read from RocksDB into a staging area. rocksdict's multi-get releases the GIL.
- write(...): evicted dirty rows go down asynchronously. Until RocksDB has them they stay in an
  *in-flight* list, and every read looks there first, so a row being written is never read stale.
- read(ids): in-flight rows (newest first), then staged rows that are still valid, then RocksDB.

Ordering is what keeps it exact: prefetches and writes run on the same single thread in the order
they were issued, so a prefetch sees every write issued before it; a staged row whose id was
written or removed after the prefetch was issued is dropped, never served. Everything else that
touches RocksDB (remove, scans, flush, checkpoint) calls `drain()` first and then runs on the
caller's thread. An exception on the IO thread is raised on the caller's thread at its next call.

Measured in `counters`: prefetch_read_s (IO-thread time reading ahead), prefetch_wait_s (time the
trainer still waited for it), sync_read_s (cold reads nobody prefetched), write_wait_s (waits for
write-backs); `overlap()` = the share of RocksDB read time hidden behind compute.
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from store.errors import StoreError
from store.rocks import RocksTier

MAX_IN_FLIGHT = 8  # write-backs queued before the caller waits for the oldest (bounds their memory)
SPLIT_READ_ROWS = 4096  # a prefetch this large is read as two multi-gets in parallel (they release the GIL)


@dataclass(frozen=True, eq=False)
class _WriteBack:
    ids: np.ndarray  # sorted, unique
    rows: torch.Tensor  # (n, width) on the host, in ids' order
    done: Future[None]


@dataclass(eq=False)
class _Staged:
    ids: np.ndarray  # sorted, unique: what the prefetch reads
    result: Future[tuple[torch.Tensor, np.ndarray, float]]  # rows, found, seconds spent reading
    stale: list[np.ndarray] = field(default_factory=list)  # ids written or removed since it was issued
    rows: torch.Tensor | None = None  # the result, once waited for
    found: np.ndarray | None = None


def _positions(sorted_ids: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each of ids: (hit (n,), position in sorted_ids where hit)."""
    if not len(sorted_ids):
        return np.zeros(len(ids), dtype=bool), np.zeros(len(ids), dtype=np.int64)
    pos = np.searchsorted(sorted_ids, ids).clip(max=len(sorted_ids) - 1)
    return sorted_ids[pos] == ids, pos


class RocksPipeline:
    def __init__(self, rocks: RocksTier, asynchronous: bool = True) -> None:
        """asynchronous=False: every call runs on the caller's thread (the serial reference)."""
        self.rocks = rocks
        self._io = ThreadPoolExecutor(1, thread_name_prefix="adstream-rocksdb") if asynchronous else None
        # a helper for the IO thread's large reads; only ever used from inside an IO-thread job, so
        # the order of reads and writes on the IO thread is kept
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="adstream-rocksdb-read") if asynchronous else None
        self._in_flight: list[_WriteBack] = []  # oldest first
        self._staged: _Staged | None = None
        self.counters: dict[str, float] = defaultdict(float)

    # --- reads ----------------------------------------------------------------------------
    def prefetch(self, ids: np.ndarray) -> None:
        """Start reading ids (sorted, unique: those the caches do not hold) in the background;
        replaces the earlier prefetch."""
        if self._io is None or not len(ids):
            return
        self._staged = _Staged(ids, self._io.submit(self._timed_read, ids))
        self.counters["prefetches"] += 1

    def _timed_read(self, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray, float]:
        started = time.perf_counter()
        if self._helper is None or len(ids) < SPLIT_READ_ROWS:
            rows, found = self.rocks.read(ids)
        else:
            half = len(ids) // 2
            other = self._helper.submit(self.rocks.read, ids[half:])
            first_rows, first_found = self.rocks.read(ids[:half])
            other_rows, other_found = other.result()
            rows, found = torch.cat([first_rows, other_rows]), np.concatenate([first_found, other_found])
        return rows, found, time.perf_counter() - started

    def read(self, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """ids int64 (n,) unique -> rows (n, width) and found (n,), the newest copy of each row."""
        self._settle()
        rows = torch.zeros((len(ids), self.rocks.width), dtype=torch.float32)
        found = np.zeros(len(ids), dtype=bool)
        for pending in reversed(self._in_flight):  # newest first: a later write-back wins
            hit, pos = _positions(pending.ids, ids)
            hit &= ~found
            if hit.any():
                rows[torch.from_numpy(hit)] = pending.rows[torch.from_numpy(pos[hit])]
                found |= hit
        rest = np.nonzero(~found)[0]
        staged = self._take_staged(ids[rest])
        if staged is not None:
            usable, staged_rows, staged_found = staged
            take = rest[usable]
            rows.index_copy_(0, torch.from_numpy(take), staged_rows)
            found[take] = staged_found
            rest = rest[~usable]
            self.counters["prefetched_rows"] += int(usable.sum())
        if len(rest):
            started = time.perf_counter()
            r_rows, r_found = self.rocks.read(ids[rest])
            self.counters["sync_read_s"] += time.perf_counter() - started
            self.counters["sync_read_rows"] += len(rest)
            rows.index_copy_(0, torch.from_numpy(rest), r_rows)
            found[rest] = r_found
        return rows, found

    def _take_staged(self, ids: np.ndarray) -> tuple[np.ndarray, torch.Tensor, np.ndarray] | None:
        """What the pending prefetch holds for ids: (usable (n,), rows, found) of the usable ones,
        or None. It stays until the next prefetch: a merge's read in between may use it too."""
        staged = self._staged
        if staged is None:
            return None
        if staged.rows is None:  # first use: wait for the IO thread (the part not hidden)
            started = time.perf_counter()
            try:
                staged.rows, staged.found, seconds = staged.result.result()
            except Exception as exc:
                raise StoreError(f"RocksDB at {self.rocks.path}: a background read failed: {exc}") from exc
            self.counters["prefetch_wait_s"] += time.perf_counter() - started
            self.counters["prefetch_read_s"] += seconds
        assert staged.found is not None
        usable, pos = _positions(staged.ids, ids)
        if staged.stale and usable.any():
            stale = np.isin(ids, np.concatenate(staged.stale))
            self.counters["prefetch_stale"] += int((usable & stale).sum())
            usable &= ~stale
        return usable, staged.rows.index_select(0, torch.from_numpy(pos[usable])), staged.found[pos[usable]]

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """found (n,): RocksDB has the row or will once the write-backs in flight land."""
        self._settle()
        out = np.zeros(len(ids), dtype=bool)
        for pending in self._in_flight:
            out |= _positions(pending.ids, ids)[0]
        rest = np.nonzero(~out)[0]
        out[rest] = self.rocks.contains(ids[rest])
        return out

    # --- writes ---------------------------------------------------------------------------
    def write(
        self, ids: np.ndarray, rows: torch.Tensor, last_seen: np.ndarray, freq: np.ndarray, new_rows: int
    ) -> None:
        """Write rows down (unique ids); new_rows of them are absent from RocksDB. The disk budget
        is checked here, on the caller's thread."""
        self.rocks.reserve(new_rows)
        if self._staged is not None:
            self._staged.stale.append(ids)
        rows = rows.detach().cpu()
        if self._io is None:
            self.rocks.put(ids, rows, last_seen, freq)
            return
        while len(self._in_flight) >= MAX_IN_FLIGHT:
            self._wait(self._in_flight[0].done, "write_wait_s")
            self._settle()
        order = np.argsort(ids, kind="stable")
        done = self._io.submit(self.rocks.put, ids, rows, last_seen, freq)
        self._in_flight.append(_WriteBack(ids[order], rows.index_select(0, torch.from_numpy(order)), done))

    def remove(self, ids: np.ndarray) -> int:
        """Drop rows from RocksDB (after every write-back in flight); returns how many were there."""
        self.drain()
        if self._staged is not None:
            self._staged.stale.append(ids)
        return self.rocks.remove(ids)

    # --- synchronisation ------------------------------------------------------------------
    def _wait(self, future: Future[None], counter: str) -> None:
        started = time.perf_counter()
        try:
            future.result()
        except Exception as exc:
            raise StoreError(f"RocksDB at {self.rocks.path}: a background write failed: {exc}") from exc
        self.counters[counter] += time.perf_counter() - started

    def _settle(self) -> None:
        """Forget write-backs that have landed (raising any that failed)."""
        while self._in_flight and self._in_flight[0].done.done():
            self._wait(self._in_flight.pop(0).done, "write_wait_s")

    def drain(self) -> None:
        """Wait until RocksDB holds every write-back issued (a pending prefetch stays usable)."""
        while self._in_flight:
            self._wait(self._in_flight[0].done, "write_wait_s")
            self._settle()

    def overlap(self) -> float:
        """Share of RocksDB read time hidden behind compute (1.0: the trainer never waited on a read)."""
        c = self.counters
        total = c["prefetch_read_s"] + c["sync_read_s"]
        return 0.0 if total <= 0 else max(0.0, c["prefetch_read_s"] - c["prefetch_wait_s"]) / total

    def close(self) -> None:
        self.drain()
        self._staged = None
        if self._io is not None:
            self._io.shutdown(wait=True)
        if self._helper is not None:
            self._helper.shutdown(wait=True)
