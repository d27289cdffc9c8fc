"""TieredStore: device -> host RAM -> RocksDB behind the one Tier interface.

- device tier (on a CUDA device): a fixed tensor of rows in HBM; every row a batch trains ends
  up here. A CPU trainer has none (`device_tier=False`): its top cache is the RAM tier, since a
  device tier in host memory would only copy and index every row twice.
- RAM tier: host memory (pinned under CUDA), exclusive with the device tier: a row's live state
  is in exactly one of the caches, never split.
- RocksDB: every row that has left the caches, and every row at a checkpoint (write-back).

Per batch, vectorized: `read` resolves each id to the highest tier holding it; `write` puts the
updated rows in the top cache, evicting others (LRU or LFU) down a level, and the last cache's
victims to RocksDB when they are dirty. Rows unseen for `ttl_steps` are dropped from every tier.
Everything is counted in `stats()`.

Pipelined (`pipelined=True`, the default): RocksDB traffic runs on one IO thread (pipeline.py).
`prefetch(ids)` of the next batch reads its cold rows while this batch trains, and dirty
victims are written down in the background; reads see in-flight rows first, so the results are
those of the serial store (tests/test_hierarchy.py pins it).
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from store.configs import HierarchyConfig
from store.errors import StoreError
from store.pipeline import RocksPipeline
from store.ram import RamTier
from store.rocks import RocksTier
from store.tier import Tier

CHECKPOINT_MANIFEST = "manifest.json"  # written last: a checkpoint folder without it is incomplete


class TieredStore(Tier):
    def __init__(self, width: int, config: HierarchyConfig) -> None:
        self.width = width
        self.config = config
        self.capacity_bytes = config.disk_bytes
        self.device = (
            RamTier(width, config.device_bytes, device=config.device, preallocate=True) if config.device_tier else None
        )
        self.ram = RamTier(width, config.ram_bytes, pin=config.device.startswith("cuda"))
        # the caches, fastest first: a trained row is written to caches[0]; a victim of caches[i]
        # moves down to caches[i + 1], a victim of the last one goes to RocksDB (if it is dirty)
        self.caches = [self.device, self.ram] if self.device is not None else [self.ram]
        self._names = ["device", "ram"] if self.device is not None else ["ram"]
        self.rocks = RocksTier(  # durability = checkpoint
            config.path, width, config.disk_bytes, wal=False, table_format=config.rocksdb_format
        )
        self.io = RocksPipeline(self.rocks, asynchronous=config.pipelined)  # the hot path's RocksDB traffic
        self.step = 0
        # ids the last read looked for in RocksDB (sorted) and whether it had them: rows coming up
        # to the device carry that knowledge, so writing them back later needs no existence check
        self._cold_ids = np.zeros(0, dtype=np.int64)
        self._cold_found = np.zeros(0, dtype=bool)
        # (ids, their slots in the top cache) of the last read: the trainer writes the very rows it
        # read, and nothing moves in the caches in between, so that write needs no second lookup.
        # Any change to the caches forgets it.
        self._read_slots: tuple[np.ndarray, np.ndarray] | None = None
        self.counters: Counter[str] = Counter()
        self._expired: list[np.ndarray] = []  # ids dropped by TTL since the last take_expired()
        if any(cache.capacity_rows < 1 for cache in self.caches):
            raise StoreError(
                f"hierarchy: device_bytes and ram_bytes must each hold at least one row ({self.ram.row_bytes} bytes)"
            )

    # --- the Tier interface -------------------------------------------------------------
    def read(self, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        # the top cache's answer is the start (its rows are zeros where it has none)
        rows, top_slots = self.caches[0].read_slots(ids)
        self._read_slots = (ids, top_slots)
        top_found = top_slots >= 0
        found = top_found.copy()
        rest = np.nonzero(~found)[0]
        self.counters[f"{self._names[0]}_hits"] += int(top_found.sum())
        for name, cache in zip(self._names[1:], self.caches[1:], strict=True):
            c_rows, c_found = cache.read(ids[rest])
            self.counters[f"{name}_hits"] += int(c_found.sum())
            rest = _fill(rows, found, rest, c_rows, c_found)
        c_rows, c_found = self.io.read(ids[rest])
        order = np.argsort(ids[rest], kind="stable")
        self._cold_ids, self._cold_found = ids[rest][order], c_found[order]
        self.counters["rocksdb_hits"] += int(c_found.sum())
        _fill(rows, found, rest, c_rows, c_found)
        self.counters["misses"] += int((~found).sum())
        return rows, found

    def write(self, ids: np.ndarray, rows: torch.Tensor, step: int = 0) -> None:
        """Put rows (for unique ids) on the device tier, making room by eviction. A write larger
        than the device tier (a replica merge writes back every row touched since the last merge)
        goes through in chunks: earlier chunks are evicted down to make room for later ones."""
        self.step = max(self.step, step)
        read = self._read_slots
        self._read_slots = None
        known = read[1] if read is not None and read[0] is ids else None  # the last read's slots of these ids
        chunk = self.caches[0].capacity_rows
        for start in range(0, len(ids), chunk):
            end = start + chunk
            slots = known[start:end] if known is not None and start == 0 else None  # later chunks: moved since
            self._write_chunk(ids[start:end], rows[start:end], upcoming=ids[start:], top_slots=slots)
        if self.config.ttl_steps:
            self.expire()

    def _write_chunk(
        self, ids: np.ndarray, rows: torch.Tensor, upcoming: np.ndarray, top_slots: np.ndarray | None
    ) -> None:
        """Put ids (at most the top cache's capacity) in the top cache; top_slots: their slots
        there, if known. Making room never evicts these ids (so their slots stay valid), nor
        `upcoming` ones (this and later chunks) from the caches below."""
        top = self.caches[0]
        slots = top.slots(ids) if top_slots is None else top_slots
        new = slots < 0
        new_ids = ids[new]
        # rows coming up from a lower cache leave it first (making room there) and carry their bookkeeping
        freq = np.zeros(len(new_ids), dtype=np.int64)
        on_disk = np.zeros(len(new_ids), dtype=bool)
        cached = np.zeros(len(new_ids), dtype=bool)
        for cache in self.caches[1:]:
            below = cache.slots(new_ids)
            held = below >= 0
            if held.any():
                freq[held] = cache.freq[below[held]]
                on_disk[held] = cache.on_disk[below[held]]
                cache.remove(new_ids[held])
                cached |= held
        on_disk |= self._known_on_disk(new_ids, ~cached)
        need = len(new_ids) - top.free_rows
        if need > 0:
            self._evict(0, need + int(self.config.evict_slack * top.capacity_rows), ids, upcoming)
        self.counters["promotions"] += len(new_ids)
        slots = top.write_slots(ids, rows, step=self.step, slots=slots)
        if len(new_ids):  # promoted rows keep their frequency and what RocksDB holds of them
            promoted = slots[new]
            top.last_seen[promoted] = self.step
            top.freq[promoted] += freq
            top.on_disk[promoted] = on_disk

    def _known_on_disk(self, ids: np.ndarray, ask: np.ndarray) -> np.ndarray:
        """on_disk (n,) for ids[ask] (False elsewhere): from the last read where it looked them up,
        else asked of RocksDB (writes that no read preceded, e.g. a replica merge)."""
        out = np.zeros(len(ids), dtype=bool)
        where = np.nonzero(ask)[0]
        known = np.zeros(len(where), dtype=bool)
        if len(where) and len(self._cold_ids):
            pos = np.searchsorted(self._cold_ids, ids[where]).clip(max=len(self._cold_ids) - 1)
            known = self._cold_ids[pos] == ids[where]
            out[where[known]] = self._cold_found[pos[known]]
        if (~known).any():
            out[where[~known]] = self.io.contains(ids[where[~known]])
        return out

    @property
    def prefetches(self) -> bool:
        """Whether `prefetch` reads ahead (config.pipelined); the serial store ignores it."""
        return self.config.pipelined

    def prefetch(self, ids: np.ndarray) -> None:
        """The next batch's ids (sorted, unique: the table dedups them), called after this batch's
        `read`: start reading the rows neither the device nor the RAM tier holds from RocksDB in
        the background; the next `read` uses them. Ids this batch just read from RocksDB are
        skipped (its `write` promotes them)."""
        cold = ~self._cached(ids)
        if len(self._cold_ids):
            pos = np.searchsorted(self._cold_ids, ids).clip(max=len(self._cold_ids) - 1)
            cold &= self._cold_ids[pos] != ids
        self.io.prefetch(ids[cold])

    def load_rows(self, ids: np.ndarray, rows: torch.Tensor) -> None:
        """Bulk load into RocksDB (rows come up to the device tier when a batch touches them)."""
        self.io.drain()
        for start in range(0, len(ids), 65536):
            self.rocks.write(ids[start : start + 65536], rows[start : start + 65536], step=self.step)

    def remove(self, ids: np.ndarray) -> int:
        self._read_slots = None
        present = self._cached(ids) | self.io.contains(ids)
        for cache in self.caches:
            cache.remove(ids)
        self.io.remove(ids)
        return int(present.sum())

    def all_ids(self) -> np.ndarray:
        self.io.drain()
        return np.unique(np.concatenate([*(cache.all_ids() for cache in self.caches), self.rocks.all_ids()]))

    def __len__(self) -> int:
        return len(self.all_ids())

    def bytes_used(self) -> int:
        return sum(cache.bytes_used() for cache in self.caches) + self.rocks.bytes_used()

    def _cached(self, ids: np.ndarray) -> np.ndarray:
        """held (n,): some cache (device or RAM) holds the row."""
        held = self.caches[0].contains(ids)
        for cache in self.caches[1:]:
            held |= cache.contains(ids)
        return held

    # --- movement between tiers ---------------------------------------------------------
    def _evict(self, level: int, count: int, keep: np.ndarray, keep_below: np.ndarray) -> None:
        """Make room in caches[level]: `count` victims (never ids in `keep`) move down to the next
        cache, evicting from it in turn (never ids in `keep_below`). Dirty victims that no cache
        takes (the last cache's, or those the next one has no room for) are written back to RocksDB."""
        cache = self.caches[level]
        victims = cache.victims(count, self.config.policy, keep)
        if not len(victims):
            return
        last_seen, freq, dirty = cache.meta(victims)
        on_disk = cache.disk_flags(victims)
        moved = 0
        if level + 1 < len(self.caches):
            below = self.caches[level + 1]
            rows, _ = cache.read(victims)
            need = len(victims) - below.free_rows
            if need > 0:
                slack = int(self.config.evict_slack * below.capacity_rows)
                self._evict(level + 1, need + slack, keep_below, keep_below)
            moved = min(len(victims), below.free_rows)
            below.write(victims[:moved], rows[:moved].cpu(), dirty=dirty[:moved])
            below.set_meta(victims[:moved], last_seen[:moved], freq[:moved], on_disk[:moved])
        # what no cache takes goes down to RocksDB if RocksDB's copy is older (dirty)
        down = moved + np.nonzero(dirty[moved:])[0]
        if len(down):
            rows, _ = cache.read(victims[down])
            self.io.write(victims[down], rows, last_seen[down], freq[down], int((~on_disk[down]).sum()))
            self.counters["writebacks"] += len(down)
        cache.remove(victims)
        self.counters[f"{self._names[level]}_evictions"] += len(victims)

    def expire(self) -> int:
        """Drop rows unseen for ttl_steps from the device and RAM tiers (RocksDB: expire_cold)."""
        horizon = self.step - self.config.ttl_steps
        self._read_slots = None
        dropped = 0
        for tier in self.caches:
            ids, slots = tier.resident()
            old = ids[tier.last_seen[slots] < horizon]
            if len(old):
                tier.remove(old)
                self.io.remove(old)
                self._expired.append(old)
                dropped += len(old)
        self.counters["expired"] += dropped
        return dropped

    def expire_cold(self) -> int:
        """Drop rows unseen for ttl_steps that only RocksDB holds (a scan of RocksDB: the trainer
        runs it at each snapshot, the hierarchy at each checkpoint). Returns how many."""
        if not self.config.ttl_steps:
            return 0
        self.io.drain()
        ids = self.rocks.all_ids()
        _, _, last_seen, _ = self.rocks.read_with_meta(ids)
        old = ids[last_seen < self.step - self.config.ttl_steps]
        old = old[~self._cached(old)]
        self.io.remove(old)
        self._expired.append(old)
        self.counters["expired"] += len(old)
        return len(old)

    def take_expired(self) -> np.ndarray:
        """Ids dropped by TTL since the last call (serving's deltas remove them too); resets."""
        expired = np.unique(np.concatenate(self._expired)) if self._expired else np.zeros(0, dtype=np.int64)
        self._expired = []
        return expired

    # --- persistence ------------------------------------------------------------------
    def flush(self) -> None:
        """Write every dirty cached row down to RocksDB (they stay cached, now clean)."""
        self.io.drain()
        for tier in self.caches:
            ids, slots = tier.resident()
            keep = tier.dirty[slots]
            ids, slots = ids[keep], slots[keep]
            if len(ids):
                rows, _ = tier.read(ids)
                self.rocks.write(
                    ids,
                    rows.cpu(),
                    last_seen=tier.last_seen[slots],
                    freq=tier.freq[slots],
                    new_rows=int((~tier.on_disk[slots]).sum()),
                )
                tier.dirty[slots] = False
                tier.on_disk[slots] = True

    def checkpoint(self, path: str | Path, extra: dict[str, object] | None = None) -> Path:
        """Flush, then a consistent RocksDB checkpoint + manifest at `path`. The folder appears
        complete or not at all (built under a temporary name, then renamed)."""
        self.expire_cold()
        self.flush()
        path = Path(path)
        tmp = path.with_name(path.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.rocks.checkpoint(tmp / "rocksdb")
        manifest = {
            "width": self.width,
            "step": self.step,
            "rows": len(self.rocks),
            "config": asdict(self.config),
            "counters": dict(self.counters),
            **(extra or {}),
        }
        (tmp / CHECKPOINT_MANIFEST).write_text(json.dumps(manifest, indent=2))
        fd = os.open(tmp, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        return path

    @classmethod
    def restore(cls, checkpoint: str | Path, config: HierarchyConfig) -> TieredStore:
        """A store whose RocksDB is a copy of the checkpoint's (at config.path) and whose caches are empty."""
        checkpoint = Path(checkpoint)
        manifest_file = checkpoint / CHECKPOINT_MANIFEST
        if not manifest_file.is_file():
            raise StoreError(f"restore: {checkpoint} has no {CHECKPOINT_MANIFEST}; it is not a complete checkpoint")
        manifest = json.loads(manifest_file.read_text())
        shutil.rmtree(config.path, ignore_errors=True)
        shutil.copytree(checkpoint / "rocksdb", config.path)
        store = cls(int(manifest["width"]), config)
        store.step = int(manifest["step"])
        return store

    def close(self) -> None:
        self.io.close()
        self.rocks.close()

    def stats(self) -> dict[str, float]:
        c = self.counters
        lookups = max(c["device_hits"] + c["ram_hits"] + c["rocksdb_hits"] + c["misses"], 1)
        return {
            "hit_rate_device": c["device_hits"] / lookups,
            "hit_rate_ram": c["ram_hits"] / lookups,
            "hit_rate_rocksdb": c["rocksdb_hits"] / lookups,
            "miss_rate": c["misses"] / lookups,
            "promotions": float(c["promotions"]),
            "device_evictions": float(c["device_evictions"]),
            "ram_evictions": float(c["ram_evictions"]),
            "writebacks": float(c["writebacks"]),
            "expired": float(c["expired"]),
            "rows_device": float(len(self.device)) if self.device is not None else 0.0,
            "rows_ram": float(len(self.ram)),
            "rows_rocksdb": float(len(self.rocks)),
            "bytes_device": float(self.device.bytes_used()) if self.device is not None else 0.0,
            "bytes_ram": float(self.ram.bytes_used()),
            "bytes_rocksdb": float(self.rocks.bytes_used()),
            "prefetch_overlap": self.io.overlap(),
            **{f"io_{key}": float(value) for key, value in sorted(self.io.counters.items())},
        }


def _fill(
    rows: torch.Tensor, found: np.ndarray, rest: np.ndarray, got: torch.Tensor, got_found: np.ndarray
) -> np.ndarray:
    """Copy into rows (n, width) what a lower tier found for positions `rest` (got (len(rest),
    width), got_found (len(rest),)), marking them found; returns the positions still missing.
    index_select / index_copy_: advanced indexing is several times slower on the CPU."""
    take = rest[got_found]
    hit = torch.from_numpy(np.nonzero(got_found)[0]).to(got.device)
    rows.index_copy_(0, torch.from_numpy(take).to(rows.device), got.index_select(0, hit).to(rows.device))
    found[take] = True
    return rest[~got_found]
