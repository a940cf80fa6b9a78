"""Transport benchmark: does the KV stream fill the line, what CPU does it cost, how small is a handoff.

    python evaluations/bench/transport.py [--mb 128] [--repeats 3] [--streams 1,2,4] [--shaped-link 1gbit]
                                          [--no-ray]

Every receiver runs in its own process, as MD's Flight server does (started with this script's
`--serve`), so CPU is counted per process, each over its own window: the receiver's CPU time (user
+ system, every thread: gRPC's, Arrow's, our CRC checks) from `expect` to its last verified block,
and the sender's (this process, which runs nothing else meanwhile: the Flight client, its streams
and the pacer) from the first write to the last ack. Loopback's kernel work is charged to whichever
process's system call ran it (softirq work run on another core can escape both). CPU per GB is not
one constant: it is measured at every operating point (each paced rate and stream count, unpaced, kernel-shaped), because gRPC's cost per byte
grows when sender and receiver contend for the same cores, and the cores a line needs come from
the CPU measured on that line (an unpaced run's figure times the line rate was the old, wrong
estimate: it gave 4+ cores for a line this 2-core box kept 0.92 full). Every run's cores busy
(CPU seconds over wall seconds) is checked against the machine's cores: a figure above them is an
accounting error and is reported as one. Measured, repeats interleaved, medians reported:
- line utilisation: verified KV goodput (from the first write until the receiver holds every block
  with its CRC32 checked) over the line rate, with 1/2/4 parallel Flight streams per transfer, on
  * the paced link: `LinkModel` at 1 and 10 Gbit/s (no propagation delay: this measures whether the
    transport keeps the line busy, not the speed of light), and
  * the kernel-shaped link: the receiver in a network namespace behind a veth pair with tbf at
    `--shaped-link` on both ends (pdd_serve.cluster.netns; needs root), where a raw TCP stream is the
    ceiling (tbf shapes on-wire bytes: TCP/IP headers take ~5%).
- CPU seconds per GB moved, Flight (verified) on every line above and unpaced on loopback, a raw
  socket unpaced; cores busy for each; and
  `flight_vs_tcp`, their loopback throughput ratio (per-repeat pairs).
- the handoff payload: the bytes of the real one-shot handoff call (Router -> MD `decode(request_id,
  committed, timeout_s)` with 100 committed ids, serialized by Ray's serializer, plus Serve's
  per-call request metadata) against the KV of those 100 tokens, for this model and for docs/pdd.md's
  50 KB/token flagship. `handoff_payload_ratio` is the flagship one (target <= 1e-3).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from pdd_serve.config import FlightConfig
from pdd_serve.engine.kv import KVBlocks, KVLayout
from pdd_serve.transport.flight import KVFlightClient, KVFlightServer, UnknownRequestError
from pdd_serve.transport.link import REFERENCE_KV_BYTES_PER_TOKEN, LinkModel

DEFAULT_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16)  # 2 KiB/token, fp32: the default model
TOKEN = "bench"
TARGETS = {"line_util_1g_paced": 0.8, "line_util_10g_paced": 0.8, "line_util_1g_kernel": 0.9}


def make_kv(layout: KVLayout, nbytes: int) -> KVBlocks:
    n = max(1, nbytes // layout.block_bytes)
    data = np.random.default_rng(0).standard_normal((n, *layout.block_shape)).astype(np.float32)
    return KVBlocks(layout, 0, data, list(range(1, n + 1)))


# ---------------------------------------------------------------- receivers (their own processes)


def _say(msg: dict) -> None:
    print(json.dumps(msg), flush=True)


def serve_flight(host: str, max_bytes: int) -> None:
    """MD's side: a verifying Flight server. Per transfer: expect, wait for every verified block,
    report the process's CPU seconds over it."""
    with KVFlightServer(host, layout=DEFAULT_LAYOUT, token=TOKEN, max_bytes_per_request=max_bytes,
                        max_bytes_total=max_bytes) as server:
        _say({"location": server.location})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                return
            server.expect(cmd["rid"], cmd["blocks"])
            cpu0 = time.process_time()
            _say({"ok": True})
            got = server.wait_complete_sync(cmd["rid"], 600)
            cpu = time.process_time() - cpu0
            n = sum(r.num_blocks for r in got.runs)
            server.release(cmd["rid"])
            _say({"cpu": cpu, "blocks": n})


