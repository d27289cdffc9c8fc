"""The peers `adstream bench step --peer NAME` runs beside adstream's trainer, each in its own
environment (built by `make peers`), driven as a subprocess on the bench's own batches.

TorchRec is the one peer today: its FBGEMM kernels do not load under the project's torch, so it
runs under `.peers/torchrec/bin/python` (torch, fbgemm-gpu-cpu and torchrec pinned in
bench/peers/torchrec.lock) the script bench/peers/torchrec_step.py. The bench hands it one .npz:
the same events, each field's ids numbered 0..rows_f - 1 (TorchRec's tables are fixed-size; a
collision-free numbering gives it exactly the rows adstream's store holds), the dense floats, the
labels, and the model's sizes. A missing environment is a message in the JSON, not a failure of
the rest of the bench.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from stream.records import FeatureBatch
from trainer.model import FAMILIES, CtrModel, ModelConfig
from trainer.settings import TrainerSettings

ROOT = Path(__file__).resolve().parent.parent
PEERS = {"torchrec": ROOT / ".peers" / "torchrec" / "bin" / "python"}
SCRIPTS = {"torchrec": ROOT / "bench" / "peers" / "torchrec_step.py"}
PEER_TIMEOUT_S = 1800


def numbered_per_field(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, F) ids -> (N, F) row numbers, each field's distinct ids numbered 0..rows_f - 1 in order of
    value, and rows_f per field (F,)."""
    rows = np.empty_like(ids)
    sizes = np.empty(ids.shape[1], dtype=np.int64)
    for f in range(ids.shape[1]):
        distinct, rows[:, f] = np.unique(ids[:, f], return_inverse=True)
        sizes[f] = len(distinct)
    return rows, sizes


def part_sizes(model: CtrModel, rows: int) -> dict[str, int]:
    """adstream's parameters per part, as the peer counts them: `rows` store rows of E + 1 values,
    the cross layers, the MLP (its output layer included), the wide part (bias + dense linear)."""
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    return {
        "rows": rows * model.config.row_dim,
        "cross": count(model.cross) if hasattr(model, "cross") else 0,
        "mlp": count(model.mlp) if hasattr(model, "mlp") else 0,
        "wide": model.bias.numel() + model.dense_linear.weight.numel(),
    }


def dense_macs_per_event(model: CtrModel) -> int:
    """Multiply-adds per event of the dense layers (every nn.Linear's weight: cross, MLP, dense linear)."""
    import torch.nn as nn

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def run_peer(
    name: str, features: FeatureBatch, config: ModelConfig, settings: TrainerSettings, batch: int, warmup_share: float
) -> dict[str, Any]:
    """The peer's figures on `features` in batches of `batch` (its own warm-up share untimed), with
    adstream's model `config`; {"peer": name, "error": what to do} when its environment is missing,
    the model is not one it has, or its run fails."""
    python = PEERS[name]
    if not python.exists():
        return {"peer": name, "error": f"no {name} environment at {python.parent.parent}: run `make peers` to build it"}
    if config.kind != "dcn" or config.cross_rank or config.list_pooling:
        return {
            "peer": name,
            "error": f"the {name} peer builds the full-rank DCN-v2 over single-id fields, not kind={config.kind!r} "
            f"cross_rank={config.cross_rank} list fields={len(config.list_pooling)}: run it with the default model",
        }
    rows, sizes = numbered_per_field(features.ids)
    spec = {
        "embed_dim": config.embed_dim,
        "lr_embed_dim": settings.model.embed_dim or FAMILIES["lr"].embed_dim,
        "cross_layers": config.cross_layers,
        "hidden": list(config.hidden),
        "batch": batch,
        "lr": settings.optim.lr,
        "sparse_lr": settings.optim.wide_lr,  # row-wise Adagrad's rate (the speed does not depend on it)
        "warmup_share": warmup_share,
        "threads": settings.threads,
    }
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as work:
        path = Path(work) / "batches.npz"
        np.savez(
            path,
            ids=rows,
            dense=features.dense.astype(np.float32),
            labels=features.labels.astype(np.float32),
            rows_per_field=sizes,
            spec=np.array(json.dumps(spec)),
        )
        done = subprocess.run(
            [str(python), str(SCRIPTS[name]), str(path)], capture_output=True, text=True, timeout=PEER_TIMEOUT_S
        )
    if done.returncode != 0:
        return {"peer": name, "error": f"{python} {SCRIPTS[name].name} exited {done.returncode}: {done.stderr[-2000:]}"}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))
