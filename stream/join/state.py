"""The joiner's state on disk: one RocksDB per input partition (rocksdict), bounded by the window.

What one partition's database holds:
    b"e" + impression id  -> the id's Entry (stream/join/policy.py), encoded by `encode_entry`
    b"m"                  -> Progress: the next offsets of the impressions and clicks partitions,
                             the newest impression time seen (the watermark's source), the chunk number
    b"q"                  -> the outputs of the last chunk (`encode_outputs`), written before they are sent
    b"b" + offset, newest -> an Arrow bundle of impressions as read at that offset (its entries point at
                             their rows: RowRef), kept while an emission may need one of its rows

A chunk (the records of one poll) changes the entries in memory (`stage`), then `commit` writes
every change, the new Progress and the chunk's outputs in one atomic write batch, and only then are
the outputs sent in a Kafka transaction with the same offsets. So after any crash the database is
at a chunk's end, and the outputs of that chunk are in it: if the transaction did not commit (the
group's committed offsets are behind the database's), the joiner sends them again, in a new
transaction, before it reads on (stream/join/joiner.py). Entries are forgotten when their window and
the lateness allowance are over, so the database stays as large as the window, not the stream.

Timers are not stored: an entry's `due` is in it, and at start the joiner rebuilds the Cursor's heap
of (due, id) from `entries()`.

An Arrow bundle of impressions is stored once, as it came (its entries hold a RowRef: 12 bytes, not
the row), and the joiner emits Arrow bundles gathered from those rows, so a bundled impression is
never turned into JSON. A bundle is dropped once the watermark is `payload_kept_ms` (stream/join/policy.py) past its
newest row: no emission can need one of its rows then.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import orjson
import pyarrow as pa

from stream.join.policy import Click, Entry, Impression, RowRef

_HEAD = struct.Struct("<Bqq")  # flags, due, the impression's (or the early click's) time
_REF = struct.Struct("<qI")  # a RowRef: the bundle's offset, the row
_BUNDLE_KEY = struct.Struct(">qq")  # offset, newest row time (big-endian: keys sort by offset)
_HAS_IMPRESSION, _CLICKED, _EMITTED, _CLOSED, _EARLY_CLICK, _ROW_REF = 1, 2, 4, 8, 16, 32
ENTRY, PROGRESS, PENDING, BUNDLE = b"e", b"m", b"q", b"b"
PENDING_BEFORE_PARTITIONS = b"p"  # the last chunk's outputs as states written before outputs had a partition
CACHED_BUNDLES = 64  # Arrow bundles held decoded in memory per partition (the newest, mostly)


def encode_entry(entry: Entry) -> bytes:
    """An entry in 17 bytes plus its impression's payload, or 29 with a RowRef (its id is the key)."""
    imp = entry.impression
    ref = imp is not None and isinstance(imp.payload, RowRef)
    flags = (
        (_HAS_IMPRESSION if imp is not None else 0)
        | (_CLICKED if entry.clicked else 0)
        | (_EMITTED if entry.emitted else 0)
        | (_CLOSED if entry.closed else 0)
        | (_EARLY_CLICK if entry.early_click is not None else 0)
        | (_ROW_REF if ref else 0)
    )
    if imp is not None:
        head = _HEAD.pack(flags, entry.due, imp.ts)
        if isinstance(imp.payload, RowRef):
            return head + _REF.pack(imp.payload.offset, imp.payload.row)
        return head + imp.payload
    assert entry.early_click is not None
    return _HEAD.pack(flags, entry.due, entry.early_click.ts)


def decode_entry(key: str, value: bytes) -> Entry:
    flags, due, ts = _HEAD.unpack_from(value)
    payload: bytes | RowRef = RowRef(*_REF.unpack_from(value, _HEAD.size)) if flags & _ROW_REF else value[_HEAD.size :]
    impression = Impression(key, ts, payload) if flags & _HAS_IMPRESSION else None
    early = Click(key, ts) if flags & _EARLY_CLICK else None
    return Entry(impression, bool(flags & _CLICKED), bool(flags & _EMITTED), bool(flags & _CLOSED), early, due)


