"""A local group of replicas (`adstream train --workers N`, launch_local) listens on nothing another
machine can reach: it meets through a FileStore, and gloo's connections stay on loopback."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.group import launch_local

LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::1


def listening_addresses() -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) this process listens on."""
    mine = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in mine:  # state LISTEN, socket inode ours
                found.append(fields[1].split(":")[0])
    return found


def collective_then_sockets() -> list[str]:
    total = torch.ones(1)
    dist.all_reduce(total)  # the group is formed and gloo's pairs are connected
    assert total.item() == dist.get_world_size()
    return listening_addresses()


def test_a_local_group_listens_on_loopback_only():
    for addresses in launch_local(collective_then_sockets, 2):
        assert all(a in LOOPBACK for a in addresses), addresses
