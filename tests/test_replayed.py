"""The featurizer is at least once, the trainer learns every event once: the featurizer writes each
source partition's events in (offset, row) order to one batches partition (outputs.py), the trainer
drops what is not past its mark (trainer/replayed.py). Pinned to the simple answer: whatever two
writers of the same log (a worker and the successor that re-featurizes its uncommitted takes) put
on the batches topic, interleaved any way, the trainer learns exactly the events one writer alone
would have written, each once, and nothing else."""

from __future__ import annotations

import numpy as np
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.featurizer.ingest import featurize_isolating
from stream.featurizer.outputs import in_source_order, plan_outputs
from stream.formats.arrow import encode_event_bundle
from stream.formats.batch_codec import decode_batch
from stream.formats.dead_letter import BATCHES
from stream.records import FeatureBatch, RawRecord
from stream.schema import load_schema
from tests.helpers import criteo_event
from trainer.replayed import newest_marks, unseen

SCHEMA = load_schema()
LIMIT = 1 << 20


def log_of(partitions: int, records: int, seed: int) -> list[RawRecord]:
    """An events topic's records: per partition, single JSON events, JSON bundles with a bad line,
    and Arrow bundles, in offset order (gaps as transaction markers leave)."""
    rng = np.random.default_rng(seed)
    out, n = [], 0
    for p in range(partitions):
        offset = 0
        for _ in range(records):
            size = int(rng.integers(1, 6))
            events = [criteo_event(n + i) | {"event_id": f"p{p}-{n + i}"} for i in range(size)]
            n += size
            kind = int(rng.integers(0, 3))
            if kind == 0:
                value = orjson.dumps(events[0])
            elif kind == 1:
                value = b"\n".join([orjson.dumps(e) for e in events[:-1]] + [b"{bad", orjson.dumps(events[-1])])
            else:
                value = encode_event_bundle(events, SCHEMA)
            out.append(RawRecord(p, offset, value))
            offset += int(rng.integers(1, 3))
    return out


def writes(takes: list[list[RawRecord]], batch_partitions: int, batch_events: int) -> dict[int, list[FeatureBatch]]:
    """What one writer puts on each batches partition, take after take, in order."""
    out: dict[int, list[FeatureBatch]] = {p: [] for p in range(batch_partitions)}
    for take in takes:
        batch, rejected = featurize_isolating(take, SCHEMA)
        for o in plan_outputs(batch, rejected, batch_events, LIMIT, batch_partitions):
            if o.topic == BATCHES:
                assert o.partition is not None
                out[o.partition].append(decode_batch(o.value))
    return out


def interleaved(takes: list[list[RawRecord]], seed: int) -> list[list[RawRecord]]:
    """Faust's takes: records of several partitions mixed, each partition in its own order; a take
    may hold some of its records again at its end (a rebalance sought their partition back)."""
    rng = np.random.default_rng(seed)
    records = [r for take in takes for r in take]
    by_partition: dict[int, list[RawRecord]] = {}
    for r in records:
        by_partition.setdefault(r.partition, []).append(r)
    mixed: list[RawRecord] = []
    while any(by_partition.values()):
        p = int(rng.choice([p for p, rs in by_partition.items() if rs]))
        mixed.append(by_partition[p].pop(0))
    cut = sorted(set(rng.integers(1, max(len(mixed), 2), 3).tolist()))
    takes = [mixed[a:b] for a, b in zip([0, *cut], [*cut, len(mixed)]) if mixed[a:b]]
    return [take + take[int(rng.integers(0, len(take))) :] if rng.random() < 0.5 else take for take in takes]


def test_a_take_is_written_per_source_partition_in_source_order():
    records = log_of(partitions=4, records=6, seed=1)
    mixed = [r for take in interleaved([records], seed=2) for r in take]
    take = mixed + mixed[:5]  # some twice in one take
    batch, rejected = featurize_isolating(take, SCHEMA)
    outputs = [o for o in plan_outputs(batch, rejected, 4, LIMIT, 3) if o.topic == BATCHES]
    seen: dict[int, list[int]] = {}
    for o in outputs:
        part = decode_batch(o.value)
        assert len(set(part.partitions.tolist())) == 1  # one source partition per batch
        source = int(part.partitions[0])
        assert o.partition == source % 3
        seen.setdefault(source, []).extend(part.source_keys().tolist())
    for keys in seen.values():
        assert keys == sorted(keys)  # source order, a record's events in their row order
    assert set(seen) == {0, 1, 2, 3}


def test_a_record_twice_in_one_take_is_featurized_once():
    """Faust can hand one take a record twice (a rebalance seeks back while the take is open): its
    events come once, with the same rows as alone, so the trainer's check still sees them as seen."""
    records = log_of(partitions=2, records=6, seed=11)
    alone, _ = featurize_isolating(records, SCHEMA)
    twice, _ = featurize_isolating(records + records[2:7] + records[:1], SCHEMA)
    a, b = in_source_order(alone), in_source_order(twice)
    assert b.event_ids == a.event_ids and np.array_equal(b.source_keys(), a.source_keys())


