"""The placement plan: where each GPU's tiers live and how rows travel between GPUs.

- each GPU's RAM tier and staging buffers on the NUMA node local to that GPU (the trainer for
  that GPU pins itself to those CPUs, so first-touch allocation lands on that node);
- each GPU's RocksDB directory on the storage path configured for its NUMA node;
- feature ids sharded over GPUs by a hash of the id;
- routes between GPUs: a direct NVLink, else a two-hop NVLink path through a third GPU, else
  the direct PCIe path (same switch, then same NUMA node, then across sockets);
- a NIC for each GPU, for traffic leaving the machine: one of its closest, spread over the NICs
  that are equally close (assign_nics).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from store.errors import StoreError
from store.hashing import GOLDEN
from store.topology import Link, Topology


@dataclass(frozen=True)
class Route:
    src: int
    dst: int
    via: tuple[int, ...]  # intermediate GPUs (empty: direct)
    link_class: str  # nvlink, pcie-switch, numa-local or cross-socket (the slowest hop)


@dataclass(frozen=True)
class GpuPlacement:
    gpu: int
    numa: int  # NUMA node of the RAM tier and staging buffers
    cpus: tuple[int, ...]  # CPUs the trainer of this GPU runs on
    rocksdb_dir: str  # the cold tier's directory
    shard: int  # feature-id shard owned by this GPU
    nic: str | None  # closest NIC
    peers: tuple[int, ...]  # other GPUs, best route first


@dataclass(frozen=True)
class Plan:
    placements: tuple[GpuPlacement, ...]
    routes: dict[tuple[int, int], Route] = field(default_factory=dict)
    cpu_only: bool = False

    @property
    def num_shards(self) -> int:
        return max(len(self.placements), 1)


def assign_nics(topology: Topology) -> dict[int, str | None]:
    """GPU index -> its NIC: one of the nearest NICs (best link rank), spread so that GPUs sharing
    a switch with several NICs get one each. Ties go to the NIC with the fewest GPUs, then to the
    one whose PIX siblings (ports or cards behind the same switch) carry the fewest, then to the
    first listed. (Nearest alone gave both GPUs of a DGX A100 pair the same NIC while its twin idled.)"""
    load = {nic: 0 for nic in topology.nics}

    def siblings_load(nic: str) -> int:
        pix = [
            o for o in topology.nics if o != nic and (nic, o) in topology.links and topology.link(nic, o).kind == "PIX"
        ]
        return sum(load[o] for o in pix)

    out: dict[int, str | None] = {}
    for gpu in sorted(g.index for g in topology.gpus):
        reachable = [nic for nic in topology.nics if (f"GPU{gpu}", nic) in topology.links]
        if not reachable:
            out[gpu] = None
            continue
        best = min(topology.link(f"GPU{gpu}", nic).rank for nic in reachable)
        nearest = [nic for nic in reachable if topology.link(f"GPU{gpu}", nic).rank == best]
        choice = min(nearest, key=lambda nic: (load[nic], siblings_load(nic), topology.nics.index(nic)))
        load[choice] += 1
        out[gpu] = choice
    return out


def _route(topology: Topology, src: int, dst: int) -> Route:
    direct = topology.link(f"GPU{src}", f"GPU{dst}")
    if direct.nvlinks:
        return Route(src, dst, (), "nvlink")
    best: tuple[int, int] | None = None  # (-min nvlinks on the path, via)
    for gpu in topology.gpus:
        via = gpu.index
        if via in (src, dst):
            continue
        a, b = topology.link(f"GPU{src}", f"GPU{via}"), topology.link(f"GPU{via}", f"GPU{dst}")
        if a.nvlinks and b.nvlinks:
            key = (-min(a.nvlinks, b.nvlinks), via)
            best = key if best is None or key < best else best
    if best is not None:
        return Route(src, dst, (best[1],), "nvlink")
    return Route(src, dst, (), direct.link_class)


def _route_rank(route: Route, topology: Topology) -> tuple[int, int, int, int]:
    """Direct NVLink (more links first), two-hop NVLink, same switch, same NUMA node, across
    sockets; ties go to a peer on the same NUMA node, then the lower index."""
    numa = {g.index: g.numa for g in topology.gpus}
    other_node = int(numa[route.src] != numa[route.dst])
    if route.link_class == "nvlink" and not route.via:
        return (0, topology.link(f"GPU{route.src}", f"GPU{route.dst}").rank[1], other_node, route.dst)
    if route.link_class == "nvlink":
        return (1, 0, other_node, route.dst)
    order = {"pcie-switch": 2, "numa-local": 3, "cross-socket": 4}
    return (order[route.link_class], 0, other_node, route.dst)


def make_plan(
    topology: Topology, storage_paths: dict[int, str] | None = None, default_storage: str = ".state/rocksdb"
) -> Plan:
    """storage_paths maps a NUMA node to the directory for the RocksDB tiers of its GPUs."""
    storage_paths = storage_paths or {}
    unknown = set(storage_paths) - set(topology.numa_nodes)
    if unknown:
        raise StoreError(
            f"placement: storage paths given for NUMA node(s) {sorted(unknown)}, "
            f"but this machine has nodes {list(topology.numa_nodes)}"
        )
    if not topology.gpus:  # CPU only: one "device" (the CPU) on node 0's CPUs
        node = topology.numa_nodes[0] if topology.numa_nodes else 0
        path = storage_paths.get(node, default_storage)
        cpus = topology.numa_cpus.get(node, ())
        return Plan((GpuPlacement(-1, node, cpus, f"{path}/cpu", 0, None, ()),), {}, cpu_only=True)
    routes = {
        (a.index, b.index): _route(topology, a.index, b.index)
        for a in topology.gpus
        for b in topology.gpus
        if a.index != b.index
    }
    nics = assign_nics(topology)
    placements = []
    for shard, gpu in enumerate(sorted(topology.gpus, key=lambda g: g.index)):
        peers = sorted(
            (routes[(gpu.index, other.index)] for other in topology.gpus if other.index != gpu.index),
            key=lambda r: _route_rank(r, topology),
        )
        path = storage_paths.get(gpu.numa, default_storage)
        placements.append(
            GpuPlacement(
                gpu.index,
                gpu.numa,
                gpu.cpus,
                f"{path}/gpu{gpu.index}",
                shard,
                nics[gpu.index],
                tuple(r.dst for r in peers),
            )
        )
    return Plan(tuple(placements), routes)


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """Which shard (GPU) owns each feature id: a multiplicative hash, so field-structured ids spread evenly."""
    with np.errstate(over="ignore"):
        mixed = ids.astype(np.uint64) * GOLDEN  # bits 32..63 (store/hashing.py)
    return ((mixed >> np.uint64(32)) % np.uint64(num_shards)).astype(np.int64)


def pin_to(placement: GpuPlacement) -> tuple[int, ...]:
    """Run this process on the placement's CPUs (those available to it); returns the CPUs set."""
    available = os.sched_getaffinity(0)
    cpus = tuple(sorted(set(placement.cpus) & available)) or tuple(sorted(available))
    os.sched_setaffinity(0, cpus)
    return cpus


