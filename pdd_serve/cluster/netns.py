"""Site B behind a real, kernel-shaped link: a network namespace, a veth pair and qdiscs.

`pdd cluster up --shaped-link RATE[,DELAY,JITTER,LOSS]` puts site B's raylet in its own network
namespace. The only way out of it is a veth pair (`host_if` in the root namespace, `ns_if` inside),
so every byte between the sites -- Ray's GCS/raylet/object-manager/worker traffic and the KV Flight
stream -- crosses a real link with real TCP behaviour (slow start, queueing, loss recovery).

Shaping is done by the kernel on the egress of *both* veth ends, so both directions see the link:

  with netem:     root 1: netem delay DELAY JITTER loss LOSS  ->  child 10: tbf rate RATE
  without netem:  root 1: tbf rate RATE            (htb when tbf is missing)

DELAY is one-way (per direction, like `LinkModel.one_way_latency_s`), so the RTT is 2 x DELAY.
netem is a kernel module some kernels lack; it is detected on the veth itself. Where it is missing
only the rate is kernel-shaped and delay/jitter must come from the application-level LinkModel
(the graph's `args.link`); `describe` says which part is which.

Every function here is idempotent and needs root (CAP_NET_ADMIN) plus the `ip` and `tc` tools;
`support()` says why not, without touching anything.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdd_serve.cluster.procs import terminate

NETNS_DIR = Path("/run/netns")  # where `ip netns add` pins named namespaces
IFNAMSIZ = 15  # max interface name length (IFNAMSIZ - 1)
CMD_TIMEOUT_S = 15.0
# Link addresses of the per-port /30s: 10.192.0.0/14 holds one /30 for every TCP port number, so
# clusters on different GCS ports never collide (and `create` refuses an address already in use).
DEFAULT_POOL = ipaddress.IPv4Network("10.192.0.0/14")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")

_RATE_UNITS = {"": 1.0, "bit": 1.0, "bps": 1.0, "k": 1e3, "kbit": 1e3, "kbps": 1e3, "m": 1e6, "mbit": 1e6,
               "mbps": 1e6, "g": 1e9, "gbit": 1e9, "gbps": 1e9}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


class NetnsError(RuntimeError):
    """A namespace / veth / qdisc operation failed; the message says which command and why."""


# ---- the link's parameters --------------------------------------------------------------------


@dataclass(frozen=True)
class ShapedLink:
    """What the kernel should do to the inter-site link, per direction."""

    rate_bps: float  # bits/s on the wire (L2, headers included)
    delay_s: float = 0.0  # one-way
    jitter_s: float = 0.0
    loss: float = 0.0  # fraction of packets, per direction

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_bps) and self.rate_bps >= 8_000):
            raise ValueError(f"shaped link rate must be >= 8kbit and finite, got {self.rate_bps!r} bit/s")
        for name in ("delay_s", "jitter_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0 <= v <= 10):
                raise ValueError(f"shaped link {name[:-2]} must be in [0, 10] s, got {v!r}")
        if self.jitter_s > 0 and self.delay_s == 0:
            raise ValueError("shaped link jitter needs a delay (jitter varies the delay)")
        if not 0 <= self.loss < 1:
            raise ValueError(f"shaped link loss must be a fraction in [0, 1), got {self.loss!r}")

    @classmethod
    def parse(cls, spec: str) -> ShapedLink:
        """`RATE[,DELAY[,JITTER[,LOSS]]]`, e.g. `40mbit`, `1gbit,25ms`, `100mbit,50ms,5ms,0.1%`.

        RATE: a number with bit|kbit|mbit|gbit (or k/m/g, kbps/mbps/gbps; bare = bit/s).
        DELAY/JITTER: a number with s|ms|us (a bare number only for 0). LOSS: `0.1%` or a fraction.
        """
        parts = [p.strip() for p in str(spec).split(",")]
        if not 1 <= len(parts) <= 4 or not parts[0]:
            raise ValueError(f"--shaped-link wants RATE[,DELAY,JITTER,LOSS], got {spec!r}")
        parts += [""] * (4 - len(parts))
        return cls(rate_bps=_parse_rate(parts[0]), delay_s=_parse_time(parts[1], "delay"),
                   jitter_s=_parse_time(parts[2], "jitter"), loss=_parse_loss(parts[3]))

    @property
    def spec(self) -> str:
        """The canonical spec string (round-trips through `parse`)."""
        out = [f"{self.rate_bps / 1e6:g}mbit"]
        if self.delay_s or self.jitter_s or self.loss:
            out += [f"{self.delay_s * 1e3:g}ms", f"{self.jitter_s * 1e3:g}ms", f"{self.loss * 100:g}%"]
        return ",".join(out)

    @property
    def wants_netem(self) -> bool:
        return self.delay_s > 0 or self.jitter_s > 0 or self.loss > 0


def _parse_rate(s: str) -> float:
    m = re.fullmatch(_NUM + r"\s*([a-zA-Z]*)(?:/s)?", s)
    if not m or m.group(2).lower() not in _RATE_UNITS:
        raise ValueError(f"bad rate {s!r}: say e.g. 40mbit, 1gbit, 500kbit")
    return float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]


def _parse_time(s: str, what: str) -> float:
    if not s:
        return 0.0
    m = re.fullmatch(_NUM + r"\s*([a-zA-Z]*)", s)
    if not m:
        raise ValueError(f"bad {what} {s!r}: say e.g. 50ms, 0.05s")
    v, unit = float(m.group(1)), m.group(2).lower()
    if unit == "" and v == 0:
        return 0.0
    if unit not in _TIME_UNITS:  # a bare number is ambiguous (tc reads it as usec): refuse it
        raise ValueError(f"bad {what} {s!r}: give a unit (s, ms or us), e.g. 50ms")
    return v * _TIME_UNITS[unit]


def _parse_loss(s: str) -> float:
    if not s:
        return 0.0
    m = re.fullmatch(_NUM + r"\s*(%?)", s)
    if not m:
        raise ValueError(f"bad loss {s!r}: say e.g. 0.1% or 0.001")
    return float(m.group(1)) / (100.0 if m.group(2) else 1.0)


# ---- the namespace and its veth pair ----------------------------------------------------------


@dataclass(frozen=True)
class VethNamespace:
    """A named network namespace joined to the root namespace by one veth pair on a /30."""

    name: str  # `ip netns` name
    host_if: str  # veth end in the root namespace
    ns_if: str  # veth end inside the namespace
    host_ip: str
    ns_ip: str
    prefix_len: int = 30

    def __post_init__(self) -> None:
        for field_name in ("name", "host_if", "ns_if"):
            v = getattr(self, field_name)
            if not isinstance(v, str) or not _NAME_RE.match(v):
                raise ValueError(f"{field_name} must be letters, digits, '_', '.', '-', got {v!r}")
        for field_name in ("host_if", "ns_if"):
            if len(getattr(self, field_name)) > IFNAMSIZ:
                raise ValueError(f"{field_name} {getattr(self, field_name)!r} is longer than {IFNAMSIZ} chars")
        if self.host_if == self.ns_if:
            raise ValueError("host_if and ns_if must differ")
        try:
            net = ipaddress.IPv4Interface(f"{self.host_ip}/{self.prefix_len}").network
            peer = ipaddress.IPv4Address(self.ns_ip)
        except ValueError as e:
            raise ValueError(f"bad veth addresses: {e}") from None
        if peer not in net or self.host_ip == self.ns_ip or peer in (net.network_address, net.broadcast_address):
            raise ValueError(f"host_ip {self.host_ip} and ns_ip {self.ns_ip} must be two hosts of one "
                             f"/{self.prefix_len}")

    @classmethod
    def for_port(cls, port: int, stem: str = "pdd") -> VethNamespace:
        """The namespace of the local cluster whose GCS listens on `port`: names and a /30 derived
        from the port, so two clusters on one machine never share a namespace or a subnet."""
        if not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        base = int(DEFAULT_POOL.network_address) + 4 * port
        return cls(name=f"{stem}-b-{port}", host_if=f"{stem}{port}a", ns_if=f"{stem}{port}b",
                   host_ip=str(ipaddress.IPv4Address(base + 1)), ns_ip=str(ipaddress.IPv4Address(base + 2)))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "host_if": self.host_if, "ns_if": self.ns_if, "host_ip": self.host_ip,
                "ns_ip": self.ns_ip, "prefix_len": self.prefix_len}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VethNamespace:
        return cls(**{k: d[k] for k in ("name", "host_if", "ns_if", "host_ip", "ns_ip", "prefix_len")})

    @property
    def exec_prefix(self) -> list[str]:
        """Prefix a command with this to run it inside the namespace."""
        return ["ip", "netns", "exec", self.name]


@dataclass(frozen=True)
class KernelShaping:
    """What the kernel actually does to the link (the answer to "which parts are kernel-shaped")."""

    rate_qdisc: str | None  # "tbf" | "htb" | None (no rate shaping asked)
    netem: bool  # delay/jitter/loss applied by netem
    netem_available: bool | None  # None: not probed (nothing asked netem)

    def to_dict(self) -> dict[str, Any]:
        return {"rate_qdisc": self.rate_qdisc, "netem": self.netem, "netem_available": self.netem_available}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KernelShaping:
        return cls(d.get("rate_qdisc"), bool(d.get("netem")), d.get("netem_available"))


def describe(link: ShapedLink, applied: KernelShaping) -> list[str]:
    """Human lines: each parameter of `link` and whether the kernel shapes it."""
    out = []
    if applied.rate_qdisc:
        out.append(f"rate {link.rate_bps / 1e6:g} Mbit/s per direction: kernel-shaped ({applied.rate_qdisc} "
                   "on both veth ends; on-wire rate, so TCP goodput is ~5% lower)")
    else:
        out.append(f"rate {link.rate_bps / 1e6:g} Mbit/s: NOT shaped")
    no_netem = "NOT kernel-shaped (this kernel has no netem qdisc)"
    if link.delay_s or link.jitter_s:
        if applied.netem:
            out.append(f"delay {link.delay_s * 1e3:g} ms one-way (RTT {2 * link.delay_s * 1e3:g} ms), jitter "
                       f"{link.jitter_s * 1e3:g} ms: kernel-shaped (netem, both directions)")
        else:
            out.append(f"delay {link.delay_s * 1e3:g} ms one-way, jitter {link.jitter_s * 1e3:g} ms: {no_netem}; "
                       f"they come from the application-level LinkModel: set the graph's "
                       f"args.link.one_way_latency_s: {link.delay_s:g} (and its jitter/sigma)")
    else:
        out.append("delay/jitter: none asked (the veth itself adds well under 1 ms); any LinkModel latency in the "
                   "graph's args.link is added by the application")
    if link.loss:
        out.append(f"loss {link.loss * 100:g}%: " + ("kernel-shaped (netem)" if applied.netem
                                                      else f"{no_netem}; the LinkModel has no loss model, so "
                                                           "there is NO loss on this link"))
    return out


# ---- commands ---------------------------------------------------------------------------------


def support() -> str | None:
    """Why namespaces + veth can't be used here, or None if they probably can (nothing is touched)."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "this OS has no Linux network namespaces"
    if os.geteuid() != 0:
        return "network namespaces and veth pairs need root (CAP_NET_ADMIN); run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` tool is missing (apt-get install -y iproute2)"
    return None


