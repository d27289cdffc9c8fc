"""Settings -> the components' own configs, in one place: what the [trainer.*] sections a user
writes become for the model (ModelConfig), the embedding table and its sparse optimizer
(TableConfig, SparseOptimConfig), the store (RamTier or TieredStore over a HierarchyConfig) and the
dense optimizer. The components keep configs of their own so each can be built and tested without
the trainer's settings; this module is the only place that maps one onto the other (a settings
value of 0 that means "the family's default" is resolved here). A knob both declare has its default
written once, in the component; the settings take it (common.checks.default_of).
"""

from __future__ import annotations

import torch

from store.configs import HierarchyConfig, TableConfig
from store.hierarchy import TieredStore
from store.ram import RamTier
from store.sparse_optim import SparseOptimConfig
from store.tier import Tier
from store.topology import Topology
from stream.schema import Schema
from trainer.errors import TrainerError
from trainer.group import local_gpu
from trainer.model import FAMILIES, ModelConfig
from trainer.optim import wide_deep_optimizer
from trainer.settings import TrainerSettings, family_sparse_lr


def store_path(settings: TrainerSettings, rank: int = 0, topology: Topology | None = None) -> str:
    """The RocksDB folder of replica `rank` (store.kind = "tiered"): store.path (-rank<N> past rank 0),
    or, with store.numa_paths on a GPU, the folder the topology plan names for this rank's GPU
    (<numa_paths[node of the GPU]>/gpu<N>). `topology`: this machine's unless given (tests)."""
    store = settings.store
    if not store.numa_paths or not settings.device.startswith("cuda"):
        path = f"{store.numa_paths[0]}/cpu" if store.numa_paths else store.path
        return path if rank == 0 else f"{path}-rank{rank}"
    from store.errors import StoreError
    from store.placement import make_plan
    from store.topology import discover

    try:
        plan = make_plan(topology or discover(), {node: str(p) for node, p in enumerate(store.numa_paths)})
    except StoreError as err:
        raise TrainerError(
            f"config trainer.store.numa_paths={list(store.numa_paths)}: {err}; give one folder per NUMA node"
        ) from None
    gpu = local_gpu(settings.device)
    placement = next((p for p in plan.placements if p.gpu == gpu), None)
    if placement is None:
        raise TrainerError(f"trainer.device={settings.device!r}: GPU{gpu} is not in this machine's topology plan")
    if placement.numa >= len(store.numa_paths):
        raise TrainerError(
            f"config trainer.store.numa_paths={list(store.numa_paths)}: GPU{gpu} is on NUMA node {placement.numa}, "
            f"which has no folder; give one per node (index = node)"
        )
    return placement.rocksdb_dir


def make_tier(settings: TrainerSettings, width: int, rank: int = 0) -> Tier:
    """The embedding store the settings ask for (each replica of a group gets its own RocksDB folder)."""
    store = settings.store
    if store.kind == "ram":
        return RamTier(width, store.ram_bytes)
    config = HierarchyConfig(
        device_bytes=store.device_bytes,
        ram_bytes=store.ram_bytes,
        disk_bytes=store.disk_bytes,
        path=store_path(settings, rank),
        device=settings.device,
        policy=store.eviction,
        ttl_steps=store.ttl_steps,
        pipelined=store.pipelined,
        rocksdb_format=store.rocksdb_format,
        device_tier=settings.device.startswith("cuda"),  # on the CPU the RAM tier is the top cache
    )
    return TieredStore(width, config)


def make_optimizer(model: torch.nn.Module, settings: TrainerSettings) -> torch.optim.Optimizer:
    optim = settings.optim
    if optim.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=optim.lr)
    return wide_deep_optimizer(model, optim.lr, optim.wide_lr)  # Adam (deep) + Adagrad (wide): trainer/optim.py


def model_config(schema: Schema, settings: TrainerSettings) -> ModelConfig:
    model = settings.model
    return ModelConfig(
        num_fields=schema.num_fields,
        num_dense=schema.num_dense,
        embed_dim=model.embed_dim or FAMILIES[model.kind].embed_dim,
        hidden=tuple(model.hidden),
        seed=settings.seed,
        kind=model.kind,
        cross_layers=model.cross_layers,
        cross_rank=model.cross_rank,
        dense_norm=model.dense_norm,
        list_pooling=schema.list_pooling,
        delayed_feedback=settings.optim.delayed_feedback,
    )


def table_config(model: ModelConfig, settings: TrainerSettings) -> TableConfig:
    optim = settings.optim
    sparse = SparseOptimConfig(
        name=optim.sparse_optimizer,
        lr=optim.sparse_lr or family_sparse_lr(settings.model.kind, settings.batch_size),
        wide_lr=optim.wide_lr,
        l2=optim.sparse_l2,
        initial_accumulator=optim.initial_accumulator,
        clip_ratio=optim.clip_ratio,
        wide_per_event=optim.wide_per_event,
    )
    return TableConfig(
        dim=model.row_dim,
        seed=settings.seed,
        init_std=optim.init_std,
        optim=sparse,
        min_count=settings.store.min_count,
        admission_bytes=settings.store.admission_bytes,
    )
