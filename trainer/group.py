"""Process groups of trainer replicas: join one, start one on this machine, supervise one.

A replica learns its rank and the group from the torchrun environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK), so the same `adstream train` runs under torchrun on
several machines and under `adstream train --workers N`, whose supervisor sets that environment
for N local processes and restarts the whole group when one dies (a dead peer leaves the others
blocked in a collective, so they are stopped too); the restarted group resumes from the newest
complete snapshot. Backend: NCCL on CUDA, gloo on CPU.

Replicas never outlive the process that started them: each asks the kernel for SIGTERM when its
parent dies (`die_with_parent`), so a supervisor killed with SIGKILL leaves no group training on
its own, and a supervisor sent SIGTERM or SIGINT stops its replicas with SIGTERM (they run in a
process group of their own, so they get one signal) and waits for them instead of restarting them.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from common.processes import die_with_parent, stop_requested
from trainer.errors import TrainerError

log = logging.getLogger("adstream.trainer")
T = TypeVar("T")
GROUP_STORE_ENV = "ADSTREAM_GROUP_STORE"  # a local group's FileStore path (group_env); absent under torchrun
COLLECTIVE_TIMEOUT = timedelta(minutes=5)  # a peer silent this long fails the collective (and the replica)


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def local_gpu(device: str) -> int:
    """The GPU index of a "cuda[:N]" device; plain "cuda" means this process's LOCAL_RANK (torchrun)."""
    index = torch.device(device).index
    return index if index is not None else int(os.environ.get("LOCAL_RANK", "0"))


def check_gpu(device: str) -> None:
    """Under trainer.device = cuda: this process's GPU exists, else an error naming the setting and
    the fix (CUDA's and NCCL's own errors come later and name neither). NCCL cannot put two
    replicas on one GPU, so a group needs a GPU per replica on each machine."""
    if not device.startswith("cuda"):
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise TrainerError(
            f"trainer.device={device!r}: torch {torch.__version__} sees no GPU on this machine; "
            'set trainer.device = "cpu", or run where a GPU and its driver are'
        )
    gpu = local_gpu(device)
    if gpu >= count:
        raise TrainerError(
            f"trainer.device={device!r}: this replica's GPU would be GPU{gpu} (LOCAL_RANK "
            f"{os.environ.get('LOCAL_RANK', '0')}), but this machine has {count}; each replica needs a GPU "
            f'of its own: set trainer.group.workers <= {count}, trainer.device = "cuda" (one GPU per '
            'local rank), or trainer.device = "cpu"'
        )


def join_group(device: str = "cpu") -> tuple[int, int]:
    """Join the group the environment describes; (rank, world). Without that environment a lone
    process is (0, 1) with no group (every collective in merge.py is then the identity)."""
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if not dist.is_initialized():
        if device.startswith("cuda"):
            check_gpu(device)
            torch.cuda.set_device(local_gpu(device))
        store_file = os.environ.get(GROUP_STORE_ENV)
        if store_file:  # a group on this machine: rendezvous through a file, no listening socket
            dist.init_process_group(
                backend_for(device),
                init_method=f"file://{store_file}",
                rank=rank,
                world_size=world,
                timeout=COLLECTIVE_TIMEOUT,
            )
        else:  # torchrun's environment (MASTER_ADDR:MASTER_PORT): the group may span machines
            dist.init_process_group(backend_for(device), timeout=COLLECTIVE_TIMEOUT)
    log.info("replica %d of %d joined (%s)", rank, world, dist.get_backend())
    return rank, world


def leave_group() -> None:
    """Leave together, after the work is done: a rank that tears the group down while a peer still
    uses it can abort the peer's exit."""
    if dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError:  # a peer is already gone (a crash); nothing to wait for
            pass
        dist.destroy_process_group()


def abandon_group() -> None:
    """Leave at once, on an error: no barrier, since the peers may be inside another collective and
    would hold this rank for the whole COLLECTIVE_TIMEOUT. Closing the connections makes their
    collective fail now, and the supervisor restarts the group."""
    if dist.is_initialized():
        dist.destroy_process_group()


def in_group(device: str, work: Callable[[int, int], T]) -> T:
    """work(rank, world) inside the group the environment describes (joined here unless already
    joined): left together when it returns, abandoned at once when it raises."""
    joined_here = not dist.is_initialized()
    rank, world = join_group(device)
    try:
        result = work(rank, world)
    except BaseException:
        if joined_here:
            abandon_group()
        raise
    if joined_here:
        leave_group()
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_env(rank: int, world: int, store_file: str) -> dict[str, str]:
    """The environment of replica `rank` of a group on this machine. The group meets through
    `store_file` (torch's FileStore) rather than a TCP store, which would listen on every
    interface, and gloo's connections stay on loopback (GLOO_SOCKET_IFNAME, unless set): nothing
    of a local group can be reached from another machine."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        GROUP_STORE_ENV: store_file,
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    }


def new_store_file() -> str:
    """A path for a local group's FileStore, in a folder of its own (remove_store_file cleans up)."""
    return str(Path(tempfile.mkdtemp(prefix="adstream-group-")) / "store")


