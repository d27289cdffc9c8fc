"""Trainer settings. Built by adstream/config.py from TOML or flags; unknown keys are errors there."""

from __future__ import annotations

from dataclasses import dataclass

from store.sparse_optim import SPARSE_OPTIMIZERS
from trainer.errors import TrainerError
from trainer.model import MODEL_KINDS


@dataclass(frozen=True)
class TrainerSettings:
    group_id: str = "adstream-trainer"  # Kafka consumer group on the batches topic
    batch_size: int = 256  # events per train step (whole stream batches are never split); see the README
    # --- the model -------------------------------------------------------------------------
    model: str = "dcn"  # model family: "lr", "fm", "deepfm" or "dcn" (DCN-v2)
    embed_dim: int = 8  # factor width per field
    hidden: tuple[int, ...] = (128, 64)  # MLP widths (deepfm, dcn)
    cross_layers: int = 2  # cross layers (dcn)
    dense_norm: bool = True  # standardize the dense features by running mean / variance
    # --- the dense optimizer (the network) -------------------------------------------------
    optimizer: str = "adam"  # "adam" (Adagrad at wide_lr for the wide part), or "sgd" (plain SGD, for tests)
    lr: float = 0.003  # learning rate of the dense network
    warmup_steps: int = 0  # dense learning rate ramps up linearly over this many steps; 0 = none
    # --- the sparse optimizer (the embedding rows, state stored in each row) ----------------
    sparse_optimizer: str = "ftrl"  # "ftrl" (FTRL-Proximal), "adagrad", "adam" or "sgd"
    sparse_lr: float = 0.05  # learning rate of the factor columns (FTRL: alpha)
    wide_lr: float = (
        0.05  # learning rate of the wide part: each id's first-order weight, the bias, the dense linear term
    )
    sparse_l2: float = 0.0  # L2 penalty on the rows a step touches
    initial_accumulator: float = 0.0  # Adagrad / FTRL: start value of each squared-gradient sum (damps first steps)
    init_std: float = 0.01  # std of a new row's initial vector
    clip_ratio: float = 0.0  # CowClip r (large batches): id gradient norm <= count * max(r * |w|, 1e-5); 0 = off
    min_count: int = 1  # batches an id must appear in before it gets its own row (before: its field's shared row)
    admission_bytes: int = 16 << 20  # memory of the admission counters (count-min sketch), bytes
    # --- where the rows live ---------------------------------------------------------------
    seed: int = 0  # seeds the dense init and the embedding initializer
    device: str = "cpu"  # where the model and the device tier live: "cpu" or "cuda[:N]"
    store: str = "ram"  # embedding store: "ram" (one in-memory tier) or "tiered" (device -> RAM -> RocksDB)
    ram_bytes: int = 2 << 30  # budget of the in-memory (RAM) tier, bytes
    device_bytes: int = 256 << 20  # budget of the device tier (store = "tiered"), bytes
    disk_bytes: int = 64 << 30  # budget of the RocksDB tier (store = "tiered"), bytes
    store_path: str = ".state/rocksdb/trainer"  # RocksDB directory (store = "tiered")
    eviction: str = "lru"  # eviction policy of the device and RAM tiers: "lru" or "lfu" (store = "tiered")
    ttl_steps: int = 0  # drop embedding rows unseen for this many steps; 0 = never (store = "tiered")
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
        choices = {
            "optimizer": ("adam", "sgd"),
            "sparse_optimizer": SPARSE_OPTIMIZERS,
            "model": MODEL_KINDS,
            "store": ("ram", "tiered"),
            "eviction": ("lru", "lfu"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise TrainerError(f"config trainer.{key}={getattr(self, key)!r}: use one of {list(allowed)}")
        minimums = {
            "merge_every_steps": 0,
            "workers": 1,
            "batch_size": 1,
            "merge_every_s": 0,
            "max_restarts": 0,
            "min_count": 1,
            "warmup_steps": 0,
            "embed_dim": 1,
            "clip_ratio": 0,
            "sparse_l2": 0,
        }
        for key, least in minimums.items():
            if getattr(self, key) < least:
                raise TrainerError(f"config trainer.{key}={getattr(self, key)!r}: must be >= {least}")
        if self.store == "ram" and (self.ttl_steps or self.eviction != "lru"):
            raise TrainerError(
                f"config trainer.ttl_steps={self.ttl_steps} / trainer.eviction={self.eviction!r} act only on the "
                'tiered store: set trainer.store = "tiered", or leave them at their defaults (0, "lru")'
            )


@dataclass(frozen=True)
class MlflowSettings:
    tracking_uri: str = "http://127.0.0.1:15000"  # MLflow tracking server
    experiment: str = "adstream"  # experiment of training runs
    model_name: str = "adstream-ctr"  # registered model name
    alias: str = "live"  # alias set on each new version ("latest" is reserved by MLflow)