def run_cmd(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {e}") from None
    if check and r.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()}")
    return r


def exists(ns: VethNamespace | str) -> bool:
    """Whether the named namespace exists (a file check: no command is run)."""
    name = ns.name if isinstance(ns, VethNamespace) else ns
    return (NETNS_DIR / name).exists()


def _link_exists(ifname: str, netns: str | None = None) -> bool:
    cmd = ["ip", *(["-n", netns] if netns else []), "link", "show", "dev", ifname]
    return run_cmd(cmd, check=False).returncode == 0


def _addr_owner(ip: str) -> str | None:
    """The interface in the root namespace that holds `ip`, if any."""
    for line in run_cmd(["ip", "-o", "-4", "addr", "show"]).stdout.splitlines():
        f = line.split()
        if len(f) >= 4 and f[3].split("/")[0] == ip:
            return f[1]
    return None


def create(ns: VethNamespace, link: ShapedLink | None = None) -> KernelShaping:
    """Make the namespace, the veth pair, addresses, routes and qdiscs; idempotent.

    A half-made namespace from an earlier run is completed, not duplicated. On failure what this
    call created is removed again and NetnsError says which command failed.
    """
    why = support()
    if why:
        raise NetnsError(why)
    owner = _addr_owner(ns.host_ip)
    if owner not in (None, ns.host_if):
        raise NetnsError(f"{ns.host_ip} is already used by interface {owner}; pick another cluster port")
    made_ns = not exists(ns)
    try:
        if made_ns:
            run_cmd(["ip", "netns", "add", ns.name])
        if not _link_exists(ns.host_if):
            if _link_exists(ns.ns_if, ns.name):  # the host end died alone: start the pair over
                run_cmd(["ip", "-n", ns.name, "link", "del", ns.ns_if])
            run_cmd(["ip", "link", "add", ns.host_if, "type", "veth", "peer", "name", ns.ns_if, "netns", ns.name])
        cidr = f"/{ns.prefix_len}"
        run_cmd(["ip", "addr", "replace", ns.host_ip + cidr, "dev", ns.host_if])
        run_cmd(["ip", "link", "set", ns.host_if, "up"])
        run_cmd(["ip", "-n", ns.name, "addr", "replace", ns.ns_ip + cidr, "dev", ns.ns_if])
        run_cmd(["ip", "-n", ns.name, "link", "set", "lo", "up"])
        run_cmd(["ip", "-n", ns.name, "link", "set", ns.ns_if, "up"])
        # a default route out through the host end: then "the address others reach me on" (the
        # Flight server's advertise host, Ray's node IP probe) resolves to ns_ip inside
        run_cmd(["ip", "-n", ns.name, "route", "replace", "default", "via", ns.host_ip])
        return shape(ns, link)
    except BaseException:
        if made_ns:
            with contextlib.suppress(NetnsError):
                destroy(ns)
        raise


