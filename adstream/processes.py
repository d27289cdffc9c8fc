"""Background processes: start with a log and a pid file, wait for readiness, stop a process group.

The local stack (stack.py) runs Kafka and MLflow this way; the demo and the integration tests
start `adstream` commands (the Faust worker, the HTTP server) with `cli_process`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from adstream.config import Config, as_dict
from adstream.errors import CliError
from common.processes import process_tree


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def alive(pid: int) -> bool:
    """Whether a process of this pid exists (and is ours to signal)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def pid_alive(pid_file: Path) -> int | None:
    """The pid a pid file names, when that process is alive."""
    if not pid_file.is_file():
        return None
    try:
        pid = int(pid_file.read_text().strip())
    except ValueError:
        return None
    return pid if alive(pid) else None


def spawn(cmd: list[str], log_file: Path, pid_file: Path, env: dict[str, str] | None = None) -> int:
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )
    pid_file.write_text(str(proc.pid))
    return proc.pid


def tree_memory(pid: int) -> tuple[int, int]:
    """(processes, resident bytes) of a process and all its descendants, from /proc (Linux)."""
    count, rss = 0, 0
    for member in process_tree(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue
        count += 1
        line = next((x for x in status.splitlines() if x.startswith("VmRSS:")), "VmRSS: 0 kB")
        rss += int(line.split()[1]) * 1024
    return count, rss


def wait_until(check, what: str, timeout_s: float, pid_file: Path, log_file: Path) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if pid_alive(pid_file) is None:
            tail = log_file.read_text(errors="replace")[-3000:] if log_file.is_file() else ""
            raise CliError(f"{what}: the process exited during start; log {log_file}:\n{tail}")
        time.sleep(0.5)
    raise CliError(f"{what}: not up after {timeout_s:.0f}s; see {log_file}")


def stop_pid_file(pid_file: Path, timeout_s: float = 20.0) -> bool:
    pid = pid_alive(pid_file)
    if pid is None:
        pid_file.unlink(missing_ok=True)
        return False
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and pid_alive(pid_file):
        time.sleep(0.2)
    if pid_alive(pid_file):
        os.killpg(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)
    return True


def write_toml(config: Config, path: Path) -> Path:
    """Write a Config as TOML (values are str, int, float, bool or tuples of those; nested settings
    become sub-tables such as [trainer.optim])."""
    lines: list[str] = []

    def table(name: str, values: dict[str, Any]) -> None:
        lines.append(f"[{name}]")
        nested = {k: v for k, v in values.items() if isinstance(v, dict)}
        for key, value in values.items():
            if key not in nested:
                lines.append(f"{key} = {json.dumps(list(value) if isinstance(value, tuple) else value)}")
        for key, value in nested.items():
            table(f"{name}.{key}", value)

    for section, values in as_dict(config).items():
        table(section, values)
    path.write_text("\n".join(lines) + "\n")
    return path


def cli_process(config_file: Path, *args: str, log: Path) -> subprocess.Popen[bytes]:
    """Start `adstream --config FILE args...` in the background with its output in `log`."""
    cmd = [sys.executable, "-m", "adstream.cli", "--config", str(config_file), *args]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