@dataclass(frozen=True)
class Progress:
    """How far one partition's join has come (stored with its entries, atomically)."""

    impressions_offset: int = -1  # next offset to read on the impressions partition (-1: from the start)
    clicks_offset: int = -1  # next offset to read on the clicks partition
    newest_ts: int | None = None  # newest impression time seen (the watermark is this minus the lateness)
    chunk: int = 0  # chunks committed so far
    # records moved here from another partition, not yet read back: (input, oldest time, offset by
    # which they are read; -1: not known when written, the input's end at the next start)
    holds: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class PendingOutput:
    """One record a chunk writes: to the events topic (a labelled bundle) or the dead-letter topic."""

    topic: str
    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()
    partition: int = -1  # the partition to write to (-1: the producer's partitioner, by key)


_SIZES = struct.Struct("<4Ii")  # the four fields' sizes, the partition


def encode_outputs(outputs: list[PendingOutput]) -> bytes:
    parts = [struct.pack("<I", len(outputs))]
    for o in outputs:
        fields = [o.topic.encode(), o.key, o.value, orjson.dumps([[k, v.decode("latin-1")] for k, v in o.headers])]
        parts += [_SIZES.pack(*map(len, fields), o.partition), *fields]
    return b"".join(parts)


def decode_outputs(blob: bytes, with_partition: bool = True) -> list[PendingOutput]:
    """`encode_outputs`' inverse (`with_partition=False`: the layout before outputs had a partition)."""
    (count,), at, out = struct.unpack_from("<I", blob), 4, []
    for _ in range(count):
        partition = -1
        if with_partition:
            *sizes, partition = _SIZES.unpack_from(blob, at)
            at += _SIZES.size
        else:
            sizes = list(struct.unpack_from("<4I", blob, at))
            at += 16
        fields = []
        for size in sizes:
            fields.append(blob[at : at + size])
            at += size
        headers = tuple((k, v.encode("latin-1")) for k, v in orjson.loads(fields[3]))
        out.append(PendingOutput(fields[0].decode(), fields[1], fields[2], headers, partition))
    return out