def _clear_root(dev: str, netns: str | None) -> None:
    cmd = ["tc", *(["-n", netns] if netns else []), "qdisc", "del", "dev", dev, "root"]
    run_cmd(cmd, check=False)  # "no such qdisc" is fine: there was none


def _qdisc_unknown(e: NetnsError) -> bool:
    return "unknown" in str(e).lower() or "no such file" in str(e).lower()


def _tbf_args(link: ShapedLink) -> list[str]:
    bytes_per_s = link.rate_bps / 8
    # burst: >= 4 ms of traffic and a few MTUs, so tbf neither starves nor releases a visible spike;
    # queue: a bandwidth-delay product (at least 50 ms) so TCP can fill the pipe without tail drops
    burst = max(32 * 1024, int(bytes_per_s * 0.004))
    limit = burst + int(bytes_per_s * max(0.05, 2.5 * (link.delay_s + link.jitter_s)))
    return ["tbf", "rate", f"{int(link.rate_bps)}bit", "burst", str(burst), "limit", str(limit)]


def _shape_dev(dev: str, netns: str | None, link: ShapedLink, netem: bool) -> str:
    """Apply the qdiscs to one veth end; returns the rate qdisc used."""
    tc = ["tc", *(["-n", netns] if netns else [])]
    parent = ["root", "handle", "1:"]
    if netem:
        em = ["netem", "limit", "100000"]
        if link.delay_s or link.jitter_s:
            em += ["delay", f"{link.delay_s * 1e6:.0f}us"]
            if link.jitter_s:
                em += [f"{link.jitter_s * 1e6:.0f}us"]
        if link.loss:
            em += ["loss", f"{link.loss * 100:g}%"]
        run_cmd([*tc, "qdisc", "add", "dev", dev, *parent, *em])
        parent = ["parent", "1:1", "handle", "10:"]
    try:
        run_cmd([*tc, "qdisc", "add", "dev", dev, *parent, *_tbf_args(link)])
        return "tbf"
    except NetnsError as e:
        if not _qdisc_unknown(e) or netem:
            raise
    # no tbf in this kernel: an htb class with rate = ceil does the same job
    burst = _tbf_args(link)[4]
    run_cmd([*tc, "qdisc", "add", "dev", dev, *parent, "htb", "default", "10"])
    run_cmd([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate",
          f"{int(link.rate_bps)}bit", "ceil", f"{int(link.rate_bps)}bit", "burst", burst, "cburst", burst])
    return "htb"