def test_a_record_featurized_again_in_another_take_gets_the_same_rows():
    records = log_of(partitions=2, records=8, seed=4)

    def keys(takes: list[list[RawRecord]]) -> dict[str, tuple[int, int]]:
        out = {}
        for take in takes:
            part = in_source_order(featurize_isolating(take, SCHEMA)[0])
            for event_id, p, key in zip(part.event_ids, part.partitions.tolist(), part.source_keys().tolist()):
                out[event_id] = (p, key)
        return out

    assert keys([records]) == keys(interleaved([records], seed=5)) == keys([[r] for r in records])


def test_select_keeps_list_fields_with_their_events():
    schema = load_schema("criteo_tags")
    events = [criteo_event(i) | {"tags": [f"{j + 10:08x}" for j in range(i % 4)]} for i in range(7)]
    batch, _ = featurize_isolating([RawRecord(0, i, orjson.dumps(e)) for i, e in enumerate(events)], schema)
    picked = batch.select(np.array([5, 1, 6]))
    one_by_one = FeatureBatch.concat([batch.slice(i, i + 1) for i in (5, 1, 6)])
    assert picked.event_ids == one_by_one.event_ids
    for (starts, ids), (want_starts, want_ids) in zip(picked.lists, one_by_one.lists, strict=True):
        assert starts.tolist() == want_starts.tolist() and ids.tolist() == want_ids.tolist()
    assert np.array_equal(picked.ids, one_by_one.ids)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    committed=st.floats(0, 1),
    died=st.floats(0, 1),
    batch_partitions=st.integers(1, 3),
    batch_events=st.integers(1, 8),
)
def test_a_writer_and_its_successor_interleaved_any_way_are_learned_as_one_writer_alone(
    seed, committed, died, batch_partitions, batch_events
):
    """The first writer wrote its takes up to `died` (the last of them maybe in part) and Faust
    committed its offsets up to `committed` of them (a take is committed only once written); the
    successor featurizes every record past the committed offsets. What the first wrote after its
    commit may land before, among or after the successor's writes (a zombie's late writes)."""
    records = log_of(partitions=3, records=5, seed=seed)
    rng = np.random.default_rng(seed)
    takes = interleaved([records], seed)
    wrote = round(died * len(takes))
    kept = round(committed * wrote)
    done = writes(takes[:kept], batch_partitions, batch_events)  # on the broker before its commit
    tail = writes(takes[kept:wrote], batch_partitions, batch_events)
    tail = {p: parts[: int(rng.integers(0, len(parts) + 1))] for p, parts in tail.items()}  # died mid-take
    committed_records = {(r.partition, r.offset) for take in takes[:kept] for r in take}
    rest = [r for r in records if (r.partition, r.offset) not in committed_records]
    successor = writes(interleaved([rest], seed + 1), batch_partitions, batch_events)

    def learned(streams: dict[int, list[FeatureBatch]]) -> list[str]:
        out, marks = [], {}
        for partition in range(batch_partitions):
            for part in streams[partition]:
                fresh, marks = unseen(part, marks)
                out += fresh.event_ids
        return out

    both: dict[int, list[FeatureBatch]] = {}
    for partition in range(batch_partitions):
        xs, ys, merged = list(tail[partition]), list(successor[partition]), list(done[partition])
        while xs or ys:  # any interleaving of the two writers, each one's order kept
            take_x = bool(xs) and (not ys or rng.random() < 0.5)
            merged.append((xs if take_x else ys).pop(0))
        both[partition] = merged
    once = learned(writes(takes, batch_partitions, batch_events))
    assert len(once) == len(set(once))  # the log itself holds each event once
    got = learned(both)
    assert sorted(got) == sorted(once)  # every event once, none lost, none twice


def test_a_log_written_twice_over_is_learned_once():
    records = log_of(partitions=2, records=6, seed=7)
    first = writes(interleaved([records], 8), 2, 3)
    second = writes(interleaved([records], 9), 2, 3)  # nothing was committed: all written again
    marks: dict[int, int] = {}
    written, learned = [], []
    for partition in range(2):
        for part in first[partition] + second[partition]:
            written += part.event_ids
            fresh, marks = unseen(part, marks)
            learned += fresh.event_ids
    assert len(written) == 2 * len(set(written))
    assert sorted(learned) == sorted(set(written))


def test_a_batch_without_rows_is_learned_whole_and_marks_merge_to_the_newest():
    batch, _ = featurize_isolating([RawRecord(0, 7, orjson.dumps(criteo_event(1)))], SCHEMA)
    assert batch.rows is None
    again, marks = unseen(batch, {0: 1 << 40})
    assert again is batch and marks == {0: 1 << 40}  # no order promised: nothing to compare
    ordered = in_source_order(batch)
    dropped, marks = unseen(ordered, {0: int(ordered.source_keys()[0])})
    assert len(dropped) == 0
    kept, marks = unseen(ordered, {0: int(ordered.source_keys()[0]) - 1, 1: 5})
    assert len(kept) == 1 and marks == {0: int(ordered.source_keys()[0]), 1: 5}
    assert newest_marks([{0: 3, 1: 9}, {0: 5}, {}]) == {0: 5, 1: 9}
