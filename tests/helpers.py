"""Helpers shared by the test files (data, tiny stores, a trained replica). Fixtures live in conftest.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from store.configs import HierarchyConfig
from store.hierarchy import TieredStore
from store.ram import RamTier
from store.rocks import RocksTier
from stream.featurizer.decode import event_from_mapping
from stream.featurizer.featurize import featurize
from stream.records import FeatureBatch
from trainer.batch import Batch, batch_from_features
from trainer.settings import ModelSettings, StoreSettings, TrainerSettings
from trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent


def shared_dir() -> Path:
    """The read-only shared data: $ADSTREAM_SHARED, else ../shared beside the clone, else /work/shared."""
    for candidate in (os.environ.get("ADSTREAM_SHARED"), ROOT.parent / "shared", "/work/shared"):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return ROOT.parent / "shared"


def needs_shared(present: bool, what: str) -> pytest.MarkDecorator:
    """Skip a test on a machine without the shared data, except under CI=true, where it runs and fails."""
    return pytest.mark.skipif(not present and os.environ.get("CI") != "true", reason=f"{what} is not on this machine")


CRITEO_DIR = Path(os.environ.get("ADSTREAM_CRITEO_DIR", shared_dir() / "data" / "criteo"))
CRITEO_FILES = sorted(CRITEO_DIR.glob("*.txt")) if CRITEO_DIR.is_dir() else []
# real Criteo rows in time order: the 10k contiguous file first
CRITEO_FILES.sort(key=lambda p: (not p.name.startswith("autoint"), p.name))


def criteo_event(i: int = 0, **overrides: object) -> dict[str, object]:
    """A valid Criteo-shaped event dict."""
    event: dict[str, object] = {"event_id": f"e{i}", "ts": 1_700_000_000_000 + i, "label": i % 2}
    event.update({f"I{k}": (k * 7 + i) % 50 - 1 for k in range(1, 14)})
    event.update({f"C{k}": f"{(k * 2654435761 + i) & 0xFFFFFFFF:08x}" for k in range(1, 27)})
    event.update(overrides)
    return event


def unlabelled(i: int, **changes: object) -> dict[str, object]:
    """criteo_event(i) as a request or an impression carries it: without its label."""
    event = criteo_event(i, **changes)
    event.pop("label")
    return event


def random_feature_batch(n: int, seed: int = 0) -> FeatureBatch:
    rng = np.random.default_rng(seed)
    return FeatureBatch(
        labels=rng.integers(0, 2, n).astype(np.float32),
        dense=rng.normal(size=(n, 13)).astype(np.float32),
        ids=rng.integers(0, 2**63 - 1, size=(n, 39), dtype=np.int64),
        ts=rng.integers(0, 2**40, n),
        event_ids=tuple(f"ev-{i}" for i in range(n)),
        partitions=rng.integers(0, 4, n).astype(np.int32),
        offsets=rng.integers(0, 2**40, n),
        schema_hash="abc123",
    )


WIDTH = 6


def ram_tier(capacity_bytes: int = 1 << 24) -> RamTier:
    return RamTier(WIDTH, capacity_bytes, initial_rows=4)


def tiny_hierarchy(path, width: int = WIDTH, device_rows: int = 16, ram_rows: int = 32, **kw) -> TieredStore:
    row = RamTier(width, 1).row_bytes
    return TieredStore(
        width,
        HierarchyConfig(
            device_bytes=device_rows * row, ram_bytes=ram_rows * row, disk_bytes=1 << 30, path=str(path), **kw
        ),
    )


def small_tiered_settings(path, device_bytes: int, ram_bytes: int, **store: object) -> TrainerSettings:
    """A small model (factor width 4, one hidden layer of 16) on the tiered store at `path`."""
    return TrainerSettings(
        model=ModelSettings(embed_dim=4, hidden=(16,)),
        store=StoreSettings(
            kind="tiered",
            device_bytes=device_bytes,
            ram_bytes=ram_bytes,
            path=str(path),
            **store,  # type: ignore[arg-type]
        ),
    )


# every Tier implementation joins this contract suite
TIERS = {
    "ram": lambda tmp: ram_tier(),
    "device": lambda tmp: RamTier(WIDTH, 200 * RamTier(WIDTH, 1).row_bytes, preallocate=True),
    "rocksdb": lambda tmp: RocksTier(tmp / "rocks", WIDTH, 1 << 30),
    "rocksdb-block": lambda tmp: RocksTier(tmp / "rocks", WIDTH, 1 << 30, table_format="block"),
    "hierarchy": lambda tmp: tiny_hierarchy(tmp / "tiered"),
    "hierarchy-serial": lambda tmp: tiny_hierarchy(tmp / "tiered", pipelined=False),
    "hierarchy-lfu": lambda tmp: tiny_hierarchy(tmp / "tiered", device_rows=12, ram_rows=8, policy="lfu"),
    "hierarchy-no-device-tier": lambda tmp: tiny_hierarchy(tmp / "tiered", ram_rows=8, device_tier=False),
}
if torch.cuda.is_available():  # the device tier in HBM joins where there is a GPU (CI has none: tests/test_cuda.py)
    TIERS["device-cuda"] = lambda tmp: RamTier(
        WIDTH, 200 * RamTier(WIDTH, 1).row_bytes, device="cuda", preallocate=True
    )
    TIERS["hierarchy-cuda"] = lambda tmp: tiny_hierarchy(tmp / "tiered", device="cuda")


def zipf_batches(n_batches: int, seed: int = 0) -> list[Batch]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        ids = (rng.zipf(1.3, size=(32, 5)) % 400 + (np.arange(5) << 33)[None, :]).astype(np.int64)
        out.append(
            Batch(
                torch.from_numpy(rng.integers(0, 2, 32).astype(np.float32)),
                torch.from_numpy(rng.normal(size=(32, 3)).astype(np.float32)),
                ids,
            )
        )
    return out


def trained_trainer(schema, steps: int = 5) -> Trainer:
    trainer = Trainer(
        schema, TrainerSettings(model=ModelSettings(embed_dim=4, hidden=(16,)), store=StoreSettings(ram_bytes=1 << 26))
    )
    for s in range(steps):
        events = [event_from_mapping(criteo_event(s * 50 + i), schema) for i in range(50)]
        trainer.learn(batch_from_features([featurize(events, schema)], {0: s + 1}))
    return trainer


AVAZU_COLUMNS = ["id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id"]
AVAZU_COLUMNS += ["app_domain", "app_category", "device_id", "device_ip", "device_model", "device_type"]
AVAZU_COLUMNS += ["device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21"]


def avazu_csv(path: Path, rows: int, bad_rows: tuple[int, ...] = (), seed: int = 0) -> Path:
    """An Avazu-shaped CSV (the public layout: header, 20-digit ids, click, hour YYMMDDHH, string
    categories) whose click depends on site_id and device_type; row bad_rows[0] has a bad hour,
    row bad_rows[1] a click of 2."""
    rng = np.random.default_rng(seed)
    lines = [",".join(AVAZU_COLUMNS)]
    for i in range(rows):
        site, device = int(rng.integers(0, 8)), int(rng.integers(0, 3))
        p = 0.08 + 0.25 * (site < 2) + 0.2 * (device == 1)
        click = int(rng.random() < p)
        hour = f"141021{i * 24 // max(rows, 1):02d}"
        if bad_rows and i == bad_rows[0]:
            hour = "notanhour"
        if len(bad_rows) > 1 and i == bad_rows[1]:
            click = 2
        values = [str(10**19 + i), str(click), hour, "1005", str(i % 2), f"site{site}", f"dom{site}", "cat0"]
        values += ["ecad2386", "7801e8d9", "07d7df22", f"dev{i % 5}", f"ip{i}", f"model{device}", str(device)]
        values += ["0", str(15000 + site), "320", "50", "1722", "0", "35", "-1", "79"]
        lines.append(",".join(values))
    path.write_text("\n".join(lines) + "\n")
    return path


# child processes (tests/test_group.py, test_children.py): pids written to files, gone or not
def pid_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if not p.name.endswith(".new"))


def running(pid: int) -> bool:
    """A live process (a zombie nobody reaped yet counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(running(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
