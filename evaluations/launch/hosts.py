"""Emulated hosts on this machine, for launching a cluster with Ray's `local` provider for real.

    python -m evaluations.launch.hosts up        # make hosts a (10.197.0.11) and b (10.197.0.12)
    python -m evaluations.launch.hosts status
    python -m evaluations.launch.hosts down      # remove them: processes, namespaces, links, files

Each host is as separate as this machine allows without VMs:
- its own **network namespace** with one address on a bridge (`pddh0`, 10.197.0.1/24 on this side):
  the hosts reach each other and this machine, nothing else (no NAT, and the root namespace does
  not forward);
- its own **PID namespace** (sshd is PID 1 there; a `ray stop` on one host cannot see the other's Ray);
- its own **mount namespace**: the home of the login user (root) is /home/pdd, a directory of its
  own (a private /etc/passwd names it), and so are /tmp and /dev/shm. The launcher's venv,
  `~/.ray`, `/tmp/ray` and the Ray auth token never collide between hosts or outlive `down`;
- **sshd** on port 22 of its address, knowing one key (`.pdd/hosts/id_ed25519`, made here).

The hosts reach no package registry, like a datacenter host behind a strict egress policy: `up`
fills a wheel directory (`.pdd/hosts/wheels`, from this machine's registry, once) and serves it on
the bridge (http://10.197.0.1:8999/), which is what `cluster_configs/local-two-site.yaml`'s
`metadata.pdd.launch.pip_args` points pip at. sshd and rsync come from Debian's packages
(`apt-get install openssh-server rsync`, done by `up` when they are missing).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd_serve.cluster.netns import NetnsError, run_cmd
from pdd_serve.cluster.netns import exists as netns_exists
from pdd_serve.cluster.netns import pids as netns_pids
from pdd_serve.cluster.procs import terminate
from pdd_serve.launch.template import RAY_VERSION, TORCH_VERSION

REPO = Path(__file__).resolve().parents[2]
HOME_IN_HOST = "/home/pdd"  # every host's login home: the graphs' absolute paths (TLS, API keys) live under it


class HostsError(RuntimeError):
    """Making or removing the hosts failed; the message says which step and what to do."""


@dataclass(frozen=True)
class HostsConfig:
    """Where the hosts live. The defaults are what cluster_configs/local-two-site.yaml lists."""

    hosts: tuple[tuple[str, str], ...] = (("a", "10.197.0.11"), ("b", "10.197.0.12"))
    bridge: str = "pddh0"
    bridge_ip: str = "10.197.0.1"
    prefix_len: int = 24
    base_dir: Path = Path("/var/tmp/pdd-hosts")  # per-host home, /tmp, sshd files: removed by `down`
    key_path: Path = field(default_factory=lambda: REPO / ".pdd/hosts/id_ed25519")
    wheel_dir: Path = field(default_factory=lambda: REPO / ".pdd/hosts/wheels")  # kept: a cache
    wheel_port: int = 8999
    shm_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        net = ipaddress.IPv4Interface(f"{self.bridge_ip}/{self.prefix_len}").network
        names = [n for n, _ in self.hosts]
        if len(set(names)) != len(names) or not all(re.fullmatch(r"[a-z0-9]{1,6}", n) for n in names):
            raise ValueError(f"hosts: distinct short lowercase names, got {names}")
        for n, ip in self.hosts:
            if ipaddress.IPv4Address(ip) not in net or ip == self.bridge_ip:
                raise ValueError(f"hosts.{n}: {ip} is not a host address of {net} other than the bridge's")
        if not 0 < self.wheel_port < 65536:
            raise ValueError(f"wheel_port: 1..65535, got {self.wheel_port}")

    def netns(self, name: str) -> str:
        return f"pddh-{name}"

    def veth(self, name: str) -> str:
        return f"pddh-{name}0"

    def dir(self, name: str) -> Path:
        return self.base_dir / name

    @property
    def state_path(self) -> Path:
        return self.base_dir / "state.json"

    @property
    def wheel_url(self) -> str:
        return f"http://{self.bridge_ip}:{self.wheel_port}/"


# ---- the packages the hosts install ------------------------------------------------------------


def ensure_tools(log: Any = print) -> None:
    """sshd and rsync (the launcher's file mounts), installed from Debian's packages when missing."""
    if os.geteuid() != 0:
        raise HostsError("emulated hosts need root (network, PID and mount namespaces): run as root")
    missing = [t for t, p in (("sshd", "/usr/sbin/sshd"), ("rsync", "rsync"), ("ssh", "ssh"), ("openssl", "openssl"))
               if shutil.which(p) is None]
    if not missing:
        return
    log(f"installing {', '.join(missing)} (apt-get install openssh-server rsync openssh-client openssl) ...")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "openssh-server", "openssh-client", "rsync", "openssl"]):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise HostsError(f"`{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()[-400:]}")


def fill_wheels(cfg: HostsConfig, log: Any = print) -> int:
    """Download into cfg.wheel_dir what the setup commands install (pip's cache makes a re-run cheap)."""
    marker = cfg.wheel_dir / f".complete-torch{TORCH_VERSION}-ray{RAY_VERSION}"
    if marker.exists():
        return len(list(cfg.wheel_dir.glob("*.whl")))
    cfg.wheel_dir.mkdir(parents=True, exist_ok=True)
    log(f"filling {cfg.wheel_dir} with the hosts' packages (torch {TORCH_VERSION}, ray {RAY_VERSION}, PDD's "
        "dependencies) ...")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "-d", str(cfg.wheel_dir), "pip", "setuptools>=68", "wheel",
           f"torch=={TORCH_VERSION}", f"ray[default,serve]=={RAY_VERSION}", str(REPO)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        errs = [ln for ln in (r.stderr or r.stdout).splitlines() if "ignored: it is neither" not in ln]
        raise HostsError("pip download for the hosts failed:\n" + "\n".join(errs[-12:]))
    for p in cfg.wheel_dir.glob("pdd_serve-*"):  # the hosts install the project from its rsynced checkout
        p.unlink()
    marker.touch()
    return len(list(cfg.wheel_dir.glob("*.whl")))


# ---- making and removing hosts -----------------------------------------------------------------


def _load_state(cfg: HostsConfig) -> dict[str, Any]:
    try:
        return json.loads(cfg.state_path.read_text())
    except (OSError, ValueError):
        return {}


def _save_state(cfg: HostsConfig, state: dict[str, Any]) -> None:
    cfg.base_dir.mkdir(parents=True, exist_ok=True)
    cfg.state_path.write_text(json.dumps(state, indent=1))


def _link_exists(name: str) -> bool:
    return run_cmd(["ip", "link", "show", "dev", name], check=False).returncode == 0


def _sshd_config(cfg: HostsConfig, name: str, ip: str) -> str:
    d = cfg.dir(name)
    return "\n".join([
        f"ListenAddress {ip}", f"HostKey {d}/etc/ssh_host_ed25519_key", "PidFile none",
        "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "UsePAM no", "AuthorizedKeysFile .ssh/authorized_keys", "Subsystem sftp internal-sftp",
        "MaxStartups 64", "MaxSessions 64", "ClientAliveInterval 15", ""])


def _host_files(cfg: HostsConfig, name: str, ip: str) -> None:
    d = cfg.dir(name)
    for sub, mode in (("home", 0o700), ("home/.ssh", 0o700), ("tmp", 0o1777), ("etc", 0o755)):
        (d / sub).mkdir(parents=True, exist_ok=True)
        (d / sub).chmod(mode)
    if not (d / "etc/ssh_host_ed25519_key").exists():
        run_cmd(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "etc/ssh_host_ed25519_key")])
    # root's home is /home/pdd on this host only: /etc/passwd is bind-mounted over in its mount namespace
    passwd = re.sub(r"^(root:[^:]*:0:0:[^:]*:)[^:]*:", rf"\g<1>{HOME_IN_HOST}:", Path("/etc/passwd").read_text(),
                    count=1, flags=re.M)
    (d / "etc/passwd").write_text(passwd)
    (d / "etc/sshd_config").write_text(_sshd_config(cfg, name, ip))
    shutil.copy(str(cfg.key_path) + ".pub", d / "home/.ssh/authorized_keys")
    (d / "home/.ssh/authorized_keys").chmod(0o600)


