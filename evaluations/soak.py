"""Soak: bounded minutes of mixed traffic on the local two-site cluster with periodic faults.

    python evaluations/soak.py --minutes 3 [--graph graphs/pdd_dev.yaml] [--fault-every 20]

Brings up its own cluster (its own ports), deploys a graph with fault injection on, and runs
closed-loop clients (agentic-length prompts; pipelines mostly chosen by the policy, some forced
onto P->RLD->MD and P->RLD so the relay paths see faults too; some requests with stop strings)
while a fault thread, in turn, kills the MD replica holding requests, stalls or cuts the WAN,
restarts an MD's Flight server, or kills the relay mid-stream. Then a burst of long requests fills
the KV pools (the soak's graph gets a small pool, `--kv-cache-mib`): every request completes or is
refused cleanly (503 / an in-band `overloaded_error`, retried after Retry-After).

Every answer is checked token by token against one engine's greedy output (cut where the stop
string ends it). After the load drains, every live replica of Prefill, Relay and MainDecode (each
reached through a handle pinned to it) must show no sequence left in its `stats`
(`leaked_sequences`) and the Router's relay count must match the relay pool's real one
(`relay_admission_drift`). Prints a table and one JSON line; exits non-zero unless errors,
tokens_lost, leaked_sequences and relay_admission_drift are all 0 and outputs_identical is true.
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

MAX_RETRIES = 30  # a refused request (every pool full) is sent again after its Retry-After


def _stream(url: str, prompt: list[int], n: int, stop: str | None, pdd: dict | None
            ) -> tuple[list[int], dict, str | None, str, float | None]:
    """(token ids, pdd info, finish reason, error, retry-after seconds when refused as overloaded)."""
    import httpx

    body = {"model": "pdd-small", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    if stop is not None:
        body["stop"] = [stop]
    if pdd:
        body["pdd"] = pdd
    ids: list[int] = []
    info: dict = {}
    finish = None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            if r.status_code == 503:
                return ids, info, None, "", float(r.headers.get("retry-after", 1))
            if r.status_code != 200:
                return ids, info, None, f"HTTP {r.status_code}: {r.read()[:200]!r}", None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        if obj["error"].get("type") == "overloaded_error":  # every pool full, mid-stream
                            return ids, info, None, "", 1.0
                        return ids, info, None, obj["error"]["message"], None
                    ch = obj["choices"][0] if obj.get("choices") else {}
                    ids += ch.get("token_ids", [])
                    finish = ch.get("finish_reason") or finish
                    info = obj.get("pdd", info)
    except Exception as e:  # noqa: BLE001 - counted as an error
        return ids, info, None, f"{type(e).__name__}: {e}", None
    return ids, info, finish, "", None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=3.0, help="traffic duration with faults (default %(default)s)")
    ap.add_argument("--graph", default="graphs/pdd_dev.yaml", help="graph with policy.allow_fault_injection")
    ap.add_argument("--clients", type=int, default=4, help="concurrent closed-loop clients")
    ap.add_argument("--fault-every", type=float, default=20.0, help="seconds between injected faults")
    ap.add_argument("--fill-requests", type=int, default=12,
                    help="long requests sent at once after the fault phase to fill the KV pools (0: skip)")
    ap.add_argument("--kv-cache-mib", type=int, default=12,
                    help="KV pool per replica in the soak's graph (small, so the burst fills it)")
    ap.add_argument("--port", type=int, default=6450, help="GCS port of the soak's own cluster")
    ap.add_argument("--http-port", type=int, default=8450, help="Serve HTTP port")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.clients <= 0 or args.fault_every <= 0 or args.fill_requests < 0:
        ap.error("--minutes, --clients and --fault-every must be > 0, --fill-requests >= 0")

    import tempfile

    import yaml

    from pdd_serve.cluster import LocalClusterConfig, apply_driver_env, cluster_down, cluster_up, driver_env
    from pdd_serve.config import load_graph_yaml
    from pdd_serve.demo import deploy_graph
    from pdd_serve.engine.engine import Engine
    from pdd_serve.engine.sampling import SamplingParams
    from pdd_serve.models import default_model_path
    from pdd_serve.serve.openai_api import IncrementalDetokenizer

    cfg = load_graph_yaml(args.graph)
    if not cfg.policy.allow_fault_injection or not cfg.policy.allow_overrides:
        ap.error(f"{args.graph} must set policy.allow_fault_injection and policy.allow_overrides: true")
    doc = yaml.safe_load(Path(args.graph).read_text())
    doc["http_options"]["port"] = args.http_port
    doc["applications"][0]["args"]["model"]["kv_cache_bytes"] = args.kv_cache_mib << 20
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
        # (phase, got, expected, info, error, stop, refusals)
        results: list[tuple[str, list[int], list[int], dict, str, str | None, int]] = []
        lock, ref_lock = threading.Lock(), threading.Lock()
        faults: Counter = Counter()

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

        def expected(prompt: list[int], n: int, local: random.Random) -> tuple[list[int], str | None]:
            """One engine's greedy output, and a stop string from its middle (for 1 in 4 requests),
            cut where the router's detokenizer will stop it."""
            with ref_lock:  # one engine, not thread-safe
                want = ref.generate_batch([prompt], SamplingParams(n, ignore_eos=True))[0]
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
                want_stop: tuple[list[int], str | None] | None = None) -> None:
            want, stop = want_stop or expected(prompt, n, local)
            r = local.random()
            pdd = ({"pipeline": "P-RLD-MD", "handoff_mode": local.choice(["one-shot", "catch-up"])} if r < 0.2
                   else {"pipeline": "P-RLD"} if r < 0.3 else None)
            refusals = 0
            while True:
                got, info, finish, err, retry_after = _stream(url, prompt, n, stop, pdd)
                if retry_after is None or refusals >= MAX_RETRIES:
                    break
                refusals += 1  # every pool was full: a clean refusal, sent again as a client would
                time.sleep(retry_after)
            if not err and retry_after is not None:
                err = f"refused {refusals} times (every pool full)"
            if not err and stop is not None and finish != "stop" and len(want) < n:
                err = f"stop string {stop!r} did not end the stream (finish {finish})"
            with lock:
                results.append((phase, got, want, info, err, stop, refusals))

        stop_at = time.monotonic() + args.minutes * 60

        def client(cid: int) -> None:
            local = random.Random(args.seed * 1000 + cid)
            system = [local.randrange(3, 2000) for _ in range(200)]  # each client's shared context
            context = list(system)
            while time.monotonic() < stop_at:
                if local.random() < 0.25:  # a cold, low-hit request
                    prompt = [local.randrange(3, 2000) for _ in range(local.randrange(600, 1300))]
                else:  # the next turn of the client's session
                    context += [local.randrange(3, 2000) for _ in range(local.randrange(20, 80))]
                    if len(context) > 2000:
                        context = list(system)
                    prompt = list(context)
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
                except Exception as e:  # noqa: BLE001 - a replica still restarting
                    print(f"could not inject {kind}: {e}", file=sys.stderr)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        threads.append(threading.Thread(target=injector))
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        # fill the KV pools: long requests all at once (each fits a pool alone, together they don't)
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
            print(f"fill burst: {time.monotonic() - t_fill:.0f}s, fewest free blocks seen: {min_free}", file=sys.stderr)

        # drain: nothing may stay behind once the load is gone (no reaper: it waits 2x the KV wait)
        deadline = time.monotonic() + drain_s
        while True:
            held: dict[str, int] = {}
            try:
                every = per_replica_stats(holders, timeout_s=30)
                held = {name: s.running for name, s in every.items()}
                relay_live = sum(len(s.extra["live"]) for name, s in every.items() if name.startswith("Relay#"))
                router = handle("Router").stats.remote().result(timeout_s=30)
            except Exception:  # a replica the faults killed is still being restored
                if time.monotonic() > deadline + 120:
                    raise
                time.sleep(2.0)
                continue
            drift = abs(router["relay_running"] - relay_live)
            leaked = sum(held.values())
            if (leaked == 0 and drift == 0) or time.monotonic() > deadline:
                break
            time.sleep(1.0)

        done = [r for r in results if not r[4]]
        fallbacks: Counter = Counter(k for r in results for k in r[3].get("fallbacks", []))
        relay_path_fallbacks: Counter = Counter(k for r in results if r[3].get("pipeline", "").startswith("P-RLD")
                                                for k in r[3].get("fallbacks", []))
        errors = len(results) - len(done)
        lost = sum(max(0, len(want) - len(got)) for _, got, want, *_ in done)
        identical = all(got == want for _, got, want, *_ in done)
        pipelines = Counter(r[3].get("pipeline", "?") for r in results)
        refused = sum(r[6] for r in results)
        with_stop = sum(1 for r in done if r[5] is not None)
        by_phase = Counter(r[0] for r in results)
        for label, value in [("requests", f"{len(results)} {dict(by_phase)}"), ("pipelines", dict(pipelines)),
                             ("with stop strings", with_stop), ("faults injected", dict(faults)),
                             ("fallbacks taken", dict(fallbacks)), ("  on relay paths", dict(relay_path_fallbacks)),
                             ("refused, retried", refused), ("fill: free blocks low", fill_pool),
                             ("fill: preemptions", preemptions),
                             ("errors", errors), ("tokens lost", lost), ("outputs identical", identical),
                             ("leaked sequences", f"{leaked} {held}"), ("relay admission drift", drift)]:
            print(f"{label:<22}{value}")
        for r in results:
            if r[4]:
                print(f"error ({r[0]}, {r[3].get('pipeline')}): {r[4][:300]}", file=sys.stderr)
        print(json.dumps({"requests": len(results), "faults_injected": sum(faults.values()),
                          "fallbacks": sum(fallbacks.values()), "errors": errors, "tokens_lost": lost,
                          "outputs_identical": identical, "leaked_sequences": leaked,
                          "relay_admission_drift": drift, "minutes": args.minutes,
                          "requests_with_stop": with_stop, "fill_requests": by_phase.get("fill", 0),
                          "refused_retried": refused, "fill_preemptions": preemptions,
                          "fill_min_free_blocks": min(min_free.values()) if min_free else None,
                          "pipelines": dict(pipelines),
                          "faults_by_kind": dict(faults), "fallbacks_by_kind": dict(fallbacks),
                          "relay_path_fallbacks": dict(relay_path_fallbacks)}))
        ok = errors == 0 and lost == 0 and identical and leaked == 0 and drift == 0
    finally:
        cluster_down(ccfg)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