def serve_tcp(host: str, max_bytes: int) -> None:
    """A raw socket receiver: lands the bytes in a preallocated buffer, nothing else."""
    dst = bytearray(max_bytes)
    with socket.create_server((host, 0)) as srv:
        _say({"port": srv.getsockname()[1]})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                return
            total = cmd["bytes"]
            _say({"ok": True})
            conn, _ = srv.accept()
            cpu0 = time.process_time()
            view, got = memoryview(dst), 0
            with conn:
                while got < total:
                    n = conn.recv_into(view[got:total], min(total - got, 1 << 20))
                    if n == 0:
                        break
                    got += n
            _say({"cpu": time.process_time() - cpu0, "bytes": got})


class Receiver:
    """A receiver process (optionally inside a network namespace), driven over its stdin/stdout."""

    def __init__(self, kind: str, host: str, max_bytes: int, prefix: list[str] | None = None) -> None:
        cmd = [*(prefix or []), sys.executable, str(Path(__file__).resolve()), "--serve", kind, "--host", host,
               "--max-bytes", str(max_bytes)]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"receiver exited (code {self.proc.wait()})")
        return json.loads(line)

    def ask(self, **cmd: object) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def result(self) -> dict:
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---------------------------------------------------------------- one transfer each


def flight_once(rx: Receiver, kv: KVBlocks, streams: int, batch_blocks: int, link: LinkModel | None) -> dict:
    """Push `kv` to a Flight receiver; wall seconds to the last verified block, CPU both sides."""
    rid = f"bench-{uuid.uuid4().hex[:12]}"
    rx.ask(op="expect", rid=rid, blocks=kv.num_blocks)
    client = KVFlightClient(rx.hello["location"], TOKEN, layout=kv.layout, batch_blocks=batch_blocks,
                            deadline_s=600, parallel_streams=streams, link=link)
    cpu0, t0 = time.process_time(), time.perf_counter()
    try:
        client.push(rid, [kv])
    except UnknownRequestError:
        # the receiver had verified every block and released the request before a retry of ours
        # (a stream reconnected under CPU contention) arrived; its answer below says what it holds
        pass
    cpu_tx = time.process_time() - cpu0
    res = rx.result()  # arrives once every block is verified
    dt = time.perf_counter() - t0
    if res["blocks"] != kv.num_blocks:
        raise RuntimeError(f"receiver holds {res['blocks']} of {kv.num_blocks} blocks")
    return {"s": dt, "cpu": cpu_tx + res["cpu"], "cpu_tx": cpu_tx, "cpu_rx": res["cpu"], "bytes": kv.nbytes}


def tcp_once(rx: Receiver, host: str, kv: KVBlocks, chunk: int) -> dict:
    src = memoryview(kv.data).cast("B")
    rx.ask(op="recv", bytes=kv.nbytes)
    cpu0, t0 = time.process_time(), time.perf_counter()
    with socket.create_connection((host, rx.hello["port"])) as s:
        for lo in range(0, kv.nbytes, chunk):
            s.sendall(src[lo : lo + chunk])
        cpu_tx = time.process_time() - cpu0
        res = rx.result()
    dt = time.perf_counter() - t0
    if res["bytes"] != kv.nbytes:
        raise RuntimeError(f"TCP receiver got {res['bytes']} of {kv.nbytes} bytes")
    return {"s": dt, "cpu": cpu_tx + res["cpu"], "cpu_tx": cpu_tx, "cpu_rx": res["cpu"], "bytes": kv.nbytes}


# ---------------------------------------------------------------- the handoff message


def handoff_message(n_tokens: int, vocab: int) -> dict[str, int]:
    """Bytes of the one-shot handoff as it crosses: the Router's `MD.decode(request_id, committed,
    timeout_s)` call (orchestrator `md_decode`), args serialized by Ray's own serializer, plus the
    Serve request metadata every handle call carries. The catch-up batch call
    (`handoff_batch(request_id, token_ids, timeout_s)`) has the same shape."""
    import ray.cloudpickle
    from ray._private.serialization import SerializationContext
    from ray.serve._private.common import RequestMetadata

    committed = np.random.default_rng(1).integers(0, vocab, n_tokens).tolist()  # ids as the router keeps them
    rid = f"cmpl-{uuid.uuid4().hex}"
    args = SerializationContext(None).serialize((rid, committed, 60.0)).total_bytes
    meta = len(ray.cloudpickle.dumps(RequestMetadata(request_id=rid, internal_request_id=uuid.uuid4().hex,
                                                     call_method="decode", app_name="pdd", is_streaming=True),
                                     protocol=5))
    return {"args": args, "serve_metadata": meta, "total": args + meta, "int32_ids": 4 * n_tokens}


# ---------------------------------------------------------------- object store (in-site path)


