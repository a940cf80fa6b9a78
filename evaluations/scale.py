"""`pdd scale`: ramp the offered load until Serve's autoscaler adds a second MainDecode replica,
and measure what the system delivers before and after.

One deployment of a graph (graphs/pdd.yaml: `MainDecode` autoscales 1..2 on ongoing requests,
target 4 per replica) on the local two-site cluster, one open-loop Poisson stream of independent
requests (a shared system prompt, warmed into the caches first, plus fresh tokens; greedy,
`return_token_ids`, `ignore_eos`). The offered rates are calibrated on the machine they run on
(a fixed rate that scales MD on a busy box leaves it at one replica on a quiet one):

  probe   target_ongoing_requests clients in a closed loop for `probe_s` against the graph
          with MainDecode fixed at one replica: the throughput is `capacity_rps`, the offered
          rate at which the graph holds the autoscaling target in flight (Little's law), measured
          at that load on this machine. rate_before = `load_before` x capacity (under the
          target), rate_after = `load_after` x capacity (past it: Serve adds a replica),
          unless given
  before  `rate_before` req/s for `before_s`: what one MD replica serves
  ramp    `rate_after` req/s until Serve reports a 2nd RUNNING MainDecode replica (`scale_up_s`
          after the ramp starts), or `ramp_timeout_s` (an error that says what was measured)
  after   `rate_after` req/s for `after_s` with 2 replicas

A sampler process reads the MainDecode replica count (`serve.status()`, and the replica actors by
`replica_actors`) every `sample_s` and each replica's running sequences (its `stats`, through a
pinned handle) every other sample. A request belongs to the phase it was sent in; per phase:
TTFT and ITL percentiles (ITL: every inter-token gap, pooled), SLA attainment and SLA goodput
(SLA-meeting requests per second of the phase's send window, loadgen's `SLA.meets`), requests per
MD replica (the response's `pdd.md_replica`).

`goodput_after_vs_before` = goodput(after: rate_after, 2 replicas) / goodput(before: rate_before,
1 replica): how much more SLA-meeting work the system delivers once it scaled under the higher
load (the offered rates are in the JSON, so the ratio can be read against rate_after/rate_before).
`--control` also offers rate_after to the same graph pinned at one MD replica, for as long as the
after phase (`goodput_after_vs_one_replica`: what the second replica bought at the same load).

Correctness: every request's streamed token ids against one reference engine's greedy output
(`outputs_identical`); `tokens_lost` counts requests that ended in an error or whose token ids are
not exactly `max_tokens` long. The config and the figures made from the records (no cluster) are in
scale_parts.py; this module drives the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import glob
import json
import math
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from evaluations.harness import (
    EvalError,
    PreparedGraph,
    code_fingerprint,
    engine_params,
    eval_cluster,
    link_params,
    log_err,
    policy_params,
    prepare_graphs,
)
from evaluations.loadgen import RequestRecord, stream_completion
from evaluations.scale_parts import (
    Sample,
    ScaleConfig,
    ScaleRecord,
    calibrate,
    compare_outputs,
    headline,
    phase_metrics,
    phase_table,
    tokens_lost,
)
from evaluations.workloads import Turn, fresh_tokens

DEPLOYMENT = "MainDecode"
# ---------------------------------------------------------------- the cluster side


def sample_replicas(app: str, with_seqs: bool, handles: dict[str, Any]) -> dict[str, Any]:
    """One sample of MainDecode (in a Ray driver): RUNNING replicas and all replicas by
    serve.status(), replica actors by `replica_actors`, and (with_seqs) each replica's running
    sequences from its `stats` through a handle pinned to it."""
    from ray import serve

    from pdd_serve.serve.pinning import pinned_handle, replica_actors

    st = serve.status().applications.get(app)
    dep = st.deployments.get(DEPLOYMENT) if st is not None else None
    states = {str(getattr(k, "value", k)): v for k, v in (dep.replica_states if dep else {}).items()}
    actors = replica_actors(app, DEPLOYMENT)
    seqs = None
    if with_seqs:
        seqs = {}
        for rid in sorted(actors):
            h = handles.get(rid) or pinned_handle(app, DEPLOYMENT, rid)
            handles[rid] = h
            try:
                rs = h.stats.remote().result(timeout_s=3)
            except Exception:  # noqa: BLE001 - a replica starting or going: no figure this time
                continue
            if rs.extra.get("replica", rid) == rid:  # else another answered: this one isn't running (yet)
                seqs[rid[:8]] = int(rs.running)
    return {"t": time.monotonic(), "running": states.get("RUNNING", 0), "replicas": sum(states.values()),
            "actors": len(actors), "seqs": seqs, "ongoing": serve_ongoing(app)}


def serve_ongoing(app: str) -> float | None:
    """MainDecode's ongoing requests as Serve's autoscaler reads them (the controller's window
    aggregate: queued at handles + running, over look_back_period_s), or None where this Ray has
    no such call. Every call about a request that is in flight counts (prepare, KV wait, handoff
    batches, the decode stream, and what waits at a handle), so it runs above MD's own count of
    the requests it holds. Reported beside the phases' figures (what the autoscaler acted on);
    the calibration itself uses the probe's closed-loop throughput. None for a deployment that is
    not autoscaled (Serve keeps no such window for it; its 0.0 would read as "idle")."""
    import ray

    try:
        from ray.serve._private.common import DeploymentID
        from ray.serve.context import _get_global_client

        ctl = _get_global_client()._controller
        if not ray.get(ctl._should_autoscale_deployment_for_testing.remote(DeploymentID(DEPLOYMENT, app)), timeout=3):
            return None
        ref = ctl._get_total_num_requests_for_deployment_for_testing.remote(DeploymentID(DEPLOYMENT, app))
        return float(ray.get(ref, timeout=3))
    except Exception:  # noqa: BLE001 - a private call (Serve's own tests use it): absent, no figure
        return None


def _sampler_main(app: str, period_s: float) -> None:
    """`python -m evaluations.scale APP PERIOD`: a Ray driver printing one JSON sample per period
    until killed (its own process, so the evaluation's process never holds Serve handles, whose
    background threads outlive the cluster)."""
    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level="error", log_to_driver=False)
    handles: dict[str, Any] = {}
    i = 0
    while True:
        t = time.monotonic()
        try:
            line = json.dumps(sample_replicas(app, i % 2 == 0, handles))
        except Exception as e:  # noqa: BLE001 - reported by the parent, sampling goes on
            line = json.dumps({"error": f"{type(e).__name__}: {e}"[:300]})
        print(line, flush=True)
        i += 1
        time.sleep(max(0.0, period_s - (time.monotonic() - t)))


class ReplicaSampler:
    """The MainDecode replica count (and every other time each replica's running sequences) every
    `period_s`, from a sampler process (`_sampler_main`) read by a thread."""

    def __init__(self, app: str, period_s: float, denv: Mapping[str, str]) -> None:
        self.app, self.period_s, self.denv = app, period_s, dict(denv)
        self.t0 = time.monotonic()
        self.samples: list[Sample] = []
        self.errors: list[str] = []
        self._proc: Any = None
        self._thread = threading.Thread(target=self._read, name="pdd-scale-sampler", daemon=True)

    @property
    def running(self) -> int:
        return self.samples[-1].running if self.samples else 0

    def start(self, ready_timeout_s: float = 90.0) -> ReplicaSampler:
        """Start the sampler process and wait for its first sample."""
        import subprocess
        import sys

        env = {**os.environ, **self.denv}
        if self.denv:
            env.pop("RAY_AUTH_TOKEN", None)
        root = Path(__file__).resolve().parents[1]
        self._proc = subprocess.Popen([sys.executable, "-m", "evaluations.scale", self.app, str(self.period_s)],
                                      cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True)
        self._thread.start()
        deadline = time.monotonic() + ready_timeout_s
        while not self.samples and time.monotonic() < deadline and self._proc.poll() is None:
            time.sleep(0.2)
        if not self.samples:
            self.stop()
            raise EvalError(f"the replica sampler (serve.status() in a driver) gave no sample in {ready_timeout_s:.0f}s"
                            + (f": {self.errors[-1]}" if self.errors else ""))
        return self

    def restart_clock(self) -> None:
        """Sample times count from now (the load's start); earlier samples are dropped."""
        self.t0 = time.monotonic()
        self.samples = self.samples[-1:]  # the latest (taken before the start) stands until the next
        for x in self.samples:
            x.t_s = 0.0

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if "error" in d:
                self.errors.append(d["error"])
                continue
            self.samples.append(Sample(d["t"] - self.t0, d["running"], d["replicas"], d["actors"], d["seqs"],
                                       d.get("ongoing")))

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except Exception:  # noqa: BLE001 - it would not stop: kill it
                self._proc.kill()
                self._proc.wait(timeout=15)
        self._thread.join(timeout=15)


def autoscaler_log(temp_dir: str = "/tmp/pdd-ray-*", limit: int = 12) -> list[str]:
    """Serve's autoscaling decisions for MainDecode from the newest controller log under `temp_dir`
    (a glob: the local cluster's Ray temp dir, /tmp/pdd-ray-PORT)."""
    logs = sorted(glob.glob(f"{temp_dir}/session_latest/logs/serve/controller_*.log"), key=os.path.getmtime)
    if not logs:
        return []
    lines = []
    with contextlib.suppress(OSError):
        for line in Path(logs[-1]).read_text(errors="replace").splitlines():
            low = line.lower()
            if DEPLOYMENT.lower() in low and ("scaling" in low or "autoscal" in low or "target" in low):
                lines.append(line.strip()[:300])
    return lines[-limit:]


class Offer:
    """Open-loop Poisson arrivals of independent requests at a rate the phase sets."""

    def __init__(self, url: str, cfg: ScaleConfig, system: tuple[int, ...], rng: random.Random,
                 log: Callable[[str], None]) -> None:
        self.url, self.cfg, self.system, self.rng, self.log = url, cfg, system, rng, log
        self.records: list[ScaleRecord] = []
        self.n = 0

    def _new(self, phase: str, t_s: float) -> tuple[ScaleRecord, Turn]:
        prompt = list(self.system) + list(fresh_tokens(self.rng, self.cfg.prompt_tokens))
        turn = Turn(tuple(prompt), self.cfg.max_tokens, "sweep")
        rec = RequestRecord(f"{phase}-{self.n}", 0, "scale", len(prompt), None, self.cfg.max_tokens, t_s)
        self.n += 1
        sr = ScaleRecord(phase, prompt, rec)
        self.records.append(sr)
        return sr, turn

    async def run(self, client: Any, t0: float, phase_of: Callable[[float], tuple[str, float] | None]) -> None:
        """Send until `phase_of(now)` returns None; `phase_of` gives the phase and its rate."""
        tasks: set[asyncio.Task] = set()
        next_t = 0.0
        current = None
        while True:
            now = time.monotonic() - t0
            ph = phase_of(now)
            if ph is None:
                break
            phase, rate = ph
            if phase != current:  # a new rate starts now
                current, next_t = phase, now
            if now >= next_t:
                sr, turn = self._new(phase, now)
                t = asyncio.create_task(stream_completion(client, self.url, sr.prompt, turn, sr.rec, self.cfg.load))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                next_t += self.rng.expovariate(rate)
            await asyncio.sleep(max(0.0, min(0.1, next_t - now)))
        if tasks:
            await asyncio.gather(*list(tasks))


def _progress_line(t: float, phase: str, offer: Offer, sampler: ReplicaSampler) -> str:
    last = sampler.samples[-1] if sampler.samples else None
    seqs = next((x.seqs for x in reversed(sampler.samples) if x.seqs is not None), None)
    done = sum(1 for s in offer.records if s.rec.e2e_s is not None or s.rec.error)
    return (f"  t={t:5.0f}s {phase:<7} sent {len(offer.records):4d}, done {done:4d}, in flight "
            f"{len(offer.records) - done:3d} | MD replicas running {last.running if last else '?'}"
            f" (of {last.replicas if last else '?'}), running seqs {seqs if seqs is not None else '?'}")


def drive_phases(url: str, sampler: ReplicaSampler, cfg: ScaleConfig, system: tuple[int, ...], rng: random.Random,
                 log: Callable[[str], None], control: bool = False) -> dict[str, Any]:
    """Offer the load through the phases (or, `control`, rate_after for after_s); returns the records,
    the samples, each phase's send window and scale_up_s."""
    import httpx

    t0 = time.monotonic()
    sampler.restart_clock()
    windows: dict[str, list[float]] = {}
    state: dict[str, Any] = {"scale_up_s": None, "timeout": False, "last_log": 0.0}
    offer = Offer(url, cfg, system, rng, log)

    def phase_of(now: float) -> tuple[str, float] | None:
        if control:
            ph = "control" if now < cfg.after_s else None
        elif now < cfg.before_s:
            ph = "before"
        elif "after" not in windows:
            ramp_start = windows.setdefault("ramp", [now, now])[0]
            if sampler.running >= 2:
                state["scale_up_s"] = now - ramp_start
                ph = "after"
                log(f"  2nd MainDecode replica RUNNING {now - ramp_start:.1f}s after the ramp started")
            elif now - ramp_start > cfg.ramp_timeout_s:
                state["timeout"] = True
                ph = None
            else:
                ph = "ramp"
        else:
            ph = "after" if now - windows["after"][0] < cfg.after_s else None
        if ph is None:
            return None
        w = windows.setdefault(ph, [now, now])
        w[1] = now
        if cfg.progress and now - state["last_log"] >= 10:
            state["last_log"] = now
            log(_progress_line(now, ph, offer, sampler))
        return ph, (cfg.rate_before if ph == "before" else cfg.rate_after)

    async def main() -> None:
        limits = httpx.Limits(max_connections=cfg.load.max_connections, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=cfg.load.timeout_s) as client:
            await offer.run(client, t0, phase_of)

    asyncio.run(main())
    return {"records": offer.records, "samples": sampler.samples, "windows": {k: tuple(v) for k, v in windows.items()},
            "scale_up_s": state["scale_up_s"], "timeout": state["timeout"], "sampler_errors": sampler.errors}


def probe_capacity(url: str, sampler: ReplicaSampler, cfg: ScaleConfig, system: tuple[int, ...],
                   rng: random.Random, log: Callable[[str], None], clients: int) -> dict[str, Any]:
    """`clients` in a closed loop for `probe_s` against the graph with MainDecode fixed at one
    replica, then drained: returns the records, the samples, the window and the calibration."""
    import httpx

    log(f"probe: {clients} clients in a closed loop for {cfg.probe_s:.0f}s on one fixed MainDecode replica "
        "(calibrates the offered rates to this machine) ...")
    sampler.restart_clock()
    offer = Offer(url, cfg, system, rng, log)
    t0 = time.monotonic()

    async def client_loop(client: Any) -> None:
        while time.monotonic() - t0 < cfg.probe_s:
            sr, turn = offer._new("probe", time.monotonic() - t0)
            await stream_completion(client, url, sr.prompt, turn, sr.rec, cfg.load)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=cfg.load.timeout_s) as client:
            await asyncio.gather(*(client_loop(client) for _ in range(clients)))

    asyncio.run(main())
    span = time.monotonic() - t0
    seqs = [sum(x.seqs.values()) for x in sampler.samples if x.seqs and x.t_s <= span]
    done = sum(1 for r in offer.records if not r.rec.error)
    calib = calibrate(done, span, clients, cfg, sum(seqs) / len(seqs) if seqs else None)
    log(f"  probe: {done} requests in {span:.0f}s, {calib['probe_latency_s']:.2f}s each: {clients} in flight at "
        f"capacity_rps {calib['capacity_rps']:.2f} (MD holding {calib['probe_md_seqs_mean']} on average) -> "
        f"rate_before {calib['rate_before']:.2f}, rate_after {calib['rate_after']:.2f} req/s")
    return {"records": offer.records, "samples": list(sampler.samples), "windows": {"probe": (0.0, span)},
            "calibration": calib}


def _md_autoscaling_checked(graph: PreparedGraph) -> dict[str, Any]:
    auto = _md_autoscaling(graph)
    if not isinstance(auto, dict) or "max_replicas" not in auto:
        raise EvalError(f"{graph.source}: MainDecode has no autoscaling_config ({auto}); pdd scale needs one that "
                        "reaches 2 replicas")
    return auto


def _fixed_one_replica(graph: PreparedGraph, out: Path) -> Path:
    """The same graph with MainDecode at num_replicas: 1 (the control)."""
    import yaml

    doc = copy.deepcopy(yaml.safe_load(graph.path.read_text()))
    for d in doc["applications"][0].get("deployments", []):
        if d.get("name") == DEPLOYMENT:
            d.pop("autoscaling_config", None)
            d["num_replicas"] = 1
    out.write_text(f"# {graph.path} with MainDecode fixed at one replica (pdd scale --control)\n"
                   + yaml.safe_dump(doc, sort_keys=False))
    return out


def _app_name(graph: PreparedGraph) -> str:
    import yaml

    return yaml.safe_load(graph.path.read_text())["applications"][0]["name"]


def _warm(url: str, cfg: ScaleConfig, system: tuple[int, ...], rng: random.Random, log: Callable[[str], None]) -> None:
    """The shared system prompt into Prefill's cache and MD's, and the engines' first steps done."""
    import httpx

    if not system:
        return

    async def go() -> list[RequestRecord]:
        async with httpx.AsyncClient(timeout=cfg.load.timeout_s) as client:
            recs = []
            for i in range(2):
                prompt = list(system) + list(fresh_tokens(rng, cfg.prompt_tokens))
                rec = RequestRecord(f"warm-{i}", 0, "warmup", len(prompt), None, 16)
                await stream_completion(client, url, prompt, Turn(tuple(prompt), 16, "warmup"), rec, cfg.load)
                recs.append(rec)
            return recs

    bad = [r for r in asyncio.run(go()) if r.error]
    if bad:
        log(f"warning: {len(bad)} warm-up request(s) failed, e.g. {bad[0].error}")
    time.sleep(2.0)


def reference_outputs(records: Sequence[ScaleRecord], max_tokens: int, batch: int = 32) -> list[list[int]]:
    """One engine's greedy output for every request's prompt."""
    from pdd_serve.checkpoints import default_model_path
    from pdd_serve.engine import Engine, SamplingParams

    eng = Engine.from_pretrained(default_model_path())
    out: list[list[int]] = []
    prompts = [s.prompt for s in records]
    for i in range(0, len(prompts), batch):
        out.extend(eng.generate_batch(prompts[i:i + batch], SamplingParams(max_tokens, ignore_eos=True)))
    return out


def run_scale(cfg: ScaleConfig = ScaleConfig(), log: Callable[[str], None] = log_err) -> dict[str, Any]:
    """Run the evaluation; print the table and the JSON line; return {phases, headline, ...}."""
    from pdd_serve.cluster.deploy import DeployError, deploy_graph, shutdown_serve

    out_dir = Path(cfg.out_dir or f".pdd/eval/{cfg.experiment}-{time.strftime('%Y%m%d-%H%M%S')}")
    (graph,) = prepare_graphs([cfg.graph], out_dir / "graphs", cfg.env.http_port, cfg.link)
    app = _app_name(graph)
    tracker = None
    if cfg.mlflow:
        from evaluations.tracking import Tracker

        tracker = Tracker(cfg.tracking_uri, cfg.experiment)  # a bad store fails before the long run
    rng = random.Random(f"scale:{cfg.seed}")
    system = fresh_tokens(rng, cfg.system_tokens)
    rates = (f"{cfg.rate_before or 'calibrated'} req/s for {cfg.before_s:.0f}s, then "
             f"{cfg.rate_after or 'calibrated'} req/s")
    log(f"pdd scale: {graph.source}, {rates} "
        f"until a 2nd MainDecode replica runs (<= {cfg.ramp_timeout_s:.0f}s) and {cfg.after_s:.0f}s more; "
        f"prompts {cfg.system_tokens}+{cfg.prompt_tokens} tokens, {cfg.max_tokens} out")
    fingerprint = code_fingerprint()
    runs: dict[str, dict[str, Any]] = {}
    t_all = time.monotonic()
    with eval_cluster(cfg.env, log) as denv:
        auto = _md_autoscaling_checked(graph)
        target = float(auto.get("target_ongoing_requests", 2))  # Serve's default
        one_md = _fixed_one_replica(graph, out_dir / "graphs" / f"{graph.name}-one-md.yaml")
        try:
            shutdown_serve(denv)
            if cfg.rate_before is None or cfg.rate_after is None:  # calibrate on this machine, now
                url = deploy_graph(one_md, denv, timeout_s=cfg.env.deploy_timeout_s, log=log)
                sampler = ReplicaSampler(app, cfg.sample_s, denv).start()
                try:
                    _warm(url, cfg, system, rng, log)
                    runs["probe"] = probe_capacity(url, sampler, cfg, system, rng, log, max(1, math.ceil(target)))
                finally:
                    sampler.stop()
                calib = runs["probe"]["calibration"]
                shutdown_serve(denv)
            else:
                calib = {"capacity_rps": None, "calibrated": []}
            calib["target_ongoing_requests"] = target
            cfg = dataclasses.replace(cfg, rate_before=calib.get("rate_before", cfg.rate_before),
                                      rate_after=calib.get("rate_after", cfg.rate_after))
            url = deploy_graph(graph.path, denv, timeout_s=cfg.env.deploy_timeout_s, log=log)
        except DeployError as e:
            raise EvalError(str(e)) from None
        sampler = ReplicaSampler(app, cfg.sample_s, denv).start()
        try:
            _warm(url, cfg, system, rng, log)
            log(f"offering {cfg.rate_before} req/s, then {cfg.rate_after} req/s (progress every 10 s) ...")
            runs["scale"] = drive_phases(url, sampler, cfg, system, rng, log)
        finally:
            sampler.stop()
        try:
            shutdown_serve(denv)
        except DeployError as e:
            raise EvalError(str(e)) from None
        if runs["scale"]["timeout"]:
            raise EvalError(_no_scale_up_message(runs["scale"], cfg))
        if cfg.control:
            try:
                url = deploy_graph(one_md, denv, timeout_s=cfg.env.deploy_timeout_s, log=log)
                sampler = ReplicaSampler(app, cfg.sample_s, denv).start()
                try:
                    _warm(url, cfg, system, rng, log)
                    log(f"control: {cfg.rate_after} req/s for {cfg.after_s:.0f}s on one fixed MainDecode replica ...")
                    runs["control"] = drive_phases(url, sampler, cfg, system, rng, log, control=True)
                finally:
                    sampler.stop()
                shutdown_serve(denv)
            except DeployError as e:
                raise EvalError(str(e)) from None
    log(f"load done in {time.monotonic() - t_all:.0f}s; checking every output against a reference engine ...")
    records = [r for run in runs.values() for r in run["records"]]
    samples = runs["scale"]["samples"]
    expected = reference_outputs(records, cfg.max_tokens)
    identical, mismatched, examples = compare_outputs(records, expected)
    for e in examples:
        log(f"output mismatch: {e}")
    phases: dict[str, dict[str, Any]] = {}
    for run in runs.values():
        for ph, (a, b) in run["windows"].items():
            rate = {"before": cfg.rate_before, "probe": calib.get("capacity_rps")}.get(ph, cfg.rate_after)
            phases[ph] = phase_metrics(run["records"], ph, max(b - a, 1e-9), cfg.sla, rate, run["samples"], (a, b))
    head = headline(phases, samples, runs["scale"]["scale_up_s"], tokens_lost(records, cfg.max_tokens),
                    identical, mismatched, cfg)
    head.update({k: v for k, v in calib.items() if k not in head})
    head["code_fingerprint"] = fingerprint
    head["autoscaling_config"] = _md_autoscaling(graph)
    if runs["scale"]["sampler_errors"]:
        log(f"warning: {len(runs['scale']['sampler_errors'])} replica samples failed, e.g. "
            f"{runs['scale']['sampler_errors'][0]}")
    _write_artifacts(out_dir, records, samples, phases, head)
    if tracker is not None:
        run_id = _log_mlflow(tracker, graph, cfg, phases, head, out_dir)
        log(f"logged to MLflow {tracker.uri}, experiment {cfg.experiment} (run {run_id})")
    log(f"artifacts in {out_dir}")
    print(phase_table(phases), flush=True)
    log(f"  goodput_after_vs_before = {head['goodput_after_vs_before']} (offered load x{head['offered_load_ratio']:.2f}; "
        f"{head['goodput_after_vs_before_def']})")
    print(json.dumps(head), flush=True)
    return {"phases": phases, "headline": head, "records": records, "samples": samples, "out_dir": out_dir}


def _md_autoscaling(graph: PreparedGraph) -> Any:
    import yaml

    for d in yaml.safe_load(graph.path.read_text())["applications"][0].get("deployments", []):
        if d.get("name") == DEPLOYMENT:
            return d.get("autoscaling_config") or {"num_replicas": d.get("num_replicas", 1)}
    return None


def _no_scale_up_message(run: Mapping[str, Any], cfg: ScaleConfig) -> str:
    samples: list[Sample] = run["samples"]
    a, _ = run["windows"].get("ramp", (cfg.before_s, cfg.before_s))
    ramp = [x for x in samples if x.t_s >= a]
    seqs = [sum(x.seqs.values()) for x in ramp if x.seqs]
    per = [x.seqs for x in ramp if x.seqs][-3:]
    recs = [s.rec for s in run["records"] if s.phase == "ramp"]
    lines = [f"MainDecode never reached 2 RUNNING replicas in {cfg.ramp_timeout_s:.0f}s at {cfg.rate_after} req/s.",
             f"  measured in the ramp: replicas running max {max((x.running for x in ramp), default=0)}, "
             f"reported by Serve max {max((x.replicas for x in ramp), default=0)}, replica actors max "
             f"{max((x.actors for x in ramp), default=0)}; running sequences on MD mean "
             f"{(sum(seqs) / len(seqs)) if seqs else float('nan'):.1f}, max {max(seqs, default=0)} "
             f"(last per replica: {per}); {len(recs)} requests sent, {sum(1 for r in recs if r.error)} errors, "
             f"pipelines {dict(Counter(r.pdd.get('pipeline') for r in recs if not r.error))}",
             "  Serve's controller log (autoscaling lines for MainDecode):"]
    td = "/tmp/pdd-ray-*" if cfg.env.use_running_cluster else f"/tmp/pdd-ray-{cfg.env.cluster_port}"
    lines += [f"    {x}" for x in autoscaler_log(td)] or [f"    (none found under {td}/session_latest/logs/serve/)"]
    lines.append("  raise --rate-after or --max-tokens (more requests decoding at once), or --ramp-timeout")
    return "\n".join(lines)


def _write_artifacts(out_dir: Path, records: Sequence[ScaleRecord], samples: Sequence[Sample],
                     phases: Mapping[str, Any], head: Mapping[str, Any]) -> None:
    from evaluations.report import record_rows, write_parquet

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for s in records:
        (row,) = record_rows([s.rec], graph="scale")
        row["phase"] = s.phase
        rows.append(row)
    write_parquet(rows, out_dir / "requests.parquet")
    (out_dir / "replicas.json").write_text(json.dumps([x.__dict__ for x in samples]))
    (out_dir / "summary.json").write_text(json.dumps({"phases": phases, "headline": head}, indent=2, default=str))


def _log_mlflow(tracker: Any, graph: PreparedGraph, cfg: ScaleConfig, phases: Mapping[str, Mapping[str, Any]],
                head: Mapping[str, Any], out_dir: Path) -> str:
    from evaluations.compare import git_commit
    from evaluations.tracking import flat_metrics

    run = tracker.start(f"scale {graph.name} {cfg.rate_before}->{cfg.rate_after} req/s", tags={"kind": "scale"})
    params = {"graph": graph.name, "graph_file": str(graph.source), "rate_before": cfg.rate_before,
              "rate_after": cfg.rate_after, "before_s": cfg.before_s, "after_s": cfg.after_s,
              "ramp_timeout_s": cfg.ramp_timeout_s, "system_tokens": cfg.system_tokens,
              "prompt_tokens": cfg.prompt_tokens, "max_tokens": cfg.max_tokens, "control": cfg.control,
              "seed": cfg.seed, "sla.ttft_s": cfg.sla.ttft_s, "sla.tpot_s": cfg.sla.tpot_s,
              "md.autoscaling_config": json.dumps(head.get("autoscaling_config")), "git_commit": git_commit(),
              "code_fingerprint": head.get("code_fingerprint", ""),
              "rates_calibrated": ",".join(head.get("calibrated") or []) or "none",
              "load_before": cfg.load_before, "load_after": cfg.load_after, "probe_s": cfg.probe_s,
              **link_params(graph), **policy_params(graph.cfg), **engine_params(graph.cfg)}
    metrics = {k: v for k, v in head.items() if isinstance(v, (int, float))}
    for name, p in phases.items():
        metrics.update(flat_metrics({k: v for k, v in p.items() if k != "requests_per_md_replica"}, f"{name}."))
    try:
        tracker.log(run, params, metrics, [p for p in (out_dir / "requests.parquet", out_dir / "summary.json",
                                                       out_dir / "replicas.json", graph.path) if p.exists()])
        tracker.finish(run)
    except Exception:
        tracker.finish(run, ok=False)
        raise
    return run


__all__: Sequence[str] = ("ScaleConfig", "run_scale")  # the figures: scale_parts.py


if __name__ == "__main__":  # the replica sampler process (ReplicaSampler)
    import sys

    _sampler_main(sys.argv[1], float(sys.argv[2]))
