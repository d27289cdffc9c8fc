"""RocksTier: every row in RocksDB (rocksdict, raw mode), read and written in batches.

Key: the id as 8 big-endian bytes. Value: the row's float32 values, then its bookkeeping
(last_seen int64, freq int64), so a row's state and its policy data travel together.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from store.errors import StoreError
from store.tier import Tier

_META_BYTES = 16
TABLE_FORMATS = ("plain", "block")  # RocksDB table file formats (see RocksTier.__init__)


def _keys(ids: np.ndarray) -> list[bytes]:
    """ids (n,) -> their keys, 8 big-endian bytes each. Through an 8-byte void view, numpy makes the
    bytes objects in C (5x faster than slicing a buffer in Python: 12k keys 1.3 -> 0.24 ms)."""
    return ids.astype(">i8").view("V8").tolist()  # type: ignore[no-any-return]


class RocksTier(Tier):
    def __init__(
        self,
        path: str | Path,
        width: int,
        capacity_bytes: int,
        block_cache_mb: int = 256,
        wal: bool = True,
        table_format: str = "plain",
    ) -> None:
        """wal=False skips RocksDB's write-ahead log: for a store whose durability point is its own
        checkpoint (the hierarchy: flush + RocksDB checkpoint), not each write. table_format: "plain"
        (PlainTable files: fastest point lookups, an in-memory index of ~14 bytes per row) or "block"
        (block-based files: ~1.5x slower lookups, a few bytes of memory per row)."""
        from rocksdict import (
            DBCompressionType,
            MemtableFactory,
            Options,
            PlainTableFactoryOptions,
            Rdict,
            SliceTransform,
        )

        if capacity_bytes <= 0:
            raise StoreError(f"RocksTier: capacity_bytes={capacity_bytes}; set a positive disk budget in bytes")
        if table_format not in TABLE_FORMATS:
            raise StoreError(f"RocksTier: table_format={table_format!r}; use one of {list(TABLE_FORMATS)}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.width = width
        self.capacity_bytes = capacity_bytes
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        options.increase_parallelism(os.cpu_count() or 2)
        options.set_compression_type(DBCompressionType.none())  # float rows do not compress; reads skip a decode
        # point lookups: bloom filters, a hash index inside each data block, a block cache (for block-based
        # files), a memtable bloom filter, and files read through mmap (no copy into a buffer per read)
        options.optimize_for_point_lookup(block_cache_mb)
        options.set_allow_mmap_reads(True)
        # PlainTable files instead of block-based ones: each file keeps an in-memory hash index of
        # its keys (every key is its own 8-byte prefix, see below) and a bloom filter, so a lookup is
        # a hash probe into the mapped file instead of a binary search of an index block and a block
        # read: a multi-get of 12k keys from 5M rows 2.85 -> 1.7-2.3 us a key. What it gives up:
        # compression (rows are floats: none anyway), block checksums, Seek() to an arbitrary key
        # (our scans go from the first key, in total order, which it serves), Prev(); and it holds its
        # index in memory: ~14 bytes of RAM per row on disk (50M rows: anonymous RSS 2.15 -> 2.85 GB).
        # A database (or checkpoint) written with block-based files still opens and reads: RocksDB
        # picks each file's reader by the format in its footer, and compactions rewrite them as PlainTable.
        if table_format == "plain":
            plain = PlainTableFactoryOptions()
            plain.user_key_length = 8
            options.set_plain_table_factory(plain)
        # writes land in a hash table of linked lists (the whole 8-byte key is the "prefix") instead
        # of a skip list: a write-back of 14k rows 20 -> 5 ms, time the IO thread holds the GIL in
        # rocksdict. The cost: a scan must ask for total order (all_ids does), and one writer at a time.
        options.set_prefix_extractor(SliceTransform.create_fixed_prefix(8))
        # (the bucket count is the binding's one argument; its type stub leaves it out)
        options.set_memtable_factory(MemtableFactory.hash_link_list(1 << 20))  # type: ignore[call-arg]
        options.set_allow_concurrent_memtable_write(False)
        self.db = Rdict(str(self.path), options=options)
        self.set_wal(wal)
        self._count = sum(1 for _ in self._keys())

    def set_wal(self, wal: bool) -> None:
        from rocksdict import WriteOptions

        write_options = WriteOptions()
        write_options.disable_wal = not wal  # type: ignore[method-assign,assignment] # an attribute at runtime
        self.db.set_write_options(write_options)

    @property
    def row_bytes(self) -> int:
        return self.width * 4 + _META_BYTES + 8

    def __len__(self) -> int:
        return self._count

    def bytes_used(self) -> int:
        return self._count * self.row_bytes

    def _get(self, ids: np.ndarray) -> list[bytes | None]:
        return self.db.get(_keys(ids)) if len(ids) else []  # type: ignore[arg-type,return-value]

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """found (n,) for ids, without decoding the rows."""
        return np.fromiter((v is not None for v in self._get(ids)), dtype=bool, count=len(ids))

    def read_with_meta(self, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray]:
        """rows (n, width), found (n,), last_seen (n,), freq (n,)."""
        values = self._get(ids)
        vector_bytes = self.width * 4
        # the usual case (a hierarchy reads what it knows is here) has no None: no per-key Python then
        all_found = values.count(None) == 0
        present = values if all_found else [v for v in values if v is not None]
        joined = b"".join(present)  # type: ignore[arg-type] # (no None in it)
        raw = np.frombuffer(joined, dtype=np.uint8).reshape(len(present), vector_bytes + _META_BYTES)
        rows = raw[:, :vector_bytes].copy().view(np.float32)
        meta = raw[:, vector_bytes:].copy().view(np.int64)
        found = np.ones(len(ids), dtype=bool)
        if not all_found:  # spread the present rows out, zeros where a key is missing
            found = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
            rows_all = np.zeros((len(ids), self.width), dtype=np.float32)
            meta_all = np.zeros((len(ids), 2), dtype=np.int64)
            rows_all[found], meta_all[found] = rows, meta
            rows, meta = rows_all, meta_all
        return torch.from_numpy(rows), found, meta[:, 0], meta[:, 1]

    def read(self, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        rows, found, _, _ = self.read_with_meta(ids)
        return rows, found

    def write(
        self,
        ids: np.ndarray,
        rows: torch.Tensor,
        step: int = 0,
        last_seen: np.ndarray | None = None,
        freq: np.ndarray | None = None,
        new_rows: int | None = None,
    ) -> None:
        """Insert or overwrite; new_rows: how many ids are absent, when the caller knows (the
        hierarchy tracks which cached rows have a copy here), which saves a multi-get."""
        if rows.shape != (len(ids), self.width):
            raise StoreError(f"RocksTier.write: rows shape {tuple(rows.shape)}, expected ({len(ids)}, {self.width})")
        self.reserve(int((~self.contains(ids)).sum()) if new_rows is None else new_rows)
        self.put(ids, rows, np.full(len(ids), step) if last_seen is None else last_seen, freq)

    def reserve(self, new_rows: int) -> None:
        """Count new_rows more rows, or raise if they would exceed the disk budget (a write does
        this; the hierarchy's background write-back does it on the caller's thread, then `put`)."""
        if (self._count + new_rows) * self.row_bytes > self.capacity_bytes:
            raise StoreError(
                f"RocksTier at {self.path}: {self._count + new_rows} rows exceed the disk budget of "
                f"{self.capacity_bytes} bytes; raise store.disk_bytes"
            )
        self._count += new_rows

    def put(self, ids: np.ndarray, rows: torch.Tensor, last_seen: np.ndarray, freq: np.ndarray | None = None) -> None:
        """Write rows with their bookkeeping, no counting (the caller reserved them). Thread-safe
        against reads: RocksDB applies a write batch atomically."""
        from rocksdict import WriteBatch

        meta = np.zeros((len(ids), 2), dtype=np.int64)
        meta[:, 0] = last_seen
        meta[:, 1] = 1 if freq is None else freq
        payload = np.concatenate(
            [rows.detach().cpu().numpy().astype(np.float32).view(np.uint8), meta.view(np.uint8)], axis=1
        )
        batch = WriteBatch(raw_mode=True)
        # one bytes object per row through a void view of the row's width (made in C, not per row in Python)
        for key, value in zip(_keys(ids), payload.view(f"V{payload.shape[1]}").ravel().tolist(), strict=True):
            batch.put(key, value)
        self.db.write(batch)

    def write_new(self, ids: np.ndarray, rows: torch.Tensor) -> None:
        """Bulk insert of ids known to be absent (no existence check), e.g. loading a table."""
        self.reserve(len(ids))
        self.put(ids, rows, np.zeros(len(ids), dtype=np.int64))

    def remove(self, ids: np.ndarray) -> int:
        from rocksdict import WriteBatch

        present = [k for k, v in zip(_keys(ids), self._get(ids), strict=True) if v is not None]
        batch = WriteBatch(raw_mode=True)
        for key in present:
            batch.delete(key)
        self.db.write(batch)
        self._count -= len(present)
        return len(present)

    def all_ids(self) -> np.ndarray:
        keys = b"".join(self._keys())
        return np.frombuffer(keys, dtype=">i8").astype(np.int64)

    def _keys(self) -> Iterator[bytes]:
        """Every key in order. Total-order seek: with a prefix extractor a plain scan may skip keys.
        A scan from the first key is all PlainTable files offer in total order: never Seek() to a key."""
        from rocksdict import ReadOptions

        read_options = ReadOptions()
        read_options.set_total_order_seek(True)
        return self.db.keys(read_opt=read_options)  # type: ignore[return-value]

    def checkpoint(self, path: str | Path) -> None:
        """A consistent on-disk copy (hard links where possible) of the database at `path`."""
        from rocksdict import Checkpoint

        self.db.flush()
        Checkpoint(self.db).create_checkpoint(str(path))

    def close(self) -> None:
        self.db.close()
