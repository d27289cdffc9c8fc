"""Topology parsing and placement plans over every real `nvidia-smi topo -m` matrix in ../shared."""

import os
from pathlib import Path

import numpy as np
import pytest

from store.errors import StoreError
from store.placement import describe, make_plan, pin_to, shard_of
from store.topology import cpu_only_topology, parse_cpu_list, parse_topo_matrix
from tests.helpers import needs_shared, shared_dir

TOPOLOGY_DIR = shared_dir() / "data" / "topology"
MATRICES = sorted(TOPOLOGY_DIR.glob("*.txt")) if TOPOLOGY_DIR.is_dir() else []
needs_matrices = needs_shared(bool(MATRICES), str(TOPOLOGY_DIR))


def load(name: str):
    topology = parse_topo_matrix((TOPOLOGY_DIR / f"{name}.txt").read_text())
    return topology, make_plan(topology, {node: f"/nvme{node}" for node in topology.numa_nodes})


@needs_matrices
@pytest.mark.parametrize("path", MATRICES, ids=lambda p: p.stem)
def test_every_matrix_parses_into_a_consistent_plan(path):
    assert len(MATRICES) == 7, f"expected the 7 real matrices in {TOPOLOGY_DIR}"
    topology = parse_topo_matrix(path.read_text())
    plan = make_plan(topology)
    n = len(topology.gpus)
    assert n >= 2 and [g.index for g in topology.gpus] == list(range(n))
    assert len(plan.routes) == n * (n - 1)
    assert sorted(p.shard for p in plan.placements) == list(range(n))
    for p in plan.placements:
        assert sorted(p.peers) == sorted(set(range(n)) - {p.gpu})
        assert set(p.cpus) <= set(topology.numa_cpus[p.numa])
    for (a, b), link in topology.links.items():
        assert topology.links[(b, a)].kind == link.kind  # the matrix is symmetric


@needs_matrices
def test_h100_two_sockets_all_nvlink():
    topology, plan = load("h100_sxm5_8x_nvswitch_2socket")
    assert [p.numa for p in plan.placements] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert (
        plan.placements[0].cpus[:2] == (0, 1) and 104 in plan.placements[0].cpus and 52 not in plan.placements[0].cpus
    )
    assert plan.placements[5].rocksdb_dir == "/nvme1/gpu5"
    assert {r.link_class for r in plan.routes.values()} == {"nvlink"}
    assert topology.link("GPU0", "GPU7").nvlinks == 18
    assert plan.placements[0].peers[:3] == (1, 2, 3)  # NUMA-local peers first among equal links


@needs_matrices
def test_dgx1_hybrid_cube_mesh_routes_two_hops_over_nvlink():
    topology, plan = load("v100_sxm2_8x_hybrid_cube_mesh_dgx1_style")
    assert topology.nics == ("mlx5_0",)
    assert [p.numa for p in plan.placements] == [0, 0, 0, 0, 1, 1, 1, 1]  # no NUMA column: from CPU sets
    assert plan.placements[0].peers == (3, 4, 1, 2, 5, 6, 7)  # NV2, NV2, NV1, NV1, then two hops
    route = plan.routes[(0, 5)]
    assert route.link_class == "nvlink" and route.via == (1,)
    assert topology.link("GPU0", "GPU5").kind == "SYS"
    assert plan.placements[2].nic == "mlx5_0" and topology.link("GPU2", "mlx5_0").kind == "PIX"


@needs_matrices
def test_a100_nics_from_the_legend():
    topology, plan = load("a100_sxm4_8x_nvswitch_17nic")
    assert len(topology.nics) == 17 and topology.nics[-1] == "mlx5_bond_0"
    # each GPU pair shares a switch with 4 NICs (two PIX pairs): one NIC each, on different pairs
    assert [p.nic for p in plan.placements] == [
        "mlx5_2",
        "mlx5_4",
        "mlx5_6",
        "mlx5_8",
        "mlx5_10",
        "mlx5_12",
        "mlx5_14",
        "mlx5_16",
    ]
    assert all(topology.link(f"GPU{p.gpu}", str(p.nic)).kind == "PXB" for p in plan.placements)  # still the nearest
    assert topology.numa_nodes == (0,) and len(topology.numa_cpus[0]) == 104


@needs_matrices
def test_pcie_machines_prefer_the_local_socket():
    topology, plan = load("asus_esc8000a_e12_2socket_genoa_4x_rtx6000ada_pcie")
    assert [p.numa for p in plan.placements] == [0, 0, 1, 1]
    assert plan.routes[(0, 1)].link_class == "numa-local" and plan.routes[(0, 2)].link_class == "cross-socket"
    assert plan.placements[2].peers == (3, 0, 1) and plan.placements[2].nic == "mlx5_2"
    assert plan.placements[3].rocksdb_dir == "/nvme1/gpu3"
    topology, plan = load("rtx4090_pcie_8x_2socket")  # tab-separated, no NIC legend
    assert [p.numa for p in plan.placements] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert plan.placements[6].nic == "NIC0" and topology.link("GPU6", "NIC0").kind == "PHB"
    assert plan.placements[1].peers[:3] == (0, 2, 3)  # all SYS: same-node peers first
    topology, plan = load("puget_threadripper_pro_wrx90_2x_gpu_workstation")
    assert plan.routes[(0, 1)].link_class == "numa-local"
    topology, plan = load("a10_pcie_4x_no_nvlink")
    assert {r.link_class for r in plan.routes.values()} == {"cross-socket"} and topology.numa_nodes == (0,)