def describe(topology: Topology, plan: Plan) -> str:
    """A human-readable report for `adstream topology`."""
    lines = [f"GPUs: {len(topology.gpus)}   NICs: {len(topology.nics)}   NUMA nodes: {list(topology.numa_nodes)}"]
    for node in topology.numa_nodes:
        cpus = topology.numa_cpus[node]
        lines.append(f"  node {node}: {len(cpus)} CPUs")
    if plan.cpu_only:
        p = plan.placements[0]
        lines.append(f"CPU only: RAM tier on node {p.numa}, RocksDB at {p.rocksdb_dir}")
        return "\n".join(lines)
    lines.append("placement:")
    for p in plan.placements:
        lines.append(
            f"  GPU{p.gpu}: NUMA node {p.numa} ({len(p.cpus)} CPUs), shard {p.shard}/{plan.num_shards}, "
            f"RocksDB {p.rocksdb_dir}, NIC {p.nic or '-'}, peers {list(p.peers)}"
        )
    if not plan.routes:  # one GPU: nothing to route
        return "\n".join(lines)
    lines.append("routes (slowest hop):")
    for p in plan.placements:
        parts = []
        for dst in p.peers:
            r = plan.routes[(p.gpu, dst)]
            parts.append(f"{dst}:{r.link_class}" + (f" via {r.via[0]}" if r.via else ""))
        lines.append(f"  GPU{p.gpu} -> " + ", ".join(parts))
    return "\n".join(lines)


__all__ = ["GpuPlacement", "Link", "Plan", "Route", "describe", "make_plan", "pin_to", "shard_of"]