def _start_sshd(cfg: HostsConfig, name: str) -> int:
    d = cfg.dir(name)
    inner = " && ".join([
        f"mount --bind {d}/etc/passwd /etc/passwd", f"mount --bind {d}/home {HOME_IN_HOST}",
        f"mount --bind {d}/tmp /tmp", f"mount -t tmpfs -o size={cfg.shm_bytes} tmpfs /dev/shm",
        f"exec /usr/sbin/sshd -D -e -f {d}/etc/sshd_config"])
    log = open(d / "sshd.log", "ab")  # noqa: SIM115 - the child keeps it
    p = subprocess.Popen(["ip", "netns", "exec", cfg.netns(name), "unshare", "--pid", "--fork", "--mount-proc",
                          "--propagation", "private", "sh", "-c", inner],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    log.close()
    return p.pid


def _wait_port(ip: str, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((ip, port), timeout=1.0):
            return True
        time.sleep(0.1)
    return False


def up(cfg: HostsConfig = HostsConfig(), log: Any = print) -> dict[str, Any]:
    """Make the hosts (idempotent: a half-made set from an earlier run is removed first)."""
    ensure_tools(log)
    if _load_state(cfg) or netns_exists(cfg.netns(cfg.hosts[0][0])) or _link_exists(cfg.bridge):
        down(cfg, log=lambda _m: None)
    cfg.key_path.parent.mkdir(parents=True, exist_ok=True)
    if not cfg.key_path.exists():
        run_cmd(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "pdd-hosts", "-f", str(cfg.key_path)])
    n_wheels = fill_wheels(cfg, log)
    Path(HOME_IN_HOST).mkdir(parents=True, exist_ok=True)  # the mount point
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation directory
    state: dict[str, Any] = {"hosts": {}, "made_home": True}
    _save_state(cfg, state)
    try:
        run_cmd(["ip", "link", "add", cfg.bridge, "type", "bridge"])
        run_cmd(["ip", "addr", "add", f"{cfg.bridge_ip}/{cfg.prefix_len}", "dev", cfg.bridge])
        run_cmd(["ip", "link", "set", cfg.bridge, "up"])
        for name, ip in cfg.hosts:
            ns, veth = cfg.netns(name), cfg.veth(name)
            run_cmd(["ip", "netns", "add", ns])
            run_cmd(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            run_cmd(["ip", "link", "set", veth, "master", cfg.bridge, "up"])
            run_cmd(["ip", "-n", ns, "addr", "add", f"{ip}/{cfg.prefix_len}", "dev", "eth0"])
            run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
            run_cmd(["ip", "-n", ns, "link", "set", "eth0", "up"])
            # a default route, so "my address" probes (Ray's, Flight's advertise host) find eth0's;
            # this machine does not forward, so nothing leaves through it
            run_cmd(["ip", "-n", ns, "route", "add", "default", "via", cfg.bridge_ip])
            _host_files(cfg, name, ip)
            state["hosts"][name] = {"ip": ip, "netns": ns, "sshd_pid": _start_sshd(cfg, name)}
            _save_state(cfg, state)
        wheels = subprocess.Popen([sys.executable, "-m", "http.server", str(cfg.wheel_port), "--bind", cfg.bridge_ip,
                                   "--directory", str(cfg.wheel_dir)], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        state["wheel_server_pid"] = wheels.pid
        _save_state(cfg, state)
        for name, ip in cfg.hosts:
            if not _wait_port(ip, 22, 15.0):
                tail = (cfg.dir(name) / "sshd.log").read_text(errors="replace")[-400:]
                raise HostsError(f"host {name} ({ip}): sshd did not listen within 15s: {tail}")
        if not _wait_port(cfg.bridge_ip, cfg.wheel_port, 15.0):
            raise HostsError(f"the wheel server on {cfg.wheel_url} did not start")
    except (NetnsError, OSError, HostsError) as e:
        down(cfg, log=lambda _m: None)
        raise HostsError(f"making the hosts failed: {e}") from None
    log(f"hosts up: {', '.join(f'{n} {ip}' for n, ip in cfg.hosts)} (ssh -i {cfg.key_path} root@ADDRESS); "
        f"{n_wheels} wheels at {cfg.wheel_url}")
    return state


def _ours(pid: int, marks: tuple[str, ...]) -> bool:
    """Whether `pid` is still the process `up` started (its command line names the host's files or
    the wheel server): a state file that outlived a reboot must not make root kill a stranger."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return any(m in cmd for m in marks)


def _kill(pid: int, grace_s: float = 3.0) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def down(cfg: HostsConfig = HostsConfig(), log: Any = print) -> dict[str, Any]:
    """Remove everything `up` made except the key and the wheel cache; idempotent. Returns what is
    left (empty lists when the machine is as before `up`)."""
    state = _load_state(cfg)
    pid = state.get("wheel_server_pid")
    if pid and _ours(int(pid), (f"--bind {cfg.bridge_ip}",)):
        _kill(int(pid))
    for name, _ip in cfg.hosts:
        ns = cfg.netns(name)
        pid = (state.get("hosts") or {}).get(name, {}).get("sshd_pid")
        if pid and _ours(int(pid), (str(cfg.dir(name)), ns)):  # its init goes, and every process under it
            _kill(int(pid), grace_s=3.0)
        if netns_exists(ns):
            _kill_netns(ns)
            run_cmd(["ip", "netns", "del", ns], check=False)
        if _link_exists(cfg.veth(name)):
            run_cmd(["ip", "link", "del", cfg.veth(name)], check=False)
    if _link_exists(cfg.bridge):
        run_cmd(["ip", "link", "del", cfg.bridge], check=False)
    shutil.rmtree(cfg.base_dir, ignore_errors=True)
    if state.get("made_home"):
        with contextlib.suppress(OSError):
            Path(HOME_IN_HOST).rmdir()  # only if empty: the mount point we made
    left = leftovers(cfg)
    log("hosts down" + ("" if not any(left.values()) else f"; left behind: {left}"))
    return left


def _kill_netns(ns: str, grace_s: float = 3.0) -> None:
    """Every process still in the host's network namespace (one that escaped its PID namespace)."""
    terminate(lambda: [p for p in netns_pids(ns) if p != os.getpid()], grace_s)


def leftovers(cfg: HostsConfig = HostsConfig()) -> dict[str, list[str]]:
    """What of the hosts still exists: namespaces, links, processes, files."""
    procs = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if str(cfg.base_dir) in cmd or f"--bind {cfg.bridge_ip}" in cmd:
                    procs.append(f"{p.name} {cmd[:120]}")
    return {
        "netns": [cfg.netns(n) for n, _ in cfg.hosts if netns_exists(cfg.netns(n))],
        "links": [x for x in [cfg.bridge, *(cfg.veth(n) for n, _ in cfg.hosts)] if _link_exists(x)],
        "processes": procs,
        "files": [str(p) for p in (cfg.base_dir,) if p.exists()],
    }


def status(cfg: HostsConfig = HostsConfig()) -> dict[str, Any]:
    state = _load_state(cfg)
    out = {}
    for name, ip in cfg.hosts:
        ns = cfg.netns(name)
        out[name] = {"ip": ip, "netns": netns_exists(ns), "processes": len(netns_pids(ns)),
                     "ssh_port_open": _wait_port(ip, 22, 0.5) if netns_exists(ns) else False}
    return {"hosts": out, "wheel_server": bool(state.get("wheel_server_pid")) and _wait_port(cfg.bridge_ip,
                                                                                             cfg.wheel_port, 0.5)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluations.launch.hosts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["up", "down", "status"])
    args = p.parse_args(argv)
    cfg = HostsConfig()
    try:
        if args.action == "up":
            up(cfg)
        elif args.action == "down":
            left = down(cfg)
            return 1 if any(left.values()) else 0
        else:
            print(json.dumps(status(cfg), indent=1))
    except HostsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
