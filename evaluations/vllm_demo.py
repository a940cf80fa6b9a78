"""`pdd demo --backend vllm`: the PDD graph with vLLM behind Prefill, Relay and Main decode
(graphs/pdd_vllm.yaml), checked against vLLM's own single-engine greedy generate.

Deploys the graph on the local two-site cluster, streams requests all at once through P-MD and
P-RLD-MD in both handoff modes (so vLLM's chunked prefill and decode mix in its batches), and
compares every stream with one plain vLLM engine (no connector) that ran the same prompts, all in
flight together. Agreement with our torch engine is reported, not required (kernels differ).
Ends with a table and one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evaluations.demo import exposing_cache_hits
from pdd_serve.cluster.deploy import DeployError, deploy_graph, shutdown_serve
from pdd_serve.cluster.local import LocalClusterConfig, cluster_down, cluster_up, driver_env
from pdd_serve.config import ConfigError, load_graph_yaml

PATHS = ({"pipeline": "P-MD"}, {"pipeline": "P-RLD-MD", "handoff_mode": "one-shot"},
         {"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"})


def jobs(n: int, seed: int = 0, vocab: int = 2048) -> list[tuple[list[int], int, dict]]:
    """n cold prompts (200-1100 tokens), cycling through PATHS: 96 output tokens on P-MD, 256 and
    320 on the relay paths, long enough that the relay is still decoding when the prompt's KV has
    crossed the slow line (all 18 prompts' KV share it: ~4 s) even on a quiet machine, where the
    relay decodes fastest. A relay that finishes first hands nothing off."""
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randrange(200, 1100))], (96, 256, 320)[i % 3], PATHS[i % 3])
            for i in range(n)]


async def _stream(client: Any, url: str, prompt: list[int], n: int, pdd: dict) -> tuple[list[int], dict, str | None]:
    body = {"model": "pdd-small", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True, "pdd": pdd}
    ids: list[int] = []
    info: dict = {}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                return ids, info, f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    obj = json.loads(line[6:])
                    if obj.get("choices"):
                        ids += obj["choices"][0].get("token_ids", [])
                    info = obj.get("pdd", info)
    except Exception as e:  # noqa: BLE001 - reported per request
        return ids, info, f"{type(e).__name__}: {e}"
    return ids, info, None


async def _drive(url: str, work: list[tuple[list[int], int, dict]]) -> list[tuple[list[int], dict, str | None]]:
    import httpx

    async with httpx.AsyncClient() as client:
        return await asyncio.gather(*(_stream(client, url, p, n, d) for p, n, d in work))


Job = tuple[list[int], int, dict]


def references(model_path: str, work: list[Job], then: Callable[[list[list[int]]], list[Job]] | None = None,
               ) -> tuple[list[Job], list[list[int]], list[list[int]]]:
    """(jobs, vLLM's single-engine greedy output, our torch engine's) for every job, all prompts in
    flight at once in the one engine; `then(answers)` builds a second wave on the first's answers."""
    from pdd_serve.engine.engine import Engine
    from pdd_serve.engine.sampling import SamplingParams
    from pdd_serve.engine.vllm.engine import VllmEngine

    ref = VllmEngine(model_path, connector=False, engine_args={"max_num_seqs": 64})
    teng = Engine.from_pretrained(model_path)

    def run(wave: list[Job]) -> tuple[list[list[int]], list[list[int]]]:
        prompts = [p for p, _, _ in wave]
        params = [SamplingParams(n, ignore_eos=True) for _, n, _ in wave]
        return ref.generate_batch(prompts, params), teng.generate_batch(prompts, params)

    vllm_out, torch_out = run(work)
    if then is not None:
        wave = then(vllm_out)
        v2, t2 = run(wave)
        work, vllm_out, torch_out = work + wave, vllm_out + v2, torch_out + t2
    return work, vllm_out, torch_out


def next_turns(work: list[tuple[list[int], int, dict]], outputs: list[list[int]], k: int = 3, seed: int = 1,
               vocab: int = 2048) -> list[tuple[list[int], int, dict]]:
    """Second turns of the first k conversations (prompt + its answer + new text), sent P-MD once the
    first wave is done: main decode's DRC (vLLM's own prefix cache) holds their first turn."""
    rng = random.Random(seed)
    return [(p + out + [rng.randrange(3, vocab) for _ in range(48)], 64, {"pipeline": "P-MD"})
            for (p, _, _), out in zip(work[:k], outputs[:k])]


def handoff_bytes(n_tokens: int, vocab: int) -> int:
    """Bytes of a handoff of n token ids as Ray serializes the call, plus Serve's request metadata."""
    from evaluations.bench.transport import handoff_message

    return handoff_message(n_tokens, vocab)["total"]


def run_vllm_demo(graph: str = "graphs/pdd_vllm.yaml", requests: int = 18, keep: bool = False,
                  log: Any = print) -> int:
    path = Path(graph)
    if not path.is_file():
        raise DeployError(f"{graph} not found: run from the repository root or pass --graph PATH")
    try:
        cfg = load_graph_yaml(path)
    except ConfigError as e:
        raise DeployError(str(e)) from None
    backends = {cfg.engine_for(r).backend for r in ("prefill", "relay", "main_decode")}
    if backends != {"vllm"}:
        raise DeployError(f"{graph} runs backend(s) {sorted(backends)}: --backend vllm needs backend: vllm on every engine")
    from pdd_serve.checkpoints import resolve_model
    from pdd_serve.engine.model import ModelArgs

    model = str(resolve_model(cfg.model.path))
    margs = ModelArgs.from_checkpoint(model)
    first = jobs(requests, vocab=margs.vocab_size)
    log(f"reference: {requests} prompts in flight at once in one plain vLLM engine (and our torch engine) ...")
    t0 = time.monotonic()
    # a turn 2 is built on vLLM's turn-1 answer (the graph must give the same one to match it)
    work, ref_vllm, ref_torch = references(model, first, lambda out: next_turns(first, out, vocab=margs.vocab_size))
    turn2 = work[len(first):]
    log(f"  done in {time.monotonic() - t0:.0f} s")
    ccfg = LocalClusterConfig()
    log("starting the local two-site cluster (site a: prefill + relay, site b: main decode) ...")
    cluster_up(ccfg, log=log)
    env = driver_env(ccfg)
    try:
        url = deploy_graph(exposing_cache_hits(path), env, log=log)
        log(f"streaming {requests} requests at once: {', '.join(json.dumps(p) for p in PATHS)} in turn")
        t0 = time.monotonic()
        results = asyncio.run(_drive(url, first))
        time.sleep(1.0)  # the routers' background view of the MDs' caches catches up
        log(f"then {len(turn2)} second turns, P-MD: main decode's DRC (vLLM's prefix cache) holds their first turn")
        results += asyncio.run(_drive(url, turn2))
        wall = time.monotonic() - t0
        if keep:
            log(f"\nleft serving at {url}; stop with: pdd cluster down")
    finally:
        if not keep:
            shutdown_serve(env)
            cluster_down(ccfg)
            log("cluster torn down")

    bpt = 2 * margs.num_layers * margs.num_kv_heads * margs.head_dim * 4  # float32 KV bytes per token
    rows = []
    for (prompt, _n, want), (ids, info, err), rv, rt in zip(work, results, ref_vllm, ref_torch):
        mode = info.get("handoff_mode", "none")
        handed = info.get("eager_tokens", 0) if mode != "none" else 0
        rows.append({"pipeline": info.get("pipeline", "?"), "want": want, "handoff_mode": mode, "prompt": len(prompt),
                     "tokens": len(ids), "identical": ids == rv, "torch_identical": ids == rt, "error": err,
                     "eager": info.get("eager_tokens", 0), "batches": info.get("handoff_batches", 0),
                     "wan_bytes": info.get("wan_bytes", 0), "handed": handed,
                     "hit_md": info.get("prefix_hit_md", 0.0)})
    print(f"\n{'#':>3} {'pipeline':<9}{'mode':<10}{'prompt':>7}{'tokens':>7}{'eager':>6}{'batches':>8}"
          f"{'WAN KB':>8}  vs vLLM  vs torch")
    for i, r in enumerate(rows):
        print(f"{i:>3} {r['pipeline']:<9}{r['handoff_mode']:<10}{r['prompt']:>7}{r['tokens']:>7}{r['eager']:>6}"
              f"{r['batches']:>8}{r['wan_bytes'] / 1e3:>8.0f}  {'same' if r['identical'] else 'DIFF':<8} "
              f"{'same' if r['torch_identical'] else 'diff'}{'  ' + r['error'] if r['error'] else ''}")
    handoffs = [r for r in rows if r["handed"]]
    hand_b = sum(handoff_bytes(r["handed"], margs.vocab_size) for r in handoffs)
    hand_kv = sum(r["handed"] * bpt for r in handoffs)
    second = rows[len(first):]
    out = {
        "demo": "vllm", "backend": "vllm", "reference": "vllm", "dtype": "float32",
        "concurrent_requests": len(first),
        "handoff_modes": sorted({r["handoff_mode"] for r in rows} - {"none"}),
        "outputs_identical": all(r["identical"] and not r["error"] for r in rows),
        "mismatches": sum(not r["identical"] for r in rows),
        "agree_with_torch_engine": sum(r["torch_identical"] for r in rows),
        "pipelines": dict(Counter(r["pipeline"] for r in rows)),
        "pipelines_as_asked": sum(r["pipeline"] == r["want"]["pipeline"] for r in rows),
        "handoff_payload_ratio": hand_b / hand_kv if hand_kv else None,
        "handoff_bytes": hand_b, "handoff_kv_bytes": hand_kv,
        "kv_bytes_cross_site": sum(r["wan_bytes"] for r in rows),
        # the second turns: share of each prompt main decode's DRC held, and KV bytes it did not need
        "drc_second_turns": len(second),
        "drc_prefix_hit_md": [round(r["hit_md"], 3) for r in second],
        "drc_wan_bytes": sum(r["wan_bytes"] for r in second),
        "drc_wan_bytes_saved": sum(round(r["hit_md"] * r["prompt"]) * bpt for r in second),
        "errors": sum(1 for r in rows if r["error"]), "wall_s": round(wall, 1),
        "graph": str(graph),
    }
    print(json.dumps(out))
    return 0 if out["outputs_identical"] else 1