def remove_store_file(store_file: str) -> None:
    shutil.rmtree(Path(store_file).parent, ignore_errors=True)


def _entry(
    fn: Callable[..., Any], rank: int, world: int, store_file: str, device: str, queue: Any, args: tuple, parent: int
) -> None:
    die_with_parent(parent)
    os.environ.update(group_env(rank, world, store_file))
    try:
        queue.put((rank, None, in_group(device, lambda r, w: fn(*args))))
    except BaseException:
        queue.put((rank, traceback.format_exc(), None))
        raise


def launch_local(fn: Callable[..., Any], world: int, *args: Any, device: str = "cpu", timeout_s: float = 600) -> list:
    """Run fn(*args) in `world` fresh processes that form one group; their return values by rank.
    fn must be importable (a module-level function): the processes are spawned, not forked."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store_file = new_store_file()
    me = os.getpid()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, store_file, device, queue, args, me)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            try:
                rank, error, value = queue.get(timeout=1.0)
            except Exception:  # queue.Empty: is anyone dead without a word, or are we out of time?
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    raise TrainerError(f"launch_local: replicas {dead} died before reporting (see stderr)") from None
                if time.monotonic() > deadline:
                    raise TrainerError(
                        f"launch_local: {world - len(results)} replicas silent after {timeout_s}s"
                    ) from None
                continue
            if error:
                raise TrainerError(f"replica {rank} failed:\n{error}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        remove_store_file(store_file)
    return [results[r] for r in range(world)]


def supervise(
    argv: Sequence[str],
    workers: int,
    max_restarts: int,
    poll_s: float = 0.5,
    program: Sequence[str] = (sys.executable, "-m", "adstream.cli"),
) -> int:
    """Run `program argv` (`adstream <argv>`) as `workers` replicas; restart all of them (up to
    max_restarts times) when one exits with an error or is killed. SIGTERM or SIGINT to the
    supervisor stops the replicas (SIGTERM, which they take as their operator's stop): no restart,
    and the supervisor returns once they are gone. Returns the group's exit code (0: every replica
    done; 128 + the signal when stopped by one)."""
    attempt, stopping = 0, stop_requested()
    first_thing = functools.partial(die_with_parent, os.getpid())
    while True:
        store_file = new_store_file()  # a fresh rendezvous per attempt
        procs = []
        for rank in range(workers):
            env = {**os.environ, **group_env(rank, workers, store_file), "ADSTREAM_ATTEMPT": str(attempt)}
            out = None if rank == 0 else subprocess.DEVNULL  # rank 0 prints the job's summary
            # a process group of its own: a signal for the whole job (Ctrl-C, `adstream down`)
            # reaches the replicas once, from the supervisor, not twice
            cmd = [*program, *argv]
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, preexec_fn=first_thing, process_group=0))
        log.warning("supervisor: attempt %d, replicas %s", attempt, [p.pid for p in procs])
        failed = None
        while failed is None and not stopping() and any(p.poll() is None for p in procs):
            failed = next((p for p in procs if p.poll() not in (None, 0)), None)
            time.sleep(poll_s)
        stopped = stopping()
        if failed is None and not stopped:
            failed = next((p for p in procs if p.returncode != 0), None)
            if failed is None:
                remove_store_file(store_file)
                return 0
        _stop_all(procs)
        remove_store_file(store_file)
        if stopped:
            log.warning("supervisor: stopped by signal %d; replicas stopped", stopped)
            return 128 + stopped
        assert failed is not None
        log.warning("supervisor: replica pid %d exited with %s", failed.pid, failed.returncode)
        if attempt >= max_restarts:
            return 1
        attempt += 1
        print(f"supervisor: replica {failed.pid} exited ({failed.returncode}); restart {attempt}", file=sys.stderr)


def _stop_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to the replicas still running (after a peer died they are stuck in a collective
    with it), then SIGKILL to any still there after 15 s."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Control:
    """The per-round agreement: a sum over replicas of a few numbers (a no-op alone)."""

    def __init__(self, world: int) -> None:
        self.world = world

    def sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        from trainer.merge import comm_device

        t = torch.tensor(values, dtype=torch.float64, device=comm_device())
        dist.all_reduce(t)
        return t.cpu().tolist()

    def gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()
