"""Deterministic initial vectors: a pure function of (feature id, seed).

Every trainer replica, a restarted trainer and the serving process compute the same starting
vector for an id they have never seen, without storing it. splitmix64 over (id, seed, column)
gives uniform values in [-a, a) with a = std * sqrt(3) (so the standard deviation is `std`).
The numpy form (`splitmix64`, `initial_vectors_numpy`) is the definition; `initial_vectors` is the
same arithmetic in one compiled pass (numpy made a dozen (n, dim) temporaries: ~22 ms for 30k new
ids of 17 floats, most of a GPU step's host time), pinned bit for bit to it in tests/test_store.py.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from store.hashing import GOLDEN

_GOLDEN = GOLDEN  # splitmix64's increment (store/hashing.py)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def initial_vectors(ids: np.ndarray, dim: int, seed: int, std: float) -> torch.Tensor:
    """ids int64 (n,) -> float32 (n, dim), the same for the same (id, seed) everywhere."""
    out = np.empty((len(ids), dim), dtype=np.float32)
    _fill_initial(np.ascontiguousarray(ids, dtype=np.int64), np.uint64(seed & (2**64 - 1)), std * math.sqrt(3.0), out)
    return torch.from_numpy(out)


# signatures given: compiled at import (from numba's on-disk cache after the first time), so
# serving's first request with an unseen id does not wait for a compile
@numba.njit("uint64(uint64)", cache=True, nogil=True)
def _mix(x: np.uint64) -> np.uint64:  # splitmix64 of one value (uint64 arithmetic wraps, as numpy's)
    x = x + _GOLDEN  # the module's constants: numba freezes globals at compile time
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


@numba.njit("void(int64[::1], uint64, float64, float32[:, ::1])", cache=True, nogil=True)
def _fill_initial(ids: np.ndarray, seed: np.uint64, scale: float, out: np.ndarray) -> None:
    dim = out.shape[1]
    stride = np.uint64(dim + 1)
    for i in range(ids.shape[0]):
        base = np.uint64(ids[i]) * stride
        for j in range(dim):
            bits = _mix(_mix((base + np.uint64(j)) ^ seed))
            uniform = np.float64(bits >> np.uint64(11)) / 9007199254740992.0  # 2**53: [0, 1)
            out[i, j] = np.float32((uniform * 2.0 - 1.0) * scale)


def initial_vectors_numpy(ids: np.ndarray, dim: int, seed: int, std: float) -> torch.Tensor:
    """`initial_vectors` in plain numpy: the definition the compiled pass is pinned to."""
    with np.errstate(over="ignore"):
        base = ids.astype(np.uint64)[:, None] * np.uint64(dim + 1) + np.arange(dim, dtype=np.uint64)[None, :]
        bits = splitmix64(splitmix64(base ^ np.uint64(seed)))
    uniform = (bits >> np.uint64(11)).astype(np.float64) / float(1 << 53)  # [0, 1)
    return torch.from_numpy(((uniform * 2.0 - 1.0) * std * np.sqrt(3.0)).astype(np.float32))
