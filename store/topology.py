"""The machine's GPU / NIC / CPU / NUMA layout, from `nvidia-smi topo -m` and /sys, as plain data.

`parse_topo_matrix(text)` reads the matrix format: a header of device columns (GPU#, NIC# or a
NIC's own name such as mlx5_0) followed by "CPU Affinity", "NUMA Affinity" and "GPU NUMA ID"
where the driver prints them; one row per device with link kinds X, NV#, PIX, PXB, PHB, NODE,
SYS; and an optional "NIC Legend" naming NIC# columns. Old drivers print no NUMA column: then
GPUs sharing a CPU affinity set are given one NUMA node, numbered in order of appearance.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from store.errors import StoreError

# Link kinds from fastest to slowest (NV# is ranked by its link count separately).
PCIE_RANK = {"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5}
LINK_CLASS = {
    "PIX": "pcie-switch",
    "PXB": "pcie-switch",
    "PHB": "numa-local",
    "NODE": "numa-local",
    "SYS": "cross-socket",
}
_AFFINITY_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_NV = re.compile(r"NV(\d+)")
_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass(frozen=True)
class Link:
    kind: str  # "NV12", "PIX", "PXB", "PHB", "NODE" or "SYS"

    @property
    def nvlinks(self) -> int:
        match = _NV.fullmatch(self.kind)
        return int(match.group(1)) if match else 0

    @property
    def link_class(self) -> str:
        """nvlink, pcie-switch, numa-local or cross-socket."""
        return "nvlink" if self.nvlinks else LINK_CLASS[self.kind]

    @property
    def rank(self) -> tuple[int, int]:
        """Smaller is faster: NVLink first (more links first), then PCIe kinds by distance."""
        return (0, -self.nvlinks) if self.nvlinks else (PCIE_RANK[self.kind], 0)


@dataclass(frozen=True)
class Gpu:
    index: int
    cpus: tuple[int, ...]  # CPUs local to this GPU (the CPU affinity column)
    numa: int  # NUMA node local to this GPU


@dataclass(frozen=True)
class Topology:
    gpus: tuple[Gpu, ...]
    nics: tuple[str, ...]  # NIC names (from the NIC legend when there is one)
    links: dict[tuple[str, str], Link] = field(default_factory=dict)  # ("GPU0", "NIC3") -> Link, both ways
    numa_cpus: dict[int, tuple[int, ...]] = field(default_factory=dict)  # NUMA node -> its CPUs

    @property
    def numa_nodes(self) -> tuple[int, ...]:
        return tuple(sorted(self.numa_cpus))

    def link(self, a: str, b: str) -> Link:
        return self.links[(a, b)]


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """ "0-51,104-155" -> (0, 1, ..., 51, 104, ..., 155)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part or part == "N/A":
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


def parse_topo_matrix(text: str) -> Topology:
    # nvidia-smi underlines the header with terminal escapes (ESC[4m ... ESC[0m), even into a pipe
    lines = _ESCAPES.sub("", text).splitlines()
    # the header is the indented line naming GPU0 (rows start with their device name)
    header_at = next(
        (i for i, line in enumerate(lines) if re.search(r"\bGPU0\b", line) and line[:1] in (" ", "\t")), None
    )
    if header_at is None:
        raise StoreError("topology: no header line with GPU0 found; pass the output of `nvidia-smi topo -m`")
    header = [t for t in re.split(r"\t+|\s{2,}", lines[header_at].strip()) if t]
    devices = [t for t in header if t not in _AFFINITY_COLUMNS]
    extra = [t for t in header if t in _AFFINITY_COLUMNS]
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, flags=re.MULTILINE))
    links: dict[tuple[str, str], Link] = {}
    affinity: dict[str, dict[str, str]] = {}
    for line in lines[header_at + 1 :]:
        tokens = line.split()
        if not tokens or tokens[0] not in devices:
            continue
        name, cells = tokens[0], tokens[1 : 1 + len(devices)]
        if len(cells) != len(devices):
            raise StoreError(f"topology: row {name} has {len(cells)} link cells, expected {len(devices)}")
        for other, cell in zip(devices, cells, strict=True):
            if other != name:
                if cell not in PCIE_RANK and not _NV.fullmatch(cell):
                    raise StoreError(f"topology: unknown link kind {cell!r} between {name} and {other}")
                links[(name, other)] = Link(cell)
        affinity[name] = dict(zip(extra, tokens[1 + len(devices) :], strict=False))

    gpu_names = [d for d in devices if re.fullmatch(r"GPU\d+", d)]
    numa_of_cpus: dict[tuple[int, ...], int] = {}
    gpus = []
    numa_cpus: dict[int, set[int]] = {}
    for name in gpu_names:
        cols = affinity.get(name, {})
        cpus = parse_cpu_list(cols.get("CPU Affinity", ""))
        numa_text = cols.get("NUMA Affinity", "N/A")
        if numa_text.isdigit():
            numa = int(numa_text)
        else:  # no NUMA column: one node per distinct CPU set, in order of appearance
            numa = numa_of_cpus.setdefault(cpus, len(numa_of_cpus))
        gpus.append(Gpu(int(name[3:]), cpus, numa))
        numa_cpus.setdefault(numa, set()).update(cpus)
    nic_columns = [d for d in devices if d not in gpu_names]
    rename: dict[str, str] = {col: str(legend.get(col, col)) for col in nic_columns}
    named_links = {(rename.get(a, a), rename.get(b, b)): link for (a, b), link in links.items()}
    return Topology(
        tuple(gpus),
        tuple(rename[c] for c in nic_columns),
        named_links,
        {node: tuple(sorted(cpus)) for node, cpus in numa_cpus.items()},
    )


def cpu_only_topology(sys_root: str | Path = "/sys") -> Topology:
    """No GPUs: the NUMA nodes and their CPUs from /sys (one node 0 with every CPU if unreadable)."""
    nodes = {}
    for node_dir in sorted(Path(sys_root, "devices/system/node").glob("node[0-9]*")):
        cpulist = node_dir / "cpulist"
        if cpulist.is_file():
            nodes[int(node_dir.name[4:])] = parse_cpu_list(cpulist.read_text())
    if not nodes:
        import os

        nodes = {0: tuple(sorted(os.sched_getaffinity(0)))}
    return Topology((), (), {}, nodes)


def discover() -> Topology:
    """The topology of this machine: `nvidia-smi topo -m` when there is a GPU driver, else /sys."""
    if shutil.which("nvidia-smi"):
        result = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
        if result.returncode == 0 and "GPU0" in result.stdout:
            topology = parse_topo_matrix(result.stdout)
            if not topology.numa_cpus:
                return Topology(topology.gpus, topology.nics, topology.links, cpu_only_topology().numa_cpus)
            return topology
    return cpu_only_topology()
