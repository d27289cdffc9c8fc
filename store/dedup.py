"""A batch's ids deduplicated: the sorted distinct ids and where each position's id sits among them.

np.unique(ids, return_inverse=True) argsorts every position (a batch of 4096 events x 39 fields:
~160k ids, ~15 ms on one core, most of the `lr` family's step). pandas' factorize hashes the ids
once and sorts only the distinct ones (~1 ms): the same two arrays, so every caller and every
result stays as it was (tests/test_dedup.py pins it to np.unique).
"""

from __future__ import annotations

import numpy as np

SMALL = 1024  # at most this many ids: np.unique itself (~5 us for one event's 39, pandas' ~50 us)


def unique_inverse(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ids (n,) int64 -> (unique (u,) sorted, inverse (n,) int64) with unique[inverse] == ids,
    exactly np.unique(ids, return_inverse=True)."""
    if len(ids) <= SMALL:  # a served request's few ids: np.unique's sort beats the hash table's setup
        unique, inverse = np.unique(ids, return_inverse=True)
        return unique, inverse.astype(np.int64, copy=False)
    import pandas as pd  # imported on first use: a process that never learns never pays for it

    codes, unique = pd.factorize(ids, sort=True)
    return np.asarray(unique, dtype=ids.dtype), codes.astype(np.int64, copy=False)
