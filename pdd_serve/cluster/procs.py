"""This machine's processes (read from /proc) and ports, as the local cluster starts and stops them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path

# ---- processes (via /proc; psutil isn't a dependency) ----------------------------------------


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, parent pid, process group) of pid, or None if it's gone. Public: the reaper
    (`local.spawn_reaper`) imports it in a `python -c` string."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _snapshot() -> dict[int, tuple[str, int, int]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := proc_stat(int(name))) is not None:
            out[int(name)] = st
    return out


def cluster_pids(pgids: Iterable[int], known: Iterable[int] = ()) -> set[int]:
    """Live Ray processes in the given process groups, plus their descendants and `known` pids.

    Descendants matter: `ray start` puts GCS, raylet and agents in its own session, but each worker
    (ray::IDLE, Serve replicas, ...) calls setsid, so it is found only as a child of its raylet.
    """
    groups, snap = set(pgids), _snapshot()
    children: dict[int, list[int]] = {}
    for pid, (_st, ppid, _pg) in snap.items():
        children.setdefault(ppid, []).append(pid)
    todo = [pid for pid, (_st, _ppid, pg) in snap.items() if pg in groups] + [p for p in known if p in snap]
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, ()))
    protected = {os.getpid()}
    p = os.getpid()
    while p > 1 and (st := snap.get(p)):  # never this process or its ancestors
        p = st[1]
        protected.add(p)
    return {pid for pid in seen - protected if snap[pid][0] != "Z" and "ray" in _cmdline(pid)}


def group_runs(pgid: int, binary: str) -> bool:
    """Whether the group runs Ray's `binary` ("raylet/raylet" or "gcs/gcs_server")."""
    return any(f"/{binary} " in _cmdline(pid) for pid in cluster_pids([pgid]))


def groups_running_under(temp_dir: Path) -> set[int]:
    """Process groups of processes whose command line names this cluster's session dir."""
    needle = f"{temp_dir}/session_"
    out = set()
    for pid, (st, _ppid, pg) in _snapshot().items():
        if st != "Z" and needle in _cmdline(pid):
            out.add(pg)
    return out


def terminate(alive: Callable[[], Iterable[int]], grace_s: float, kill_after_s: float = 2.0,
              poll_s: float = 0.05) -> None:
    """SIGTERM the processes `alive()` names, give them grace_s to go, then SIGKILL whatever it
    still names and wait up to kill_after_s. `alive` is asked again every poll_s, so it can follow
    processes that appear meanwhile (a group's new children) and drop the dead ones."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_after_s)):
        left = list(alive())
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while left and time.monotonic() < deadline:
            time.sleep(poll_s)
            left = list(alive())
        if not left:
            return


def kill_groups(pgids: Iterable[int], grace_s: float = 2.0) -> list[int]:
    """SIGTERM the Ray processes of these groups and their descendants, SIGKILL what's left after
    grace_s. Returns the pids signalled."""
    groups = set(pgids) - {os.getpgrp(), 0, 1}
    victims = cluster_pids(groups)

    def alive() -> set[int]:  # once signalled, a pid is followed even if it leaves its group
        left = cluster_pids(groups, victims)
        victims.update(left)
        return left

    terminate(alive, grace_s, kill_after_s=5.0, poll_s=0.1)
    return sorted(victims)


# ---- ports ------------------------------------------------------------------------------------


def port_problem(host: str, port: int) -> str | None:
    """Why `port` can't be used for the head's GCS, or None if it's free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        with contextlib.suppress(OSError):
            if s.connect_ex((host, port)) == 0:
                return f"something is already listening on {host}:{port}"
    for h in ("0.0.0.0", host):  # the GCS binds all interfaces
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((h, port))
            except OSError as e:
                return f"cannot bind {h}:{port} ({e.strerror or e})"
    return None


def free_ports(n: int, avoid: Iterable[int] = ()) -> list[int]:
    avoid, socks, ports = set(avoid), [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
            p = s.getsockname()[1]
            if p not in avoid and p >= 1024:
                ports.append(p)
    finally:
        for s in socks:
            s.close()
    return ports
