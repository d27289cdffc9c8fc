"""The store's component configs, apart from the code that runs them: plain dataclasses that the
trainer's settings read their defaults from (common.checks.default_of) without importing the tiers
(numba, RocksDB pipelines) at start-up."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from common.checks import at_least, check_fields, one_of
from store.errors import StoreError
from store.rocks import TABLE_FORMATS
from store.sparse_optim import SparseOptimConfig


@dataclass(frozen=True)
class HierarchyConfig:
    device_bytes: int  # budget of the device tier (HBM on CUDA); must hold one batch's unique rows
    ram_bytes: int  # budget of the host RAM tier
    disk_bytes: int  # budget of the RocksDB tier
    path: str  # RocksDB directory (placement.py picks one per GPU on its NUMA node's storage)
    device: str = "cpu"  # "cuda:0" puts the device tier in HBM
    policy: str = one_of(("lru", "lfu"), "lru")  # eviction policy of the device and RAM tiers
    ttl_steps: int = 0  # drop rows unseen for this many steps; 0 = never
    evict_slack: float = at_least(0, 0.05)  # evict this fraction of a tier's capacity extra, to evict less often
    pipelined: bool = True  # RocksDB reads ahead (prefetch) and write-backs behind, on an IO thread
    # a device tier above RAM. The trainer has one only on a CUDA device: on the CPU it would be a
    # second cache in the same memory, and every row would be copied and indexed twice per step
    device_tier: bool = True
    # RocksDB's table files: "plain" (hash-indexed: faster cold reads, ~14 bytes of RAM a row) or "block"
    rocksdb_format: str = one_of(TABLE_FORMATS, "plain")

    def __post_init__(self) -> None:
        check_fields(self, "HierarchyConfig", StoreError)


@dataclass(frozen=True)
class TableConfig:
    dim: int  # vector width per feature id
    seed: int = 0  # seed of the deterministic initializer
    init_std: float = 0.01  # std of initial vectors
    optim: SparseOptimConfig = field(default_factory=SparseOptimConfig)  # the sparse optimizer
    min_count: int = 1  # an id gets its own row after this many batches; before, its field's shared row
    admission_bytes: int = 16 << 20  # memory of the admission sketch (min_count >= 2), bytes

    def __post_init__(self) -> None:
        if self.min_count < 1:
            raise StoreError(f"TableConfig.min_count={self.min_count}: must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TableConfig:
        data = dict(data)
        data["optim"] = SparseOptimConfig(**data.get("optim", {}))
        return cls(**data)

    def holds_rows_of(self, other: TableConfig) -> bool:
        """Whether rows written under `other` mean the same here: the width, the initializer, the
        admission settings and the optimizer whose state the rows hold. Its rates and switches
        (learning rates, L2, clipping, wide_per_event) may change between runs, as they do when a
        job is resumed with new settings."""
        return replace(self, optim=SparseOptimConfig(self.optim.name)) == replace(
            other, optim=SparseOptimConfig(other.optim.name)
        )
