"""The project's one 64-bit multiplicative hash constant, and which bits of `id * GOLDEN` each user
reads (the users must not read the same bits for two decisions that should be independent):

- store/index.py: the top `bits` bits, a row's home slot in a table of 2^bits slots;
- store/placement.py `shard_of`: bits 32..63, modulo the shard count (which GPU owns an id). Below
  2^32 slots per shard the two use different bits; a larger index would share some with the shard;
- store/init.py: splitmix64's increment (its "gamma"), not a product: per-id initial vectors;
- bench: the plain baseline's hashed table (top bits) and the store bench's rank -> id scatter.
"""

from __future__ import annotations

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / the golden ratio, odd: Knuth's multiplicative hashing
