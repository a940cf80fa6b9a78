"""Soak: bounded minutes of mixed traffic on the local two-site cluster with periodic faults, then a
minute of overload.

    python evaluations/soak.py --minutes 3 [--graph graphs/pdd_dev.yaml] [--fault-every 20]

Brings up its own cluster (its own ports), deploys a graph with fault injection on and the shipped
2 Routers (`--routers`), and runs, in turn:

1. warm-up: a request on each pipeline; every replica's RSS is recorded from here to the end.
2. capacity: `--capacity-clients` closed-loop clients for `--capacity-s` on the overload phase's
   workload (agentic sessions and cold documents, no faults): completed requests/s is the graph's
   measured capacity (`capacity_rps`).
3. faults: closed-loop clients (agentic-length prompts; pipelines mostly chosen by the policy, some
   forced onto P->RLD->MD and P->RLD so the relay paths see faults too; some requests with stop
   strings), slow-reading clients (one SSE chunk a second, short answers) and clients that go away
   mid-stream or before the answer begins, while a fault thread, in turn, kills the MD replica
   holding requests, stalls or cuts the WAN, restarts an MD's Flight server, or kills the relay
   mid-stream.
4. overload: open-loop (Poisson) arrivals at `--overload-factor` x the measured capacity for
   `--overload-s`, 1 in 10 of them a slow reader and 1 in 10 a client that disconnects; a 503 at the
   door or an in-band `overloaded_error` is a shed request, not an error (`shed_503`, `shed_in_band`;
   not retried in this phase: the arrivals go on). `offered_rps` is what was really sent.
5. fill: a burst of long requests fills the KV pools (the soak's graph gets a small pool,
   `--kv-cache-mib`): every request completes or is refused cleanly (503 / an in-band
   `overloaded_error`, retried after Retry-After).

Every answer a client read to the end (slow readers included) is checked token by token against one
engine's greedy output (cut where the stop string ends it). After the load drains, every live
replica of Prefill, Relay and MainDecode (each reached through a handle pinned to it) must show no
sequence left in its `stats` (`leaked_sequences`, disconnected clients included), no Prefill
replica may still run a prefill or a KV transfer (`orphaned_prefills`), the Routers' relay counts
together must match the relay pool's real one (`relay_admission_drift`), and no Router's stream
queue may have passed its bound. Each replica's RSS growth from after warm-up to the end
(`peak_rss_growth_mb`: RSS less its shared-memory pages, which are Ray's object store, bounded by
the raylet and reported apart as `peak_shared_rss_growth_mb`) must stay within
`--rss-growth-limit-mb`. Every fallback is attributed to a
cause (`fallbacks_by_cause`): the injected fault around the request, the overload or pool-fill
phase, or none nearby. Prints a table and one JSON line; exits non-zero unless errors, tokens_lost,
leaked_sequences, relay_admission_drift and orphaned_prefills are all 0, outputs_identical is true,
max_stream_queue <= stream_queue_bound and the RSS growth is within its limit. An overload_factor
under 2 (the driver could not offer that much) or no shed request is reported, not failed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from evaluations.soak_parts import (
    CAPACITY_RAMP_S,
    FALLBACK_KINDS,
    MAX_RETRIES,
    REFERENCE_BATCH,
    SLOW_READ_S,
    Rec,
    RssSampler,
    Workload,
    arrival_times,
    completed_rate,
    disconnect_plan,
    fallback_causes,
    growth_by_phase,
    held_requests,
    mismatch,
    pick_pdd,
    prefill_orphans,
    rss_growth_mb,
    stream_request,
    top2_gap,
)
from pdd_serve.emulation.clock import Clock


def main(argv: list[str] | None = None) -> int:
    # hundreds of client threads stream at once: a short GIL switch interval lets the open-loop
    # arrival thread wake and send on schedule (`arrival_lag_s` reports how late it was)
    sys.setswitchinterval(0.0005)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=3.0, help="traffic duration with faults (default %(default)s)")
    ap.add_argument("--graph", default="graphs/pdd_dev.yaml", help="graph with policy.allow_fault_injection")
    ap.add_argument("--clients", type=int, default=4, help="concurrent closed-loop clients in the fault phase")
    ap.add_argument("--slow-clients", type=int, default=2,
                    help="fault-phase clients that read one chunk a second (12-30 output tokens)")
    ap.add_argument("--disconnect-clients", type=int, default=1,
                    help="fault-phase clients that go away mid-stream or before the answer begins")
    ap.add_argument("--fault-every", type=float, default=20.0, help="seconds between injected faults")
    ap.add_argument("--routers", type=int, default=2, help="Router replicas (the shipped graphs run 2)")
    ap.add_argument("--capacity-s", type=float, default=30.0, help="closed-loop capacity measurement (seconds)")
    ap.add_argument("--capacity-clients", type=int, default=8, help="closed-loop clients measuring capacity")
    ap.add_argument("--overload-s", type=float, default=60.0, help="open-loop arrivals past capacity (seconds; 0: skip)")
    ap.add_argument("--overload-factor", type=float, default=2.0, help="arrival rate over the measured capacity")
    ap.add_argument("--fill-requests", type=int, default=12,
                    help="long requests sent at once after the overload phase to fill the KV pools (0: skip)")
    ap.add_argument("--kv-cache-mib", type=int, default=12,
                    help="KV pool per replica in the soak's graph (small, so the burst fills it)")
    ap.add_argument("--rss-growth-limit-mb", type=float, default=200.0,
                    help="most RSS a replica may grow from after warm-up to the end")
    ap.add_argument("--port", type=int, default=6450, help="GCS port of the soak's own cluster")
    ap.add_argument("--http-port", type=int, default=8450, help="Serve HTTP port")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.clients <= 0 or args.fault_every <= 0 or args.fill_requests < 0:
        ap.error("--minutes, --clients and --fault-every must be > 0, --fill-requests >= 0")
    if (args.capacity_s <= CAPACITY_RAMP_S or args.capacity_clients <= 0 or args.overload_s < 0
            or args.overload_factor <= 0 or args.routers <= 0 or min(args.slow_clients, args.disconnect_clients) < 0):
        ap.error(f"--capacity-s must be > {CAPACITY_RAMP_S:.0f}, --capacity-clients, --overload-factor and "
                 "--routers > 0, --overload-s, --slow-clients and --disconnect-clients >= 0")

    import tempfile

    import yaml

    from pdd_serve.checkpoints import default_model_path
    from pdd_serve.cluster.deploy import deploy_graph
    from pdd_serve.cluster.local import (
        LocalClusterConfig,
        apply_driver_env,
        cluster_down,
        cluster_up,
        driver_env,
    )
    from pdd_serve.config import load_graph_yaml
    from pdd_serve.engine.engine import Engine
    from pdd_serve.engine.sampling import SamplingParams
    from pdd_serve.serve.openai_output import IncrementalDetokenizer

    t_wall = time.monotonic()
    cfg = load_graph_yaml(args.graph)
    if not cfg.policy.allow_fault_injection or not cfg.policy.allow_overrides:
        ap.error(f"{args.graph} must set policy.allow_fault_injection and policy.allow_overrides: true")
    doc = yaml.safe_load(Path(args.graph).read_text())
    doc["http_options"]["port"] = args.http_port
    app_args = doc["applications"][0]["args"]
    app_args["model"]["kv_cache_bytes"] = args.kv_cache_mib << 20
    app_args.setdefault("sites", {})["router_replicas"] = args.routers
    tmp = Path(tempfile.mkdtemp(prefix="pdd-soak-"))
    graph = tmp / "graph.yaml"
    graph.write_text(yaml.safe_dump(doc))
    app = doc["applications"][0]["name"]
    drain_s = cfg.policy.kv_wait_timeout_s + 5  # every background cleanup is bounded by the KV wait
    # the deployments that hold sequences, each with however many replicas the graph gives it
    holders = ("Prefill", "Relay", "MainDecode") if cfg.uses_relay else ("Prefill", "MainDecode")

    ccfg = LocalClusterConfig(port=args.port, state_dir=tmp / "cluster")
    cluster_up(ccfg, log=lambda m: print(m, file=sys.stderr))
    ok = False
    try:
        env = driver_env(ccfg)
        url = deploy_graph(graph, env, log=lambda m: print(m, file=sys.stderr))
        apply_driver_env(ccfg)
        import ray
        from ray import serve

        from pdd_serve.serve.pinning import pinned_handle, replica_actors

        ray.init(address=env["RAY_ADDRESS"], logging_level="error")
        ref = Engine.from_pretrained(default_model_path())
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(default_model_path())
        rng = random.Random(args.seed)
        results: list[Rec] = []
        lock, ref_lock = threading.Lock(), threading.Lock()
        faults: Counter = Counter()
        fault_log: list[tuple[float, str]] = []  # (time injected, kind): fallbacks_by_cause
        phase_s: dict[str, float] = {}
        references: dict[tuple[tuple[int, ...], int], list[int]] = {}

        def log(msg: str) -> None:
            print(f"[soak {time.monotonic() - t_wall:5.0f}s] {msg}", file=sys.stderr, flush=True)

        def handle(name: str):  # noqa: ANN202
            return serve.get_deployment_handle(name, app)

        def replicas(name: str) -> dict[str, str]:
            """{replica id: actor name} of a deployment's live replicas (MainDecode, Prefill and
            Relay may each have several, autoscaling may change them)."""
            return replica_actors(app, name)

        def per_replica_stats(names: tuple[str, ...], timeout_s: float) -> dict[str, object]:
            """`stats` of every live replica of each deployment, keyed `Deployment#replica`: a call
            through a pinned handle reaches that replica (its request router honours the pin)."""
            out = {}
            for name in names:
                live = replicas(name)
                if not live:
                    raise RuntimeError(f"no live {name} replica")  # being restored after a kill
                for rid in sorted(live):
                    st = pinned_handle(app, name, rid).stats.remote().result(timeout_s=timeout_s)
                    if st.extra.get("replica", rid) != rid:  # it died since the listing: another answered
                        raise RuntimeError(f"{name} replica {rid} is gone")
                    out[f"{name}#{rid}"] = st
            return out

        def router_stats(timeout_s: float) -> dict[str, dict]:
            """`stats` of every live Router replica, by replica id. The ingress has no pinning
            request router: unpinned calls spread over the replicas, so call until each answered."""
            live = set(replicas("Router"))
            seen: dict[str, dict] = {}
            for _ in range(20 * max(1, len(live))):
                st = handle("Router").stats.remote().result(timeout_s=timeout_s)
                seen[st["replica"]] = st
                if live <= set(seen):
                    return {r: seen[r] for r in sorted(live)}
            raise RuntimeError(f"Router replicas {sorted(live - set(seen))} did not answer a stats call")

        def reference(prompt: list[int], n: int) -> list[int]:
            """One engine's greedy output (cached: a session's prompt may come twice)."""
            key = (tuple(prompt), n)
            with ref_lock:  # one engine, not thread-safe
                if key not in references:
                    references[key] = ref.generate_batch([prompt], SamplingParams(n, ignore_eos=True))[0]
                return references[key]

        def expected(prompt: list[int], n: int, local: random.Random) -> tuple[list[int], str | None]:
            """One engine's greedy output, and a stop string from its middle (for 1 in 4 requests),
            cut where the router's detokenizer will stop it."""
            want = reference(prompt, n)
            if local.random() >= 0.25 or n < 16:
                return want, None
            mid = local.randrange(n // 4, n - 4)
            stop = tok.decode(want[mid:mid + 2]).strip()[:8]
            if not stop:
                return want, None
            detok = IncrementalDetokenizer(tok, prompt, (stop,))
            for i, t in enumerate(want):
                detok.push(t)
                if detok.stopped:
                    return want[: i + 1], stop
            return want, stop

        def one(phase: str, prompt: list[int], n: int, local: random.Random,
                want_stop: tuple[list[int], str | None] | None = None, *, role: str = "normal",
                pdd: dict | None | str = "pick", retry: bool = True, check_now: bool = True,
                plan: dict | None = None) -> None:
            """Send one request (again after Retry-After while refused, when `retry`). check_now:
            the reference (and maybe a stop string) first; else the reference is computed after
            the phase, for a stream read to the end (the capacity and overload phases stay on the
            graph's clock). role: a slow reader, or a client that disconnects (`plan`)."""
            want, stop = want_stop or (expected(prompt, n, local) if check_now else (None, None))
            if pdd == "pick":
                pdd = pick_pdd(local)
            kw: dict = dict(plan or {})
            if role == "slow":
                kw["read_delay_s"] = SLOW_READ_S
            refusals = 0
            shed: Counter = Counter()
            t0 = time.monotonic()
            while True:
                s = stream_request(url, prompt, n, stop, pdd, **kw)
                if s.shed:
                    shed[s.shed] += 1
                if s.retry_after is None or not retry or refusals >= MAX_RETRIES:
                    break
                refusals += 1  # every pool was full: a clean refusal, sent again as a client would
                time.sleep(s.retry_after)
            err = s.error
            if not err and s.shed and retry:
                err = f"refused {refusals + 1} times (every pool full)"
            if not err and s.shed is None and s.disconnected is None:
                if s.finish is None:
                    err = f"the stream ended without a finish reason after {len(s.ids)} tokens"
                elif stop is not None and want is not None and s.finish != "stop" and len(want) < n:
                    err = f"stop string {stop!r} did not end the stream (finish {s.finish})"
            with lock:
                results.append(Rec(phase, role, prompt, n, stop, want, s, err, refusals, shed, t0, time.monotonic()))

        def check_pending() -> None:
            """References for the streams read to the end whose reference was left for later."""
            with lock:
                pending = [r for r in results if r.want is None and r.completed]
            t = time.monotonic()
            # batched: the engine is batch-invariant (a token's logits do not depend on its batch),
            # so each reference is still one engine's greedy output, in a fraction of the time
            keys = list(dict.fromkeys((tuple(r.prompt), r.n) for r in pending))
            with ref_lock:
                todo = [k for k in keys if k not in references]
                for i in range(0, len(todo), REFERENCE_BATCH):
                    part = todo[i : i + REFERENCE_BATCH]
                    outs = ref.generate_batch([list(p) for p, _ in part],
                                              [SamplingParams(n, ignore_eos=True) for _, n in part])
                    references.update(zip(part, outs))
            for r in pending:
                r.want = reference(r.prompt, r.n)
            if pending:
                log(f"{len(pending)} references computed after the phase in {time.monotonic() - t:.0f}s")

        # ---------------------------------------------------------------- RSS of every replica
        phase_end: dict[str, float] = {}
        sampler = RssSampler(app, log)

        # ---------------------------------------------------------------- 1. warm-up
        t_phase = time.monotonic()
        for j, forced in enumerate([None, {"pipeline": "P-MD"}, {"pipeline": "P-RLD-MD"}, {"pipeline": "P-RLD"}]):
            if forced and forced["pipeline"] not in cfg.policy.pipelines:
                continue
            local = random.Random(args.seed * 31 + j)
            one("warmup", [local.randrange(3, 2000) for _ in range(local.randrange(300, 900))], 32, local, pdd=forced)
        phase_s["warmup"] = time.monotonic() - t_phase
        phase_end["warmup"] = time.monotonic()
        sampler.start()

        # ---------------------------------------------------------------- 2. capacity
        work = Workload(args.seed * 104729 + 1)
        t_phase = time.monotonic()
        cap_stop = t_phase + args.capacity_s

        def capacity_client(cid: int) -> None:
            local = random.Random(args.seed * 7 + cid)
            while time.monotonic() < cap_stop:
                prompt, n, pdd = work.next()
                one("capacity", prompt, n, local, pdd=pdd, check_now=False)

        threads = [threading.Thread(target=capacity_client, args=(c,)) for c in range(args.capacity_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ends = [r.t1 for r in results if r.phase == "capacity" and r.completed]
        capacity_rps = completed_rate(ends, t_phase + CAPACITY_RAMP_S, cap_stop)
        phase_s["capacity"] = time.monotonic() - t_phase
        phase_end["capacity"] = time.monotonic()
        log(f"capacity: {capacity_rps:.2f} requests/s ({len(ends)} completed by {args.capacity_clients} "
            f"closed-loop clients in {args.capacity_s:.0f}s)")
        check_pending()

        # ---------------------------------------------------------------- 3. faults
        t_phase = time.monotonic()
        stop_at = t_phase + args.minutes * 60

        def session_prompt(local: random.Random, system: list[int], context: list[int]) -> list[int]:
            if local.random() < 0.25:  # a cold, low-hit request
                return [local.randrange(3, 2000) for _ in range(local.randrange(600, 1300))]
            context += [local.randrange(3, 2000) for _ in range(local.randrange(20, 80))]  # the next turn
            if len(context) > 2000:
                del context[len(system):]
            return list(context)

        def client(cid: int, role: str) -> None:
            local = random.Random(args.seed * 1000 + cid)
            system = [local.randrange(3, 2000) for _ in range(200)]  # each client's shared context
            context = list(system)
            while time.monotonic() < stop_at:
                prompt = session_prompt(local, system, context)
                if role == "slow":  # tens of seconds at a chunk a second
                    one("faults", prompt, local.randrange(12, 31), local, role="slow")
                elif role == "disconnect":  # long answers, left early: nothing to check but the cleanup
                    one("faults", prompt, local.randrange(64, 160), local, role="disconnect", check_now=False,
                        plan=disconnect_plan(local))
                    time.sleep(0.5)
                else:
                    one("faults", prompt, local.randrange(32, 160), local)

        def busiest_md() -> str:
            """The actor name of the MD replica holding the most requests (a kill that misses every
            request proves nothing); a random one when none holds any."""
            live = replicas("MainDecode")
            if not live:
                raise RuntimeError("no live MainDecode replica")
            running = []
            for rid in sorted(live):
                try:
                    running.append((pinned_handle(app, "MainDecode", rid).stats.remote().result(timeout_s=10).running,
                                    rid))
                except Exception:  # noqa: BLE001 - restarting
                    running.append((-1, rid))
            best = max(running)
            return live[best[1] if best[0] > 0 else rng.choice(sorted(live))]

        def injector() -> None:
            kinds = ["kill_md", "stall", "kill_relay", "cut", "restart_flight"]
            i = 0
            while time.monotonic() + args.fault_every < stop_at:
                time.sleep(args.fault_every)
                kind = kinds[i % len(kinds)]
                i += 1
                try:
                    if kind == "kill_md":  # the replica's actor dies; Serve starts a replacement
                        ray.kill(ray.get_actor(busiest_md(), namespace="serve"), no_restart=True)
                    elif kind in ("stall", "cut"):
                        handle("Prefill").inject.remote(kind, 12.0).result(timeout_s=30)
                    elif kind == "kill_relay":  # dies a few tokens into its next stream
                        handle("Relay").inject.remote("die_mid_stream", 4).result(timeout_s=30)
                    else:
                        md = rng.choice(sorted(replicas("MainDecode")))
                        pinned_handle(app, "MainDecode", md).inject.remote(kind).result(timeout_s=30)
                    faults[kind] += 1
                    fault_log.append((time.monotonic(), kind))
                except Exception as e:  # noqa: BLE001 - a replica still restarting
                    log(f"could not inject {kind}: {e}")

        roles = (["normal"] * args.clients + ["slow"] * args.slow_clients + ["disconnect"] * args.disconnect_clients)
        threads = [threading.Thread(target=client, args=(c, role)) for c, role in enumerate(roles)]
        threads.append(threading.Thread(target=injector))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        phase_s["faults"] = time.monotonic() - t_phase
        phase_end["faults"] = time.monotonic()
        log(f"fault phase: {sum(1 for r in results if r.phase == 'faults')} requests, faults {dict(faults)}")

        # ---------------------------------------------------------------- 4. overload
        offered_rps = 0.0
        arrival_lag: dict[str, float] = {}
        if args.overload_s > 0:
            # the replacement of an MD the faults killed must be up: overload, not a missing replica
            settle = time.monotonic() + 120
            while time.monotonic() < settle:
                try:
                    per_replica_stats(holders, timeout_s=10)
                    break
                except Exception:  # noqa: BLE001 - still being restored
                    time.sleep(2.0)
            arrivals = arrival_times(args.overload_factor * capacity_rps, args.overload_s,
                                     random.Random(args.seed * 15485863 + 3))
            log(f"overload: {len(arrivals)} arrivals over {args.overload_s:.0f}s "
                f"({args.overload_factor:g} x {capacity_rps:.2f} requests/s)")
            # each arrival's request is drawn before the phase: a thread started on time sends at once
            planned = [work.next() for _ in arrivals]
            late: list[float] = []  # how far behind its schedule each arrival was sent (s)
            t_phase = time.monotonic()
            arrivers = []

            def arrive(j: int) -> None:
                late.append(time.monotonic() - (t_phase + arrivals[j]))
                local = random.Random(args.seed * 3571 + j)
                prompt, n, pdd = planned[j]
                r = local.random()
                if r < 0.1:  # a slow reader: a short answer, a chunk a second
                    one("overload", prompt, local.randrange(12, 31), local, role="slow", pdd=pdd, retry=False,
                        check_now=False)
                elif r < 0.2:
                    one("overload", prompt, max(n, 64), local, role="disconnect", pdd=pdd, retry=False,
                        check_now=False, plan=disconnect_plan(local))
                else:
                    one("overload", prompt, n, local, pdd=pdd, retry=False, check_now=False)

            for j, at in enumerate(arrivals):  # open loop: each arrival on time, whatever the graph does
                delay = t_phase + at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                th = threading.Thread(target=arrive, args=(j,), daemon=True)
                th.start()
                arrivers.append(th)
            for th in arrivers:
                th.join()
            # what was really offered: the requests the clients sent within the phase (a driver that
            # fell behind its schedule sent fewer; the rest came after the minute and do not count)
            offered_rps = sum(1 for r in results if r.phase == "overload"
                              and r.t0 <= t_phase + args.overload_s) / args.overload_s
            late.sort()
            arrival_lag = {"p50": round(late[len(late) // 2], 3), "p99": round(late[int(len(late) * 0.99)], 3),
                           "max": round(late[-1], 3)} if late else {}
            phase_s["overload"] = time.monotonic() - t_phase
            phase_end["overload"] = time.monotonic()
            log(f"overload phase: {phase_s['overload']:.0f}s with its tail")
            check_pending()
        overload_factor = offered_rps / capacity_rps if capacity_rps > 0 else 0.0

        # ---------------------------------------------------------------- 5. fill the KV pools
        # long requests all at once (each fits a pool alone, together they don't)
        fill_pool: list[str] = []
        min_free: dict[str, int] = {}
        preempted: dict[str, int] = {}
        preemptions = 0
        pool_blocks = (args.kv_cache_mib << 20) // ref.layout.block_bytes
        if args.fill_requests:
            jobs = []
            for j in range(args.fill_requests):  # references first: the burst must arrive at once
                local = random.Random(args.seed * 7919 + j)
                prompt = [local.randrange(3, 2000) for _ in range(local.randrange(900, 1200))]
                n = local.randrange(200, 400)
                jobs.append((prompt, n, local, expected(prompt, n, local)))
            t_fill = time.monotonic()
            fillers = [threading.Thread(target=one, args=("fill", *job)) for job in jobs]
            for t in fillers:
                t.start()
            base: dict[str, int] = {}
            while True:  # how full the pools got, and how often decode preempted to make room
                alive = any(t.is_alive() for t in fillers)
                seen: dict[str, object] = {}
                for dep in holders:
                    try:
                        seen.update(per_replica_stats((dep,), timeout_s=10))
                    except Exception:  # noqa: BLE001 - restarting
                        continue
                for name, s in seen.items():
                    min_free[name] = min(min_free.get(name, s.free_blocks), s.free_blocks)
                    if "preemptions" in s.extra:  # since the burst began (a restarted replica starts at 0)
                        first = base.setdefault(name, s.extra["preemptions"])
                        preempted[name] = max(preempted.get(name, 0), s.extra["preemptions"] - first)
                if not alive:
                    break
                time.sleep(0.5)
            for t in fillers:
                t.join()
            preemptions = sum(preempted.values())
            fill_pool = [f"{k} {v}/{pool_blocks}" for k, v in min_free.items()]
            phase_s["fill"] = time.monotonic() - t_fill
            phase_end["fill"] = time.monotonic()
            log(f"fill burst: {phase_s['fill']:.0f}s, fewest free blocks seen: {min_free}")

        # ---------------------------------------------------------------- drain
        # nothing may stay behind once the load is gone (no reaper: it waits 2x the KV wait)
        deadline = time.monotonic() + drain_s
        while True:
            held: dict[str, int] = {}
            try:
                every = per_replica_stats(holders, timeout_s=30)
                held = {name: s.running for name, s in every.items()}
                relay_live = sum(len(s.extra["live"]) for name, s in every.items() if name.startswith("Relay#"))
                routers = router_stats(timeout_s=30)
            except Exception:  # a replica the faults killed is still being restored
                if time.monotonic() > deadline + 120:
                    raise
                time.sleep(2.0)
                continue
            # the pool is the truth: every Router's relay streams together against the relays' own
            drift = abs(sum(r["relay_running"] for r in routers.values()) - relay_live)
            leaked = sum(held.values())
            # a prefill or a KV transfer still running on a Prefill replica now works for nobody
            orphans = prefill_orphans(every)
            orphaned = sum(p + t for p, t in orphans.values())
            if (leaked == 0 and drift == 0 and orphaned == 0) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        # orphans at the drain's end count; how long they then take to go (a KV transfer is bounded
        # by the Flight deadline) is reported beside them
        cleared_after: float | None = None
        if orphaned:
            t_drained = time.monotonic()
            while time.monotonic() < t_drained + Clock(cfg.time_scale).real(cfg.flight.deadline_s) + 10:
                time.sleep(2.0)
                try:
                    if not sum(p + t for p, t in prefill_orphans(per_replica_stats(("Prefill",), 30)).values()):
                        cleared_after = round(time.monotonic() - t_drained, 1)
                        break
                except Exception:  # noqa: BLE001 - restarting
                    continue
            fate = "still there" if cleared_after is None else f"gone after {cleared_after:.0f}s"
            log(f"orphans after the drain: {orphans} (prefills, KV transfers); {fate}")
        still_held = held_requests(every, results) if leaked or drift else []
        # a decoder that found KV not its request's own and recomputed it: no client saw it, but
        # something upstream freed or misnamed a block (issue 37)
        context_by_replica = {name: s.extra.get("context_mismatches", 0) for name, s in every.items()
                              if s.extra.get("context_mismatches")}
        mismatched_context = sum(context_by_replica.values())
        abandoned = sum(s.extra.get("prefills_abandoned", 0) for name, s in every.items() if name.startswith("Prefill#"))
        max_queue = max(r.get("max_stream_queue", 0) for r in routers.values())
        queue_bound = min(r.get("stream_queue_bound", 0) for r in routers.values())
        sampler.stop()
        growth = rss_growth_mb(sampler.rss)
        peak_growth = max(growth.values()) if growth else None
        top = max(growth, key=growth.get) if growth else None
        top_by_phase = growth_by_phase(sampler.at[top], sampler.rss[top], phase_end) if top else {}
        shm_growth = rss_growth_mb(sampler.shm)
        peak_shm_growth = max(shm_growth.values()) if shm_growth else None

        # ---------------------------------------------------------------- the verdict
        check_pending()
        done = [r for r in results if r.completed]
        errors = sum(1 for r in results if r.error)
        errors_by_phase = Counter(r.phase for r in results if r.error)
        fallbacks: Counter = Counter(k for r in results for k in r.s.info.get("fallbacks", []))
        relay_path_fallbacks: Counter = Counter(k for r in results if r.s.info.get("pipeline", "").startswith("P-RLD")
                                                for k in r.s.info.get("fallbacks", []))
        by_cause = fallback_causes([(r.phase, r.t0, r.t1, r.s.info.get("fallbacks", [])) for r in results],
                                   fault_log, args.fault_every)
        lost = sum(max(0, len(r.want) - len(r.s.ids)) for r in done)
        identical = all(r.s.ids == r.want for r in done)
        mismatches = [mismatch(r) for r in done if r.s.ids != r.want]
        for m, r in zip(mismatches, [r for r in done if r.s.ids != r.want]):
            if m["first_difference"] < min(len(r.s.ids), len(r.want or [])):  # a different token, not a cut
                with ref_lock:
                    m["reference_top2_gap"] = top2_gap(ref, r.prompt + r.want[: m["first_difference"]])
        pipelines = Counter(r.s.info.get("pipeline", "?") for r in results)
        refused = sum(r.refusals for r in results)
        shed = sum((r.shed for r in results), Counter())
        shed_by_phase: Counter = Counter()
        for r in results:
            shed_by_phase[r.phase] += r.shed["door"]
        shed_by_phase = +shed_by_phase  # the phases that shed
        with_stop = sum(1 for r in done if r.stop is not None)
        by_phase = Counter(r.phase for r in results)
        slow = [r for r in results if r.role == "slow"]
        slow_done = sum(1 for r in slow if r.completed)
        gone = Counter(r.s.disconnected for r in results if r.s.disconnected)
        rss_top = [(sampler.short(k), v) for k, v in sorted(growth.items(), key=lambda kv: -kv[1])[:4]]
        for label, value in [("requests", f"{len(results)} {dict(by_phase)}"), ("read to the end", len(done)),
                             ("pipelines", dict(pipelines)), ("with stop strings", with_stop),
                             ("routers", len(routers)),
                             ("capacity", f"{capacity_rps:.2f} requests/s"),
                             ("offered (overload)", f"{offered_rps:.2f} requests/s, x{overload_factor:.2f}"),
                             ("shed at the door", f"{shed['door']} {dict(shed_by_phase)}"),
                             ("shed in-band", shed["in_band"]),
                             ("slow readers", f"{slow_done} read to the end of {len(slow)}"),
                             ("disconnects", f"{sum(gone.values())} {dict(gone)}"),
                             ("faults injected", dict(faults)),
                             ("fallbacks taken", dict(fallbacks)), ("  on relay paths", dict(relay_path_fallbacks)),
                             ("  by cause", by_cause),
                             ("refused, retried", refused), ("fill: free blocks low", fill_pool),
                             ("fill: preemptions", preemptions),
                             ("errors", f"{errors} {dict(errors_by_phase)}"), ("tokens lost", lost), ("outputs identical", f"{identical}" + (f" ({len(mismatches)} differ: {mismatches[:3]})" if mismatches else "")),
                             ("leaked sequences", f"{leaked} {held}"), ("relay admission drift", drift),
                             ("context mismatches", f"{mismatched_context} {context_by_replica}"),
                             ("arrival lag (s)", arrival_lag),
                             ("orphaned prefills", f"{orphaned} (prefills, KV transfers) {orphans}; gone after {cleared_after} s; "
                                                   f"{abandoned} prefills abandoned on the way"),
                             ("stream queue", f"max {max_queue} of {queue_bound}"),
                             ("RSS growth (MiB)", f"peak {peak_growth} over {len(growth)} replicas; top {rss_top}"),
                             ("  peak by phase end", f"{sampler.short(top) if top else None} {top_by_phase}"),
                             ("  shared (obj. store)", f"peak growth {peak_shm_growth} MiB, not in the figure above"),
                             ("phases (s)", {k: round(v) for k, v in phase_s.items()})]:
            print(f"{label:<22}{value}")
        for kind in sorted(fallbacks):
            print(f"  {kind:<20}{FALLBACK_KINDS.get(kind, '(no explanation on file)')}")
        for h in still_held:
            print(f"held after the drain: {h}", file=sys.stderr)
        for r in results:
            if r.error:
                print(f"error ({r.phase}, {r.role}, {r.s.info.get('pipeline')}): {r.error[:300]}", file=sys.stderr)
        warnings = []
        if overload_factor < 2:
            warnings.append(f"overload_factor {overload_factor:.2f} < 2: the driver could not offer 2x capacity")
        if shed["door"] == 0:
            warnings.append("no 503 at the door: the overload did not make the graph shed")
        if slow_done == 0 or not gone:
            warnings.append("no slow reader read to the end, or no client disconnected: not exercised")
        if len(routers) < 2:
            warnings.append(f"{len(routers)} Router replica(s): the cross-Router checks need 2")
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        wall = time.monotonic() - t_wall
        print(json.dumps({"requests": len(results), "faults_injected": sum(faults.values()),
                          "fallbacks": sum(fallbacks.values()), "errors": errors, "tokens_lost": lost,
                          "errors_by_phase": dict(errors_by_phase), "outputs_identical": identical, "mismatched": len(mismatches),
                          "mismatch_examples": mismatches[:5], "leaked_sequences": leaked,
                          "relay_admission_drift": drift, "held_after_drain": still_held[:10],
                          "context_mismatches": mismatched_context, "arrival_lag_s": arrival_lag,
                          "routers": len(routers), "minutes": args.minutes,
                          "requests_with_stop": with_stop, "fill_requests": by_phase.get("fill", 0),
                          "refused_retried": refused, "fill_preemptions": preemptions,
                          "fill_min_free_blocks": min(min_free.values()) if min_free else None,
                          "pipelines": dict(pipelines),
                          "faults_by_kind": dict(faults), "fallbacks_by_kind": dict(fallbacks),
                          "relay_path_fallbacks": dict(relay_path_fallbacks),
                          "completed": len(done), "requests_by_phase": dict(by_phase),
                          "capacity_rps": round(capacity_rps, 3), "offered_rps": round(offered_rps, 3),
                          "overload_factor": round(overload_factor, 2), "shed_503": shed["door"],
                          "shed_503_by_phase": dict(shed_by_phase), "shed_in_band": shed["in_band"],
                          "slow_clients": slow_done, "slow_streams": len(slow),
                          "disconnects": sum(gone.values()), "disconnects_by_stage": dict(gone),
                          "orphaned_prefills": orphaned, "orphans_gone_after_s": cleared_after,
                          "prefills_abandoned": abandoned,
                          "peak_rss_growth_mb": peak_growth, "rss_growth_limit_mb": args.rss_growth_limit_mb,
                          "peak_shared_rss_growth_mb": peak_shm_growth,
                          "rss_peak_replica": sampler.short(top) if top else None, "rss_peak_growth_by_phase_mb": top_by_phase,
                          "max_stream_queue": max_queue, "stream_queue_bound": queue_bound,
                          "fallbacks_by_cause": by_cause, "warnings": warnings, "wall_s": round(wall)}))
        ok = (errors == 0 and lost == 0 and identical and leaked == 0 and drift == 0 and orphaned == 0
              and mismatched_context == 0
              and max_queue <= queue_bound
              and peak_growth is not None and peak_growth <= args.rss_growth_limit_mb)
    finally:
        cluster_down(ccfg)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
