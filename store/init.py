"""Deterministic initial vectors: a pure function of (feature id, seed).

Every trainer replica, a restarted trainer and the serving process compute the same starting
vector for an id they have never seen, without storing it. splitmix64 over (id, seed, column)
gives uniform values in [-a, a) with a = std * sqrt(3) (so the standard deviation is `std`).
"""

from __future__ import annotations

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def initial_vectors(ids: np.ndarray, dim: int, seed: int, std: float) -> torch.Tensor:
    """ids int64 (n,) -> float32 (n, dim), the same for the same (id, seed) everywhere."""
    with np.errstate(over="ignore"):
        base = ids.astype(np.uint64)[:, None] * np.uint64(dim + 1) + np.arange(dim, dtype=np.uint64)[None, :]
        bits = splitmix64(splitmix64(base ^ np.uint64(seed)))
    uniform = (bits >> np.uint64(11)).astype(np.float64) / float(1 << 53)  # [0, 1)
    return torch.from_numpy(((uniform * 2.0 - 1.0) * std * np.sqrt(3.0)).astype(np.float32))
