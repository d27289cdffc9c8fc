"""store.dedup.unique_inverse is np.unique(ids, return_inverse=True), exactly: every lookup's rows
and every gradient's scatter rest on it."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from store.dedup import unique_inverse


@given(arrays(np.int64, st.integers(0, 300), elements=st.integers(-(2**63), 2**63 - 1) | st.integers(-5, 5)))
def test_unique_inverse_is_numpys(ids):
    unique, inverse = unique_inverse(ids)
    want_unique, want_inverse = np.unique(ids, return_inverse=True)
    assert unique.dtype == np.int64 and inverse.dtype == np.int64
    assert np.array_equal(unique, want_unique) and np.array_equal(inverse, want_inverse.reshape(-1))


def test_unique_inverse_of_a_batch_of_ids(rng):
    ids = rng.integers(0, 5000, size=4096 * 39).astype(np.int64)  # a batch of 4096 events x 39 fields
    unique, inverse = unique_inverse(ids)
    assert np.array_equal(unique[inverse], ids) and np.all(np.diff(unique) > 0)
