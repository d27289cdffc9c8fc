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