class PartitionState:
    """One partition's entries, progress and pending outputs in RocksDB, changed a chunk at a time."""

    def __init__(self, path: str | Path) -> None:
        from rocksdict import DBCompressionType, Options, Rdict

        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        options.set_compression_type(DBCompressionType.lz4())  # JSON payloads compress ~3x
        self.db = Rdict(str(self.path), options=options)
        self._staged: dict[str, Entry | None] = {}
        self._read: dict[str, bytes | None] = {}  # entries read ahead (`preload`) for this chunk
        raw = self.db.get(PROGRESS)
        self.progress = Progress(**orjson.loads(raw)) if raw is not None else Progress()
        self.progress = replace(self.progress, holds=tuple(tuple(h) for h in self.progress.holds))  # type: ignore[misc]
        # the stored bundles' newest row times by offset, oldest first (keys only: no bundle is read)
        self._bundles: dict[int, int] = {}
        for key in self.db.keys(from_key=BUNDLE):
            assert isinstance(key, bytes)  # raw mode
            if not key.startswith(BUNDLE):
                break
            offset, newest = _BUNDLE_KEY.unpack_from(key, 1)
            self._bundles[offset] = newest
        self._new_bundles: dict[int, bytes] = {}  # stored with the next commit
        self._tables: OrderedDict[int, pa.Table] = OrderedDict()  # decoded bundles, least recently used first

    def get(self, key: str) -> Entry | None:
        if key in self._staged:
            return self._staged[key]
        raw = self._read.pop(key) if key in self._read else self.db.get(ENTRY + key.encode())
        return None if raw is None else decode_entry(key, raw)  # type: ignore[arg-type]

    def preload(self, keys: list[str]) -> None:
        """Read the entries of many ids in one multi-get (a bundle's impressions), for `get`."""
        wanted = [k for k in keys if k not in self._staged]
        if wanted:
            self._read.update(zip(wanted, self.db.get([ENTRY + k.encode() for k in wanted]), strict=True))  # type: ignore[arg-type]

    def put_bundle(self, offset: int, newest_ts: int, value: bytes, table: pa.Table) -> None:
        """Keep an Arrow bundle of impressions (the record at `offset`, as read) for its RowRefs; it
        is written with the next commit."""
        self._bundles[offset] = newest_ts
        self._new_bundles[offset] = value
        self._cache(offset, table)

    def bundle(self, offset: int) -> pa.Table:
        """The stored bundle at `offset`, decoded (from memory when recently used)."""
        table = self._tables.get(offset)
        if table is not None:
            self._tables.move_to_end(offset)
            return table
        value = self._new_bundles.get(offset)
        if value is None:
            value = self.db.get(BUNDLE + _BUNDLE_KEY.pack(offset, self._bundles[offset]))
        table = pa.ipc.open_stream(pa.py_buffer(value)).read_all()
        self._cache(offset, table)
        return table

    def _cache(self, offset: int, table: pa.Table) -> None:
        self._tables[offset] = table
        if len(self._tables) > CACHED_BUNDLES:
            self._tables.popitem(last=False)

    def stage(self, key: str, entry: Entry | None) -> None:
        """Change an entry in memory; `commit` writes it."""
        self._staged[key] = entry

    def commit(self, progress: Progress, outputs: list[PendingOutput], bundles_before: int | None = None) -> None:
        """Every staged change, the progress and the chunk's outputs, in one atomic write; and the
        bundles whose newest row time is before `bundles_before` dropped (oldest first, stopping at
        the first younger one: a bundle out of time order holds the ones after it a little longer)."""
        from rocksdict import WriteBatch

        dropped = []
        if bundles_before is not None:
            for offset, newest in self._bundles.items():
                if newest >= bundles_before:
                    break
                dropped.append(offset)

        batch = WriteBatch(raw_mode=True)
        for key, entry in self._staged.items():
            if entry is None:
                batch.delete(ENTRY + key.encode())
            else:
                batch.put(ENTRY + key.encode(), encode_entry(entry))
        for offset, value in self._new_bundles.items():
            batch.put(BUNDLE + _BUNDLE_KEY.pack(offset, self._bundles[offset]), value)
        for offset in dropped:
            batch.delete(BUNDLE + _BUNDLE_KEY.pack(offset, self._bundles.pop(offset)))
            self._tables.pop(offset, None)
        batch.put(PROGRESS, orjson.dumps(vars(progress)))
        batch.put(PENDING, encode_outputs(outputs))
        batch.delete(PENDING_BEFORE_PARTITIONS)
        self.db.write(batch)
        self._staged.clear()
        self._read.clear()
        self._new_bundles.clear()
        self.progress = progress

    def pending_outputs(self) -> list[PendingOutput]:
        raw = self.db.get(PENDING)
        if raw is None:  # a state written before outputs had a partition
            old = self.db.get(PENDING_BEFORE_PARTITIONS)
            return decode_outputs(old, with_partition=False) if old is not None else []  # type: ignore[arg-type]
        return decode_outputs(raw)  # type: ignore[arg-type]

    def entries(self) -> Iterator[tuple[str, Entry]]:
        """Every stored entry (the staged ones not included)."""
        for key, value in self.db.items(from_key=ENTRY):
            assert isinstance(key, bytes) and isinstance(value, bytes)  # raw mode
            if not key.startswith(ENTRY):
                break
            name = key[1:].decode()
            yield name, decode_entry(name, value)

    def stats(self) -> tuple[int, int]:
        """(entries, bytes on disk and in memtables), RocksDB's own estimates."""
        count = int(self.db.property_int_value("rocksdb.estimate-num-keys") or 0)
        size = int(self.db.property_int_value("rocksdb.total-sst-files-size") or 0) + int(
            self.db.property_int_value("rocksdb.cur-size-all-mem-tables") or 0
        )
        return count, size

    def close(self) -> None:
        self.db.close()