def netem_available(ns: VethNamespace) -> bool:
    """Whether the kernel has netem, probed on the namespace's host veth end (left unshaped)."""
    _clear_root(ns.host_if, None)
    r = run_cmd(["tc", "qdisc", "add", "dev", ns.host_if, "root", "handle", "1:", "netem", "delay", "0us"], check=False)
    _clear_root(ns.host_if, None)
    return r.returncode == 0


def shape(ns: VethNamespace, link: ShapedLink | None) -> KernelShaping:
    """(Re)apply `link` to both veth ends; None removes the shaping. Idempotent."""
    for dev, where in ((ns.host_if, None), (ns.ns_if, ns.name)):
        _clear_root(dev, where)
    if link is None:
        return KernelShaping(None, False, None)
    netem = netem_available(ns) if link.wants_netem else None
    rate = ""
    for dev, where in ((ns.host_if, None), (ns.ns_if, ns.name)):
        rate = _shape_dev(dev, where, link, netem=bool(netem))
    return KernelShaping(rate, bool(netem), netem)


def pids(ns: VethNamespace | str) -> list[int]:
    """Processes whose network namespace is this one."""
    name = ns.name if isinstance(ns, VethNamespace) else ns
    if not exists(name):
        return []
    r = run_cmd(["ip", "netns", "pids", name], check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def destroy(ns: VethNamespace, kill: bool = True, grace_s: float = 3.0) -> list[int]:
    """Remove the namespace and the veth pair; idempotent. Returns the pids it had to signal.

    With `kill`, processes still inside the namespace (ours: nothing else runs there) get SIGTERM,
    then SIGKILL after grace_s -- a namespace with live processes outlives its name, and so would
    the veth pair.
    """
    victims: list[int] = []
    if exists(ns) and kill:
        victims = [p for p in pids(ns) if p != os.getpid()]
        terminate(lambda: [p for p in victims if Path(f"/proc/{p}").exists() and not _zombie(p)], grace_s)
    if exists(ns):
        run_cmd(["ip", "netns", "del", ns.name])
    if _link_exists(ns.host_if):  # normally gone with its peer; not if the namespace lingers
        run_cmd(["ip", "link", "del", ns.host_if], check=False)
    return victims


def _zombie(pid: int) -> bool:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return data[data.rindex(")") + 2:].startswith("Z")


__all__ = ["KernelShaping", "NetnsError", "ShapedLink", "VethNamespace", "create", "describe", "destroy", "exists",
           "netem_available", "pids", "shape", "support"]
