"""Which partition a key belongs to: Kafka's Java default partitioner (murmur2), the joiner's rule.

The joiner keeps an impression's state in the partition its impression id hashes to, and its click
must be read from the same partition of the clicks topic. Java clients and Kafka Streams place a
keyed record by murmur2 of its key; librdkafka (confluent-kafka) does so with
`partitioner=murmur2_random`, while its default (`consistent_random`, CRC32) places keys elsewhere.
A record on another partition than its id's is moved by the joiner (stream/joiner.py), so any
producer works, but one with murmur2 saves that hop.
"""

from __future__ import annotations

import struct

_M = 0x5BD1E995
_MASK = 0xFFFFFFFF
_SEED = 0x9747B28C


def murmur2_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's Java default partitioner (and librdkafka's "murmur2_random") gives a
    key: murmur2 of its bytes, made positive, modulo the partition count."""
    n = len(key)
    h = (_SEED ^ n) & _MASK
    whole = n - (n & 3)
    for k in struct.unpack_from(f"<{n >> 2}I", key):
        k = (k * _M) & _MASK
        k = ((k ^ (k >> 24)) * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = n & 3
    if tail == 3:
        h ^= key[whole + 2] << 16
    if tail >= 2:
        h ^= key[whole + 1] << 8
    if tail:
        h = ((h ^ key[whole]) * _M) & _MASK
    h = ((h ^ (h >> 13)) * _M) & _MASK
    h ^= h >> 15
    return (h & 0x7FFFFFFF) % partitions


def partition_of(impression_id: str, partitions: int) -> int:
    """The partition of an impression id (its UTF-8 bytes as the key)."""
    return murmur2_partition(impression_id.encode(), partitions)
