"""Soak: bounded minutes of mixed traffic on the local two-site cluster with periodic faults.

    python evaluations/soak.py --minutes 3 [--graph graphs/pdd_dev.yaml] [--fault-every 20]

Brings up its own cluster (its own ports), deploys a graph with fault injection on, and runs
closed-loop clients (agentic-length prompts, mixed pipelines chosen by the policy) while a fault
thread kills an MD replica, stalls or cuts the WAN, or restarts a Flight server, in turn. Every
streamed answer is checked token by token against one engine's greedy output on the same weights.
Prints a table and one JSON line: requests, faults_injected, fallbacks, errors, tokens_lost (must
be 0), outputs_identical.
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


def _stream(url: str, prompt: list[int], n: int) -> tuple[list[int], dict, str]:
    import httpx

    body = {"model": "pdd-small", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    ids: list[int] = []
    info: dict = {}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                return ids, info, f"HTTP {r.status_code}: {r.read()[:200]!r}"
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        return ids, info, obj["error"]["message"]
                    ids += obj["choices"][0].get("token_ids", []) if obj.get("choices") else []
                    info = obj.get("pdd", info)
    except Exception as e:  # noqa: BLE001 - counted as an error
        return ids, info, f"{type(e).__name__}: {e}"
    return ids, info, ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=3.0, help="traffic duration (default %(default)s)")
    ap.add_argument("--graph", default="graphs/pdd_dev.yaml", help="graph with policy.allow_fault_injection")
    ap.add_argument("--clients", type=int, default=4, help="concurrent closed-loop clients")
    ap.add_argument("--fault-every", type=float, default=20.0, help="seconds between injected faults")
    ap.add_argument("--port", type=int, default=6450, help="GCS port of the soak's own cluster")
    ap.add_argument("--http-port", type=int, default=8450, help="Serve HTTP port")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.clients <= 0 or args.fault_every <= 0:
        ap.error("--minutes, --clients and --fault-every must be > 0")

    import tempfile

    import yaml

    from pdd_serve.cluster import LocalClusterConfig, apply_driver_env, cluster_down, cluster_up, driver_env
    from pdd_serve.config import load_graph_yaml
    from pdd_serve.demo import deploy_graph
    from pdd_serve.engine.engine import Engine
    from pdd_serve.engine.sampling import SamplingParams
    from pdd_serve.models import default_model_path

    if not load_graph_yaml(args.graph).policy.allow_fault_injection:
        ap.error(f"{args.graph} must set policy.allow_fault_injection: true")
    doc = yaml.safe_load(Path(args.graph).read_text())
    doc["http_options"]["port"] = args.http_port
    tmp = Path(tempfile.mkdtemp(prefix="pdd-soak-"))
    graph = tmp / "graph.yaml"
    graph.write_text(yaml.safe_dump(doc))
    app = doc["applications"][0]["name"]
    n_md = doc["applications"][0]["args"]["sites"]["main_decode_replicas"]

    ccfg = LocalClusterConfig(port=args.port, state_dir=tmp / "cluster")
    cluster_up(ccfg, log=lambda m: print(m, file=sys.stderr))
    try:
        env = driver_env(ccfg)
        url = deploy_graph(graph, env, log=lambda m: print(m, file=sys.stderr))
        apply_driver_env(ccfg)
        import ray
        from ray import serve

        ray.init(address=env["RAY_ADDRESS"], logging_level="error")
        ref = Engine.from_pretrained(default_model_path())
        rng = random.Random(args.seed)
        stop = time.monotonic() + args.minutes * 60
        results: list[tuple[list[int], list[int], dict, str]] = []
        lock, ref_lock = threading.Lock(), threading.Lock()
        faults: Counter = Counter()

        def client(cid: int) -> None:
            local = random.Random(args.seed * 1000 + cid)
            system = [local.randrange(3, 2000) for _ in range(200)]  # each client's shared context
            context = list(system)
            while time.monotonic() < stop:
                if local.random() < 0.25:  # a cold, low-hit request
                    prompt = [local.randrange(3, 2000) for _ in range(local.randrange(600, 1300))]
                else:  # the next turn of the client's session
                    context += [local.randrange(3, 2000) for _ in range(local.randrange(20, 80))]
                    if len(context) > 2500:
                        context = list(system)
                    prompt = list(context)
                n = local.randrange(32, 160)
                got, info, err = _stream(url, prompt, n)
                with ref_lock:  # one engine, not thread-safe
                    want = ref.generate_batch([prompt], SamplingParams(n, ignore_eos=True))[0]
                with lock:
                    results.append((got, want, info, err))

        def injector() -> None:
            kinds = ["kill_md", "stall", "cut", "restart_flight"]
            i = 0
            while time.monotonic() + args.fault_every < stop:
                time.sleep(args.fault_every)
                kind = kinds[i % len(kinds)]
                i += 1
                try:
                    if kind == "kill_md":
                        md = rng.randrange(n_md)
                        for a in ray.util.list_named_actors(all_namespaces=True):
                            if f"{app}#MainDecode{md}#" in a["name"]:
                                ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
                    elif kind in ("stall", "cut"):
                        serve.get_deployment_handle("Prefill", app).inject.remote(kind, 12.0).result(timeout_s=30)
                    else:
                        md = rng.randrange(n_md)
                        serve.get_deployment_handle(f"MainDecode{md}", app).inject.remote(kind).result(timeout_s=30)
                    faults[kind] += 1
                except Exception as e:  # noqa: BLE001 - a replica still restarting
                    print(f"could not inject {kind}: {e}", file=sys.stderr)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        threads.append(threading.Thread(target=injector))
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        fallbacks: Counter = Counter(k for _, _, info, _ in results for k in info.get("fallbacks", []))
        errors = sum(1 for *_, err in results if err)
        lost = sum(max(0, len(want) - len(got)) for got, want, _, err in results if not err)
        identical = all(got == want for got, want, _, err in results if not err)
        pipelines = Counter(info.get("pipeline", "?") for _, _, info, _ in results)
        print(f"{'requests':<22}{len(results)}")
        print(f"{'pipelines':<22}{dict(pipelines)}")
        print(f"{'faults injected':<22}{dict(faults)}")
        print(f"{'fallbacks taken':<22}{dict(fallbacks)}")
        print(f"{'errors':<22}{errors}")
        print(f"{'tokens lost':<22}{lost}")
        print(f"{'outputs identical':<22}{identical}")
        print(json.dumps({"requests": len(results), "faults_injected": sum(faults.values()),
                          "fallbacks": sum(fallbacks.values()), "errors": errors, "tokens_lost": lost,
                          "outputs_identical": identical, "minutes": args.minutes,
                          "faults_by_kind": dict(faults), "fallbacks_by_kind": dict(fallbacks)}))
        ok = errors == 0 and lost == 0 and identical
    finally:
        cluster_down(ccfg)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
