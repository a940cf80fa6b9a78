"""A real, kernel-shaped link on one machine: a network namespace behind a veth pair with tbf (and
netem where the kernel has it). KV crosses it over Arrow Flight with real TCP, and the measured
throughput / RTT match what was configured. Skips, with the reason, where namespaces can't be made."""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdd_serve.cluster import cli as cluster_cli
from pdd_serve.cluster import local as C
from pdd_serve.cluster import netns
from pdd_serve.cluster.netns import NetnsError, ShapedLink, VethNamespace
from pdd_serve.engine.kv import KVLayout
from pdd_serve.transport.flight import KVFlightClient
from tests.helpers import make_blocks

RATE_BPS = 40e6
LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16)  # 128 KiB blocks
TOKEN = "shaped-link-test"
BLOCKS = 80  # 10 MiB: ~2.2 s at 40 Mbit/s
ROOT = Path(__file__).resolve().parents[2]

# The MD side: a KVFlightServer inside the namespace, bound to the namespace's veth address.
SERVER = r"""
import json, sys
from pdd_serve.engine.kv import KVLayout
from pdd_serve.transport.flight import KVFlightServer
token, host, n, rids = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
with KVFlightServer(host, 0, layout=KVLayout(4, 4, 64, 16), token=token, max_bytes_per_request=1 << 30,
                    max_bytes_total=1 << 31) as srv:
    for rid in rids:
        srv.expect(rid, n)
    print(json.dumps({"location": srv.location, "port": srv.port}), flush=True)
    for rid in rids:
        got = srv.wait_complete_sync(rid, 45)
        print(json.dumps({"rid": rid, "bytes": got.bytes_received, "seconds": got.seconds}), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture
def veth() -> Iterator[VethNamespace]:
    why = netns.support()
    if why:
        pytest.skip(f"no network namespaces here: {why}")
    # a port number the OS just handed out names the namespace and its /30: no clash with a
    # local cluster (those use their GCS port) or a parallel test run
    ns = VethNamespace.for_port(_free_port(), stem="pdt")
    try:
        netns.create(ns, None)
    except NetnsError as e:
        netns.destroy(ns)
        pytest.skip(f"`ip netns` / veth not permitted here: {e}")
    try:
        yield ns
    finally:
        netns.destroy(ns)
        assert not netns.exists(ns)


class NsServer:
    """The Flight server subprocess in the namespace; reads its JSON lines without blocking forever."""

    def __init__(self, ns: VethNamespace, rids: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([*ns.exec_prefix, sys.executable, "-c", SERVER, TOKEN, ns.ns_ip, str(BLOCKS), *rids],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     stdin=subprocess.DEVNULL)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def read(self, timeout: float = 30.0) -> dict:
        try:
            return json.loads(self.lines.get(timeout=timeout))
        except queue.Empty:
            self.close()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"the Flight server in the namespace said nothing in {timeout}s:\n{err[-2000:]}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _push(location: str, rid: str) -> float:
    """Push BLOCKS blocks from the root namespace; returns the measured goodput in bits/s."""
    kv = make_blocks(LAYOUT, BLOCKS, seed=1)
    client = KVFlightClient(location, TOKEN, layout=LAYOUT, batch_blocks=4, window_batches=16, deadline_s=40)
    t0 = time.monotonic()
    res = client.push(rid, [kv])
    dt = time.monotonic() - t0
    assert res.blocks_sent == BLOCKS and res.resumes == 0
    return kv.nbytes * 8 / dt


@pytest.mark.timeout(60)
def test_flight_throughput_across_the_veth_matches_the_kernel_rate(veth: VethNamespace) -> None:
    link = ShapedLink(RATE_BPS)
    kernel = netns.shape(veth, link)
    assert kernel.rate_qdisc in ("tbf", "htb")
    srv = NsServer(veth, ["warm", "shaped", "free"])
    try:
        where = srv.read()
        assert where["location"] == f"grpc://{veth.ns_ip}:{where['port']}"  # the namespace's address
        _push(where["location"], "warm")  # first connection, imports, allocator: not the link
        srv.read()
        shaped = _push(where["location"], "shaped")
        got = srv.read()
        assert got["rid"] == "shaped" and got["bytes"] == BLOCKS * LAYOUT.block_bytes
        netns.shape(veth, None)  # the same veth, unshaped: the rate above was the kernel's doing
        free = _push(where["location"], "free")
        srv.read()
    finally:
        srv.close()
    print(f"\nFlight over the veth: {shaped / 1e6:.1f} Mbit/s goodput with {kernel.rate_qdisc} at "
          f"{RATE_BPS / 1e6:g} Mbit/s ({shaped / RATE_BPS:.0%}); unshaped {free / 1e6:.0f} Mbit/s")
    # tbf counts on-wire bytes (Ethernet/IP/TCP headers): goodput sits ~5% under the configured rate
    assert 0.8 * RATE_BPS <= shaped <= 1.2 * RATE_BPS
    assert free > 2 * RATE_BPS


@pytest.mark.timeout(60)
def test_rtt_across_the_veth_matches_the_configured_delay(veth: VethNamespace) -> None:
    delay = 0.025  # one-way, each direction: RTT 50 ms
    if not netns.netem_available(veth):
        pytest.skip("this kernel has no netem qdisc (`tc qdisc add ... netem` -> unknown qdisc): delay/jitter "
                    "can't be kernel-shaped here; the application-level LinkModel supplies them")
    kernel = netns.shape(veth, ShapedLink(RATE_BPS, delay_s=delay))
    assert kernel.netem
    srv = NsServer(veth, [])
    try:
        port = srv.read()["port"]
        rtts = []
        for _ in range(8):  # a TCP connect is one round trip (SYN -> SYN-ACK)
            t0 = time.monotonic()
            with socket.create_connection((veth.ns_ip, port), timeout=5):
                rtts.append(time.monotonic() - t0)
    finally:
        srv.close()
    rtt = statistics.median(rtts)
    print(f"\nRTT over the veth: {rtt * 1e3:.1f} ms (configured {2 * delay * 1e3:g} ms)")
    assert abs(rtt - 2 * delay) <= 0.2 * 2 * delay


def test_create_is_idempotent_and_destroy_cleans_up(veth: VethNamespace) -> None:
    link = ShapedLink.parse("40mbit")
    a, b = netns.create(veth, link), netns.create(veth, link)
    assert a == b and a.rate_qdisc == "tbf"
    qd = subprocess.run(["tc", "qdisc", "show", "dev", veth.host_if], capture_output=True, text=True).stdout
    assert "rate 40Mbit" in qd and qd.count("qdisc tbf") == 1
    qd = subprocess.run(["tc", "-n", veth.name, "qdisc", "show", "dev", veth.ns_if], capture_output=True, text=True).stdout
    assert "rate 40Mbit" in qd  # both directions
    netns.destroy(veth)
    netns.destroy(veth)  # idempotent
    assert not netns.exists(veth)
    assert subprocess.run(["ip", "link", "show", "dev", veth.host_if], capture_output=True).returncode != 0


# ---- the spec and the message -------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "want"), [
    ("40mbit", ShapedLink(40e6)),
    ("1gbit,25ms", ShapedLink(1e9, 0.025)),
    ("100Mbit/s,50ms,5ms,0.1%", ShapedLink(100e6, 0.05, 0.005, 0.001)),
    ("5e6,0.05s,0,0.01", ShapedLink(5e6, 0.05, 0.0, 0.01)),
    ("500kbit, 200us", ShapedLink(500e3, 200e-6)),
])
def test_parse(spec: str, want: ShapedLink) -> None:
    def fields(link: ShapedLink) -> tuple[float, ...]:
        return (link.rate_bps, link.delay_s, link.jitter_s, link.loss)

    got = ShapedLink.parse(spec)
    assert fields(got) == pytest.approx(fields(want))
    assert fields(ShapedLink.parse(got.spec)) == pytest.approx(fields(got))


@pytest.mark.parametrize(("spec", "match"), [
    ("", "RATE"), ("fast", "bad rate"), ("40mbit,50", "give a unit"), ("40mbit,50ms,5ms,1.5", "loss"),
    ("40mbit,0,5ms", "jitter needs a delay"), ("10bit", ">= 8kbit"), ("40mbit,1,2,3,4", "RATE"),
])
def test_parse_rejects(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ShapedLink.parse(spec)


def test_describe_says_what_is_kernel_shaped() -> None:
    link = ShapedLink.parse("40mbit,50ms,5ms,0.1%")
    no_netem = netns.describe(link, netns.KernelShaping("tbf", False, False))
    assert no_netem[0].startswith("rate 40 Mbit/s per direction: kernel-shaped (tbf")
    assert "delay 50 ms one-way, jitter 5 ms: NOT kernel-shaped (this kernel has no netem qdisc)" in no_netem[1]
    assert "args.link.one_way_latency_s: 0.05" in no_netem[1]
    assert no_netem[2].startswith("loss 0.1%: NOT kernel-shaped") and "NO loss" in no_netem[2]
    with_netem = netns.describe(link, netns.KernelShaping("tbf", True, True))
    assert "kernel-shaped (netem, both directions)" in with_netem[1] and "RTT 100 ms" in with_netem[1]


def test_veth_names_and_addresses() -> None:
    v = VethNamespace.for_port(6390)
    assert (v.name, v.host_if, v.ns_if) == ("pdd-b-6390", "pdd6390a", "pdd6390b")
    assert (v.host_ip, v.ns_ip) == ("10.192.99.217", "10.192.99.218")
    assert VethNamespace.for_port(65535).ns_ip == "10.195.255.254"
    with pytest.raises(ValueError, match="longer than 15"):
        VethNamespace("n", "a" * 16, "b", "10.0.0.1", "10.0.0.2")
    with pytest.raises(ValueError, match="two hosts of one /30"):
        VethNamespace("n", "a", "b", "10.0.0.1", "10.0.0.5")


# ---- `pdd cluster up --shaped-link` -----------------------------------------------------------


def test_config_defaults_unchanged_and_shaped_link_moves_site_a(tmp_path: Path) -> None:
    plain = C.LocalClusterConfig(port=7011, state_dir=tmp_path)
    assert plain.shaped_link is None and plain.veth is None and plain.node_ip == "127.0.0.1"
    assert "shaped_link" not in plain.identity()
    cfg = C.LocalClusterConfig(port=7011, state_dir=tmp_path, shaped_link="40mbit,25ms")
    assert cfg.shaped_link == ShapedLink(40e6, 0.025) and cfg.veth == VethNamespace.for_port(7011)
    assert cfg.node_ip == cfg.veth.host_ip and cfg.address == f"{cfg.veth.host_ip}:7011"
    assert cfg.identity()["shaped_link"] == "40mbit,25ms,0ms,0%"
    with pytest.raises(ValueError, match="node_ip is the host end of the veth"):
        C.LocalClusterConfig(port=7011, state_dir=tmp_path, shaped_link="40mbit", node_ip="10.0.0.1")
    with pytest.raises(ValueError, match="bad rate"):
        C.LocalClusterConfig(port=7011, state_dir=tmp_path, shaped_link="quick")


def test_cli_without_namespaces_says_so_and_starts_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(netns, "support", lambda: "network namespaces and veth pairs need root (CAP_NET_ADMIN)")
    state = tmp_path / "st"
    rc = cluster_cli.main(["up", "--shaped-link", "40mbit", "--state-dir", str(state), "--port", str(_free_port())])
    err = capsys.readouterr().err
    assert rc == 4
    assert err.strip() == ("pdd cluster up: --shaped-link needs a network namespace and a veth pair, but network "
                           "namespaces and veth pairs need root (CAP_NET_ADMIN); nothing was started")
    assert not (state / "cluster.json").exists()


@pytest.mark.timeout(60)
def test_cli_where_namespaces_are_not_permitted(tmp_path: Path) -> None:
    """Root without CAP_NET_ADMIN/CAP_SYS_ADMIN (a locked-down container): `ip netns add` fails for
    real; `up` says so, exits 4, and leaves no state, namespace or process behind."""
    if netns.support() or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop the capabilities")
    state, port = tmp_path / "st", _free_port()
    cmd = ["setpriv", "--bounding-set", "-net_admin,-sys_admin", "--inh-caps", "-net_admin,-sys_admin", "--",
           sys.executable, "-m", "pdd_serve.cluster", "up", "--shaped-link", "40mbit", "--state-dir", str(state),
           "--port", str(port)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=50, cwd=ROOT)
    if r.returncode != 0 and "setpriv" in r.stderr:
        pytest.skip(f"setpriv can't drop capabilities here: {r.stderr.strip()}")
    assert r.returncode == 4, r.stderr
    assert r.stderr.startswith("pdd cluster up: could not set up the shaped link: `ip netns add pdd-b-")
    assert r.stderr.strip().endswith("; nothing was started")
    assert not state.exists() or not any(state.iterdir())
    assert not netns.exists(VethNamespace.for_port(port))


@pytest.mark.timeout(120)
def test_cluster_up_puts_site_b_behind_the_shaped_link(tmp_path: Path) -> None:
    """Both raylets come up, site b's node address is the namespace's, Ray's own object transfer
    a -> b is held to the kernel's rate, and `down` removes the namespace."""
    if why := netns.support():
        pytest.skip(f"no network namespaces here: {why}")
    cfg = C.LocalClusterConfig(port=_free_port(), state_dir=tmp_path / "st", cpus_a=1, cpus_b=1,
                               object_store_mib=96, start_timeout_s=90, shaped_link="40mbit")
    reaper = C.spawn_reaper(cfg)
    try:
        try:
            info = C.cluster_up(cfg)
        except C.ShapedLinkUnavailable as e:
            pytest.skip(str(e))
        assert info.shaped_link and info.shaped_link["kernel"]["rate_qdisc"] == "tbf"
        assert info.address == f"{cfg.veth.host_ip}:{cfg.port}"
        st = C.cluster_status(cfg)
        assert st["healthy"] and netns.exists(cfg.veth)
        ips = {n["labels"]["pdd.site"]: n["ip"] for n in st["nodes"] if n["alive"]}
        assert ips == {"a": cfg.veth.host_ip, "b": cfg.veth.ns_ip}
        code = ("import ray, time, numpy as np\n"
                "ray.init(logging_level='error')\n"
                "@ray.remote(num_cpus=0.1, label_selector={'pdd.site': 'b'})\n"
                "def at_b(x): return x.nbytes\n"
                "ray.get(at_b.remote(np.zeros(1)))\n"
                "x = ray.put(np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8))\n"
                "t = time.monotonic(); n = ray.get(at_b.remote(x)); dt = time.monotonic() - t\n"
                "print('BPS', n * 8 / dt)\n")
        env = {**os.environ, **C.driver_env(cfg)}
        env.pop("RAY_AUTH_TOKEN", None)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-3000:]
        bps = float(r.stdout.split("BPS")[-1])
        print(f"\nRay object transfer a -> b: {bps / 1e6:.1f} Mbit/s over the 40 Mbit/s veth")
        # a 4 MiB object in one task call: pull setup and the task's own round trips count too
        assert 0.5 * RATE_BPS <= bps <= 1.2 * RATE_BPS
    finally:
        res = C.cluster_down(cfg, remove_logs=True)
        reaper.kill()
        reaper.wait()
    assert "removed network namespace" in res["message"]
    assert not netns.exists(cfg.veth)
