"""Trainer settings. Built by adstream/config.py from TOML or flags; unknown keys are errors there."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.errors import TrainerError


@dataclass(frozen=True)
class TrainerSettings:
    group_id: str = "adstream-trainer"  # Kafka consumer group on the batches topic
    batch_size: int = 1024  # events per train step (whole stream batches are never split)
    embed_dim: int = 8  # factor width per field
    hidden: tuple[int, ...] = (128, 64)  # MLP widths
    lr: float = 0.001  # learning rate of the dense network
    optimizer: str = "adam"  # "adam" (dense Adam + lazy sparse Adam) or "sgd" (plain SGD, for equivalence tests)
    sparse_lr: float = 0.01  # sparse Adam learning rate of the embedding rows
    seed: int = 0  # seeds the dense init and the embedding initializer
    device: str = "cpu"  # where the model and the device tier live: "cpu" or "cuda[:N]"
    store: str = "ram"  # embedding store: "ram" (one in-memory tier) or "tiered" (device -> RAM -> RocksDB)
    ram_bytes: int = 2 << 30  # budget of the in-memory (RAM) tier, bytes
    device_bytes: int = 256 << 20  # budget of the device tier (store = "tiered"), bytes
    disk_bytes: int = 64 << 30  # budget of the RocksDB tier (store = "tiered"), bytes
    store_path: str = ".state/rocksdb/trainer"  # RocksDB directory (store = "tiered")
    eviction: str = "lru"  # eviction policy of the device and RAM tiers: "lru" or "lfu"
    ttl_steps: int = 0  # drop embedding rows unseen for this many steps; 0 = never
    min_count: int = 1  # batches an id must appear in before it gets its own row
    snapshot_every_steps: int = 200  # take a snapshot after this many steps...
    snapshot_every_s: float = 60.0  # ...or this many seconds, whichever comes first
    snapshot_dir: str = ".state/snapshots"  # local folder for snapshots before upload
    metrics_window: int = 10_000  # events in the sliding-window AUC/logloss
    log_every_steps: int = 20  # MLflow metrics every this many steps
    metrics_port: int = 0  # Prometheus endpoint; 0 = off
    threads: int = 0  # torch threads; 0 = torch's default
    workers: int = 1  # replicas `adstream train` starts (one process each; torchrun sets its own)
    merge_every_steps: int = 16  # k: replicas average parameters and Adam moments every k steps; 0 = sync data parallel
    merge_every_s: float = 0.0  # also merge after this many seconds since the last merge; 0 = only every k steps
    max_restarts: int = 3  # the supervisor of `--workers N` restarts the whole group this often after a crash
    idle_s: float = 1.0  # a replica with no full batch after this long learns what it has (or reports idle)
    learn_log: str = ""  # folder for per-replica audit logs of the (partition, offset) records learned; "" = off

    def __post_init__(self) -> None:
        choices = {"optimizer": ("adam", "sgd"), "store": ("ram", "tiered"), "eviction": ("lru", "lfu")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise TrainerError(f"config trainer.{key}={getattr(self, key)!r}: use one of {list(allowed)}")
        minimums = {"merge_every_steps": 0, "workers": 1, "batch_size": 1, "merge_every_s": 0, "max_restarts": 0}
        for key, least in minimums.items():
            if getattr(self, key) < least:
                raise TrainerError(f"config trainer.{key}={getattr(self, key)!r}: must be >= {least}")


@dataclass(frozen=True)
class MlflowSettings:
    tracking_uri: str = "http://127.0.0.1:15000"  # MLflow tracking server
    experiment: str = "adstream"  # experiment of training runs
    model_name: str = "adstream-ctr"  # registered model name
    alias: str = "live"  # alias set on each new version ("latest" is reserved by MLflow)
