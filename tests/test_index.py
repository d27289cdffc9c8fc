import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from store.index import IdIndex

ids64 = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "pop"]), st.lists(ids64, max_size=40, unique=True)), max_size=30))
def test_index_behaves_like_a_dict(operations):
    index, reference = IdIndex(4), {}
    next_slot = 0
    for op, keys in operations:
        arr = np.array(keys, dtype=np.int64)
        if op == "put":
            new = np.array([k for k in keys if k not in reference], dtype=np.int64)
            slots = np.arange(next_slot, next_slot + len(new))
            index.put(new, slots)
            reference.update(zip(new.tolist(), slots.tolist()))
            next_slot += len(new)
        else:
            expected = [reference.pop(k, -1) for k in keys]
            assert index.pop(arr).tolist() == expected
        assert len(index) == len(reference)
    probe = np.array(list(reference) + [0, 1, -1, 2**63 - 1], dtype=np.int64)
    assert index.get(probe).tolist() == [reference.get(int(k), -1) for k in probe]
    keys, vals = index.items()
    assert dict(zip(keys.tolist(), vals.tolist())) == reference


def test_index_grows_and_stays_compact():
    index = IdIndex()
    ids = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, size=200_000, dtype=np.int64)
    ids = np.unique(ids)
    index.put(ids, np.arange(len(ids)))
    assert (index.get(ids) == np.arange(len(ids))).all()
    assert index.nbytes / len(ids) < 60
    index.pop(ids[::2])
    assert (index.get(ids[1::2]) == np.arange(1, len(ids), 2)).all() and (index.get(ids[::2]) == -1).all()


def test_churn_at_full_load_keeps_every_entry_findable():
    """A tier's life: rows admitted and evicted every step near the load limit, ids clustered so
    probe runs are long and wrap around the end of the table. Removals shift entries back (no
    tombstones): every id stays findable, and the table never grows past its first size."""
    rng = np.random.default_rng(3)
    index, reference = IdIndex(2000), {}
    capacity = len(index.keys)
    for step in range(300):
        fresh = np.unique(rng.integers(0, 6000, size=200, dtype=np.int64) * 1024)  # clustered homes
        fresh = np.array([k for k in fresh.tolist() if k not in reference], dtype=np.int64)
        room = 1200 - len(reference)
        fresh = fresh[: max(room, 0)]
        index.put(fresh, np.arange(len(fresh)) + step * 1000)
        reference.update(zip(fresh.tolist(), (np.arange(len(fresh)) + step * 1000).tolist()))
        gone = rng.choice(np.array(list(reference), dtype=np.int64), size=min(150, len(reference)), replace=False)
        assert index.pop(gone).tolist() == [reference.pop(int(k)) for k in gone]
        probe = np.concatenate([np.array(list(reference), dtype=np.int64), gone])
        assert index.get(probe).tolist() == [reference.get(int(k), -1) for k in probe]
    assert len(index) == len(reference) and len(index.keys) == capacity