def test_one_gpu_machine_whose_header_carries_terminal_escapes():
    """`nvidia-smi topo -m` as an H200 VM printed it into a file (captured on the device machine,
    kept with the tests): the header underlined with ESC[4m ... ESC[0m, an empty GPU NUMA ID cell."""
    text = (Path(__file__).parent / "data" / "topology" / "h200_1x_terminal_escapes.txt").read_text()
    assert "\x1b[4m" in text
    topology = parse_topo_matrix(text)
    assert [(g.index, g.numa, g.cpus) for g in topology.gpus] == [(0, 0, tuple(range(16)))]
    assert topology.nics == () and topology.links == {}
    placement = make_plan(topology, {0: "/nvme0"}).placements[0]
    assert (placement.gpu, placement.numa, placement.rocksdb_dir) == (0, 0, "/nvme0/gpu0")
    report = describe(topology, make_plan(topology))
    assert "GPU0: NUMA node 0 (16 CPUs)" in report and "routes" not in report  # one GPU: no routes to list


def test_cpu_only_machine(tmp_path):
    node = tmp_path / "devices/system/node/node0"
    node.mkdir(parents=True)
    (node / "cpulist").write_text("0-3\n")
    topology = cpu_only_topology(tmp_path)
    assert topology.gpus == () and topology.numa_cpus == {0: (0, 1, 2, 3)}
    plan = make_plan(topology, {0: "/data"})
    assert plan.cpu_only and plan.placements[0].rocksdb_dir == "/data/cpu"
    assert pin_to(make_plan(cpu_only_topology()).placements[0]) == tuple(sorted(os.sched_getaffinity(0)))


def test_errors_name_the_problem():
    with pytest.raises(StoreError, match="no header line"):
        parse_topo_matrix("hello")
    with pytest.raises(StoreError, match="unknown link kind"):
        parse_topo_matrix("        GPU0    GPU1\nGPU0     X      FOO\nGPU1    FOO      X\n")
    topology = parse_topo_matrix(
        "        GPU0    GPU1    CPU Affinity\nGPU0     X      PHB     0-1\nGPU1    PHB      X      0-1\n"
    )
    with pytest.raises(StoreError, match="NUMA node"):
        make_plan(topology, {3: "/x"})


def test_cpu_lists_and_shards():
    assert parse_cpu_list("0-2,8,10-11") == (0, 1, 2, 8, 10, 11)
    ids = (np.arange(39, dtype=np.int64)[:, None] << 33 | np.arange(2000)[None, :]).reshape(-1)
    shards = shard_of(ids, 8)
    counts = np.bincount(shards, minlength=8)
    assert counts.min() > 0.8 * len(ids) / 8  # field-structured ids spread evenly
    assert (shard_of(ids, 8) == shards).all()


@needs_matrices
def test_each_gpu_rank_keeps_its_rocksdb_in_the_folder_of_its_numa_node(monkeypatch):
    from trainer.configs import store_path
    from trainer.errors import TrainerError
    from trainer.settings import StoreSettings, TrainerSettings

    topology, _ = load("h100_sxm5_8x_nvswitch_2socket")
    store = StoreSettings(kind="tiered", path="/plain", numa_paths=("/nvme0/a", "/nvme1/a"))
    on = lambda device: TrainerSettings(device=device, store=store)  # noqa: E731
    assert store_path(on("cuda:5"), 5, topology) == "/nvme1/a/gpu5"
    assert store_path(on("cuda:0"), 0, topology) == "/nvme0/a/gpu0"
    monkeypatch.setenv("LOCAL_RANK", "6")  # plain "cuda" under torchrun: this process's local rank
    assert store_path(on("cuda"), 6, topology) == "/nvme1/a/gpu6"
    # on the CPU the first folder, one per rank; without numa_paths the old scheme
    assert store_path(on("cpu"), 1, topology) == "/nvme0/a/cpu-rank1"
    assert store_path(TrainerSettings(store=StoreSettings(kind="tiered", path="/plain")), 2) == "/plain-rank2"
    one_node = TrainerSettings(device="cuda:5", store=StoreSettings(kind="tiered", numa_paths=("/nvme0/a",)))
    with pytest.raises(TrainerError, match=r"numa_paths.*NUMA node 1"):
        store_path(one_node, 5, topology)
    three = TrainerSettings(device="cuda:0", store=StoreSettings(kind="tiered", numa_paths=("/a", "/b", "/c")))
    with pytest.raises(TrainerError, match=r"trainer.store.numa_paths.*NUMA node"):
        store_path(three, 0, topology)
    with pytest.raises(TrainerError, match="tiered"):
        StoreSettings(numa_paths=("/a",))  # the RAM store has no folder