def bench_object_store(kv: KVBlocks, repeats: int) -> dict[str, float]:
    import ray

    from pdd_serve.transport.object_store import get_kv, put_kv

    # address="local": a private instance, even when a cluster (e.g. `pdd cluster up`) is running here
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        puts, gets, gets_v = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ref = put_kv(kv)
            puts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = get_kv(ref, 30, verify=False)
            gets.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = get_kv(ref, 30, verify=True)
            gets_v.append(time.perf_counter() - t0)
            del out, ref
        gb = kv.nbytes / 1e9
        return {"put": gb / statistics.median(puts), "get": gb / statistics.median(gets),
                "get_verify": gb / statistics.median(gets_v)}
    finally:
        ray.shutdown()


# ---------------------------------------------------------------- the kernel-shaped link


class ShapedNamespace:
    """The receiver's end of a kernel-shaped veth (pdd_serve.cluster.netns), made for this run and removed."""

    def __init__(self, spec: str) -> None:
        from pdd_serve.cluster import netns

        self.netns = netns
        self.link = netns.ShapedLink.parse(spec)
        self.ns = netns.VethNamespace.for_port(20000 + os.getpid() % 40000, stem="bt")
        why = netns.support()
        if why:
            raise RuntimeError(why)
        self.applied = netns.create(self.ns, self.link)

    def close(self) -> None:
        self.netns.destroy(self.ns)


