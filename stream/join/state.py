"""The joiner's state on disk: one RocksDB per input partition (rocksdict), bounded by the window.

What one partition's database holds:
    b"e" + impression id  -> the id's Entry (stream/join/policy.py), encoded by `encode_entry`
    b"m"                  -> Progress: the next offsets of the impressions and clicks partitions,
                             the newest impression time seen (the watermark's source), the chunk number
    b"q"                  -> the outputs of the last chunk (`encode_outputs`), written before they are sent
    b"b" + offset, newest -> an Arrow bundle of impressions as read at that offset (its entries point at
                             their rows: RowRef), kept while an emission may need one of its rows

With `stream.join.assignment = "group"` the database is a cache of a changelog topic as well (one
partition per input partition, compacted): `commit` adds every key it writes or deletes to the
chunk's outputs, as records of that topic (a delete as a tombstone), so they go out in the chunk's
transaction with its offsets; a joiner that is given a partition another one held rebuilds the
database from there (`restore`). Each chunk has a token, committed as the offsets' metadata: a
database whose token is the committed one is current, one whose previous token is, is the chunk
ahead that did not commit (sent again), any other is stale and restored (stream/join/group.py).

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
from typing import TYPE_CHECKING

import orjson
import pyarrow as pa

if TYPE_CHECKING:
    from rocksdict import WriteBatch

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
    token: str = ""  # this chunk's id ("group": committed as the offsets' metadata with it)
    previous: str = ""  # the chunk before's token


def decode_progress(raw: bytes) -> Progress:
    """A stored progress record (the database's, or the changelog's copy of it)."""
    progress = Progress(**orjson.loads(raw))
    return replace(progress, holds=tuple(tuple(h) for h in progress.holds))  # type: ignore[misc]


@dataclass(frozen=True)
class PendingOutput:
    """One record a chunk writes: to the events topic (a labelled bundle), the dead-letter topic, an
    input (a record moved to its partition) or the state's changelog (value None: a tombstone)."""

    topic: str
    key: bytes
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()
    partition: int = -1  # the partition to write to (-1: the producer's partitioner, by key)


_SIZES = struct.Struct("<IIiIi")  # the four fields' sizes (the value's -1: None, a tombstone), the partition
TOMBSTONE = -1


def encode_outputs(outputs: list[PendingOutput]) -> bytes:
    parts = [struct.pack("<I", len(outputs))]
    for o in outputs:
        headers = orjson.dumps([[k, v.decode("latin-1")] for k, v in o.headers])
        value = TOMBSTONE if o.value is None else len(o.value)
        parts += [_SIZES.pack(len(o.topic.encode()), len(o.key), value, len(headers), o.partition)]
        parts += [o.topic.encode(), o.key, o.value or b"", headers]
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
        fields: list[bytes | None] = []
        for size in sizes:
            fields.append(None if size == TOMBSTONE else blob[at : at + size])
            at += max(size, 0)
        topic, key, value, raw_headers = fields
        assert topic is not None and key is not None and raw_headers is not None
        headers = tuple((k, v.encode("latin-1")) for k, v in orjson.loads(raw_headers))
        out.append(PendingOutput(topic.decode(), key, value, headers, partition))
    return out


class PartitionState:
    """One partition's entries, progress and pending outputs in RocksDB, changed a chunk at a time."""

    def __init__(self, path: str | Path, changelog: tuple[str, int] | None = None) -> None:
        """The database at `path`; with `changelog` (topic, partition) every commit also says what it
        wrote as records of that topic."""
        from rocksdict import DBCompressionType, Options, Rdict

        self.path, self.changelog = Path(path), changelog
        self.path.mkdir(parents=True, exist_ok=True)
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        options.set_compression_type(DBCompressionType.lz4())  # JSON payloads compress ~3x
        self.db = Rdict(str(self.path), options=options)
        self._staged: dict[str, Entry | None] = {}
        self._read: dict[str, bytes | None] = {}  # entries read ahead (`preload`) for this chunk
        raw = self.db.get(PROGRESS)
        self.progress = decode_progress(raw) if raw is not None else Progress()  # type: ignore[arg-type]
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

    def commit(
        self, progress: Progress, outputs: list[PendingOutput], bundles_before: int | None = None
    ) -> list[PendingOutput]:
        """Every staged change, the progress and the chunk's outputs, in one atomic write; and the
        bundles whose newest row time is before `bundles_before` dropped (oldest first, stopping at
        the first younger one: a bundle out of time order holds the ones after it a little longer).
        Returns the outputs to send: `outputs`, and with a changelog every key written or deleted."""
        dropped = []
        if bundles_before is not None:
            for offset, newest in self._bundles.items():
                if newest >= bundles_before:
                    break
                dropped.append(offset)

        changes: list[tuple[bytes, bytes | None]] = []  # (key, value; None: deleted), in write order
        for key, entry in self._staged.items():
            changes.append((ENTRY + key.encode(), None if entry is None else encode_entry(entry)))
        for offset, value in self._new_bundles.items():
            changes.append((BUNDLE + _BUNDLE_KEY.pack(offset, self._bundles[offset]), value))
        for offset in dropped:
            changes.append((BUNDLE + _BUNDLE_KEY.pack(offset, self._bundles.pop(offset)), None))
            self._tables.pop(offset, None)
        changes.append((PROGRESS, orjson.dumps(vars(progress))))
        if self.changelog is not None:
            topic, partition = self.changelog
            outputs = outputs + [PendingOutput(topic, name, data, (), partition) for name, data in changes]
        batch = _write_batch(changes)
        batch.put(PENDING, encode_outputs(outputs))
        batch.delete(PENDING_BEFORE_PARTITIONS)
        self.db.write(batch)
        self._staged.clear()
        self._read.clear()
        self._new_bundles.clear()
        self.progress = progress
        return outputs

    def load(self, changes: list[tuple[bytes, bytes | None]]) -> None:
        """Write changelog records (key, value; None: delete) as they are, in one write: `restore`
        rebuilds a database from its changelog with it. Only into a database just opened."""
        self.db.write(_write_batch(changes))

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


def _write_batch(changes: list[tuple[bytes, bytes | None]]) -> WriteBatch:
    """One RocksDB write batch of (key, value) puts, None values deletes."""
    from rocksdict import WriteBatch

    batch = WriteBatch(raw_mode=True)
    for key, value in changes:
        if value is None:
            batch.delete(key)
        else:
            batch.put(key, value)
    return batch