# ---------------------------------------------------------------- main


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=128, help="KV megabytes per transfer")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions; medians are reported")
    ap.add_argument("--batch-blocks", type=int, default=FlightConfig().batch_blocks,
                    help="blocks per Flight batch (default: the product's flight.batch_blocks)")
    ap.add_argument("--streams", default="1,2,4", help="parallel Flight streams per transfer to measure")
    ap.add_argument("--paced", default="1e9,1e10", help="paced line rates, bit/s")
    ap.add_argument("--shaped-link", default="1gbit", help="kernel-shaped link rate ('' to skip)")
    ap.add_argument("--handoff-tokens", type=int, default=100, help="eager tokens handed over by id")
    ap.add_argument("--vocab", type=int, default=151_936, help="vocabulary the handed-over ids come from")
    ap.add_argument("--no-ray", action="store_true", help="skip the object-store measurement (ray.init is slow)")
    ap.add_argument("--serve", choices=("flight", "tcp"), help=argparse.SUPPRESS)  # a receiver process
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--max-bytes", type=int, default=1 << 30, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        (serve_flight if args.serve == "flight" else serve_tcp)(args.host, args.max_bytes)
        return 0
    streams = [int(s) for s in args.streams.split(",")]
    rates = [float(r) for r in args.paced.split(",")]
    if args.mb <= 0 or args.repeats <= 0 or args.batch_blocks <= 0 or min(streams) <= 0 or min(rates) <= 0:
        ap.error("--mb, --repeats, --batch-blocks, --streams and --paced must be > 0")

    layout = DEFAULT_LAYOUT
    kv = make_kv(layout, int(args.mb * 1e6))
    chunk = args.batch_blocks * layout.block_bytes
    cap = kv.nbytes + (1 << 20)
    lo_flight, lo_tcp = Receiver("flight", "127.0.0.1", cap), Receiver("tcp", "127.0.0.1", cap)
    shaped, why_no_kernel, k_flight, k_tcp = None, None, None, None
    if args.shaped_link:
        try:
            shaped = ShapedNamespace(args.shaped_link)
            k_flight = Receiver("flight", shaped.ns.ns_ip, cap, shaped.ns.exec_prefix)
            k_tcp = Receiver("tcp", shaped.ns.ns_ip, cap, shaped.ns.exec_prefix)
        except Exception as e:  # noqa: BLE001 - no namespace here: say why, measure the rest
            why_no_kernel = f"{type(e).__name__}: {e}"
    else:
        why_no_kernel = "--shaped-link not given"

    runs: dict[str, list[dict]] = {}

    def record(key: str, r: dict) -> None:
        runs.setdefault(key, []).append(r)

    try:
        small = kv.slice(0, min(kv.num_blocks, 64))  # warm every connection path once
        flight_once(lo_flight, small, 1, args.batch_blocks, None)
        tcp_once(lo_tcp, "127.0.0.1", small, chunk)
        if k_flight:
            flight_once(k_flight, small, 1, args.batch_blocks, None)
            tcp_once(k_tcp, shaped.ns.ns_ip, small, chunk)
        for _ in range(args.repeats):  # interleaved: a noisy neighbour hits every variant alike
            record("flight_lo", flight_once(lo_flight, kv, 1, args.batch_blocks, None))
            record("tcp_lo", tcp_once(lo_tcp, "127.0.0.1", kv, chunk))
            for rate in rates:
                for s in streams:
                    record(f"paced_{rate:g}_{s}", flight_once(lo_flight, kv, s, args.batch_blocks,
                                                              LinkModel(bandwidth_bps=rate)))
            if k_flight:
                for s in streams:
                    record(f"kernel_{s}", flight_once(k_flight, kv, s, args.batch_blocks, None))
                record("kernel_tcp", tcp_once(k_tcp, shaped.ns.ns_ip, kv, chunk))
    finally:
        for rx in (lo_flight, lo_tcp, k_flight, k_tcp):
            if rx is not None:
                rx.close()
        if shaped is not None:
            shaped.close()

    def gbps(key: str) -> float:  # median goodput, Gbit/s
        return _med([r["bytes"] * 8 / r["s"] for r in runs[key]]) / 1e9

    def cpu_per_gb(key: str) -> float:
        return _med([r["cpu"] / (r["bytes"] / 1e9) for r in runs[key]])

    def cores_busy(key: str) -> float:  # CPU seconds per wall second, sender + receiver
        return _med([r["cpu"] / r["s"] for r in runs[key]])

    util = {rate: {s: gbps(f"paced_{rate:g}_{s}") * 1e9 / rate for s in streams} for rate in rates}
    best_s = {rate: max(streams, key=lambda s: util[rate][s]) for rate in rates}
    # The floor: a line of R GB/s needs R x (CPU s per GB *on that line*) cores of sender +
    # receiver; past this machine's cores no setting fills it. Beside it, what one unpaced stream
    # moves here right now.
    cores = os.cpu_count() or 1
    cores_needed = {rate: cpu_per_gb(f"paced_{rate:g}_{best_s[rate]}") * rate / 8e9 for rate in rates}
    busiest = max(r["cpu"] / r["s"] for rs in runs.values() for r in rs)
    accounting_ok = busiest <= cores * 1.05  # CPU time can't exceed wall time x cores
    unpaced_1 = {rate: min(1.0, gbps("flight_lo") * 1e9 / rate) for rate in rates}
    kernel_rate = shaped.link.rate_bps if shaped and k_flight else None
    kernel = {s: gbps(f"kernel_{s}") * 1e9 / kernel_rate for s in streams} if kernel_rate else {}
    flight_vs_tcp = _med([t["s"] / f["s"] for f, t in zip(runs["flight_lo"], runs["tcp_lo"])])
    store = None if args.no_ray else bench_object_store(kv, args.repeats)
    hand = handoff_message(args.handoff_tokens, args.vocab)
    kv_model = args.handoff_tokens * layout.bytes_per_token
    kv_flagship = args.handoff_tokens * REFERENCE_KV_BYTES_PER_TOKEN

    rows = [("KV per transfer", f"{kv.nbytes / 1e6:.1f} MB in {args.batch_blocks}-block batches "
                                f"({chunk / 1e6:.1f} MB), receiver in its own process, {args.repeats} repeats")]
    for rate in rates:
        for s in streams:
            rows.append((f"paced {rate / 1e9:g} Gbit/s, {s} stream(s): verified goodput / line",
                         f"{util[rate][s]:.3f}  ({gbps(f'paced_{rate:g}_{s}'):.2f} Gbit/s)"))
        rows.append((f"  CPU s per GB on it ({best_s[rate]} stream(s)), cores busy; cores to fill it",
                     f"{cpu_per_gb(f'paced_{rate:g}_{best_s[rate]}'):.2f}, "
                     f"{cores_busy(f'paced_{rate:g}_{best_s[rate]}'):.2f} of {cores}; {cores_needed[rate]:.2f}"))
        rows.append(("  1 unpaced stream / line", f"{unpaced_1[rate]:.3f}"))
    if kernel:
        for s in streams:
            rows.append((f"kernel tbf {kernel_rate / 1e9:g} Gbit/s, {s} stream(s): verified goodput / line",
                         f"{kernel[s]:.3f}  ({gbps(f'kernel_{s}'):.3f} Gbit/s)"))
        rows.append((f"kernel tbf {kernel_rate / 1e9:g} Gbit/s, raw TCP (the ceiling)",
                     f"{gbps('kernel_tcp') * 1e9 / kernel_rate:.3f}  ({gbps('kernel_tcp'):.3f} Gbit/s)"))
    else:
        rows.append(("kernel-shaped link", f"not measured: {why_no_kernel}"))
    rows += [
        ("loopback unpaced: Flight verified / raw TCP", f"{gbps('flight_lo') / 8:.2f} / {gbps('tcp_lo') / 8:.2f} GB/s"),
        ("flight_vs_tcp (loopback throughput ratio)", f"{flight_vs_tcp:.2f}"),
        ("loopback unpaced, CPU s per GB, sender + receiver: Flight / raw TCP",
         f"{cpu_per_gb('flight_lo'):.2f} / {cpu_per_gb('tcp_lo'):.2f}"),
        ("  of it the receiver's (Flight); cores busy, Flight / raw TCP",
         f"{_med([r['cpu_rx'] / (r['bytes'] / 1e9) for r in runs['flight_lo']]):.2f}; "
         f"{cores_busy('flight_lo'):.2f} / {cores_busy('tcp_lo'):.2f} of {cores}"),
        ("CPU accounting check: busiest run's cores busy <= cores",
         f"{busiest:.2f} <= {cores}: {'ok' if accounting_ok else 'FAILED: more CPU than the cores give, so the accounting is wrong'}"),
    ]
    if store:
        rows.append(("object store put / get / get + verify",
                     f"{store['put']:.2f} / {store['get']:.1f} / {store['get_verify']:.2f} GB/s"))
    rows += [
        (f"handoff of {args.handoff_tokens} ids: Ray-serialized args + Serve metadata",
         f"{hand['args']} + {hand['serve_metadata']} = {hand['total']} B  (int32 ids alone {hand['int32_ids']} B)"),
        (f"KV of {args.handoff_tokens} tokens: this model / 50 KB/token flagship", f"{kv_model} / {kv_flagship} B"),
        ("handoff / KV, this model", f"{hand['total'] / kv_model:.2e}  (1/{kv_model / hand['total']:.0f})"),
        ("handoff_payload_ratio (50 KB/token flagship)",
         f"{hand['total'] / kv_flagship:.2e}  (1/{kv_flagship / hand['total']:.0f})  target <= 1e-3"),
    ]
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")

    best = {rate: max(util[rate].values()) for rate in rates}
    out: dict[str, object] = {
        "bench": "transport", "kv_bytes": kv.nbytes, "repeats": args.repeats, "batch_blocks": args.batch_blocks,
        "streams": streams,
        **{f"line_util_{rate / 1e9:g}g_paced_by_streams": {str(s): u for s, u in util[rate].items()} for rate in rates},
        "line_util_1g_paced": best.get(1e9), "line_util_10g_paced": best.get(1e10),
        **{f"line_util_{rate / 1e9:g}g_unpaced_1stream": unpaced_1[rate] for rate in rates},
        **{f"cores_to_fill_{rate / 1e9:g}g": cores_needed[rate] for rate in rates}, "cores": cores,
        "line_util_1g_kernel": max(kernel.values()) if kernel and kernel_rate == 1e9 else None,
        "line_util_kernel_by_streams": {str(s): u for s, u in kernel.items()} or None,
        "line_util_kernel_tcp": gbps("kernel_tcp") * 1e9 / kernel_rate if kernel else None,
        "kernel_null_reason": why_no_kernel,
        "flight_gbs": gbps("flight_lo") / 8, "tcp_gbs": gbps("tcp_lo") / 8, "flight_vs_tcp": flight_vs_tcp,
        "flight_cpu_s_per_gb": cpu_per_gb("flight_lo"), "tcp_cpu_s_per_gb": cpu_per_gb("tcp_lo"),
        "flight_rx_cpu_s_per_gb": _med([r["cpu_rx"] / (r["bytes"] / 1e9) for r in runs["flight_lo"]]),
        **{f"cpu_s_per_gb_{rate / 1e9:g}g_paced": cpu_per_gb(f"paced_{rate:g}_{best_s[rate]}") for rate in rates},
        **{f"cores_busy_{rate / 1e9:g}g_paced": cores_busy(f"paced_{rate:g}_{best_s[rate]}") for rate in rates},
        "flight_cores_busy": cores_busy("flight_lo"), "max_cores_busy": busiest,
        "cpu_accounting_ok": accounting_ok,
        "handoff_payload_bytes": hand["total"], "kv_bytes_100_tokens_model": kv_model,
        "kv_bytes_100_tokens_50kb": kv_flagship,
        "handoff_payload_ratio": hand["total"] / kv_flagship, "handoff_payload_ratio_this_model": hand["total"] / kv_model,
    }
    if store:
        out.update({f"object_store_{k}_gbs": v for k, v in store.items()})

    def rnd(v: object) -> object:
        if isinstance(v, float):
            return float(f"{v:.4g}")
        return {k: rnd(x) for k, x in v.items()} if isinstance(v, dict) else v

    print(json.dumps({k: rnd(v) for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
