"""Running graphs for an evaluation: one local cluster (or a running one), each graph deployed in
turn with `serve run` from a private copy of its YAML (own HTTP port, the shared link), driven,
and shut down before the next."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evaluations.loadgen import LoadConfig, RequestRecord, drive
from evaluations.workloads import Workload
from pdd_serve.config import ConfigError, PDDConfig, load_graph_yaml
from pdd_serve.emulation.pacer import build_emulation

DEFAULT_GRAPHS = ("graphs/pd_same_dc.yaml", "graphs/pd_cross_dc.yaml", "graphs/pd_cross_dc_naive.yaml",
                  "graphs/pdd.yaml")
# the same four graphs for a cluster whose site b sits behind a kernel-shaped veth (`--shaped-link`)
SHAPED_GRAPHS = ("graphs/pd_same_dc.yaml", "cluster_configs/graphs/local-shaped-pd_cross_dc.yaml",
                 "cluster_configs/graphs/local-shaped-pd_cross_dc_naive.yaml",
                 "cluster_configs/graphs/local-shaped-pdd.yaml")
LINK_SOURCE = "graphs/pdd.yaml"  # the emulated WAN every cross-site graph is run on, unless --link


class EvalError(RuntimeError):
    """An evaluation could not run; the message says what to do."""


def log_err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class EvalEnv:
    """Where an evaluation runs. Not the defaults of `pdd cluster` (6390) or Serve (8000), so it
    can run beside a developer's cluster on the same machine."""

    cluster_port: int = 6420
    state_dir: str = ".pdd/eval-cluster"
    http_port: int = 8420
    use_running_cluster: bool = False  # RAY_ADDRESS (+ auth vars) from the environment
    keep_cluster: bool = False
    deploy_timeout_s: float = 600.0
    shaped_link: str | None = None  # `pdd cluster up --shaped-link` spec (root): site b behind a shaped veth

    def __post_init__(self) -> None:
        for k in ("cluster_port", "http_port"):
            v = getattr(self, k)
            if not 1024 <= v <= 65535:
                raise ValueError(f"EvalEnv.{k} must be in 1024..65535, got {v}")
        if self.cluster_port == self.http_port:
            raise ValueError("EvalEnv: cluster_port and http_port must differ")


@contextlib.contextmanager
def eval_cluster(env: EvalEnv, log: Callable[[str], None] = log_err) -> Iterator[dict[str, str]]:
    """Yields the driver environment for `serve run`; Serve is shut down at the end either way."""
    from pdd_serve.cluster.deploy import shutdown_serve
    from pdd_serve.cluster.local import LocalClusterConfig, cluster_down, cluster_up, driver_env

    if env.use_running_cluster:
        if not os.environ.get("RAY_ADDRESS"):
            raise EvalError("--no-cluster needs a running cluster's driver environment: "
                            "eval \"$(pdd cluster env)\" (RAY_ADDRESS, RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH)")
        log(f"using the running cluster at {os.environ['RAY_ADDRESS']}")
        try:
            yield {}
        finally:
            shutdown_serve({})
        return
    cfg = LocalClusterConfig(port=env.cluster_port, state_dir=env.state_dir, shaped_link=env.shaped_link)
    log(f"starting a local two-site cluster on port {env.cluster_port} (state in {env.state_dir}) ...")
    info = cluster_up(cfg, log=log)
    denv = driver_env(cfg)
    try:
        yield denv
    finally:
        shutdown_serve(denv)
        if env.keep_cluster:
            log(f"cluster left running at {info.address} (stop: pdd cluster down --state-dir {env.state_dir})")
        else:
            cluster_down(cfg)
            log("cluster torn down")


def code_fingerprint() -> str:
    """A hash of the serving code and graphs (pdd_serve/**/*.py, graphs/*.yaml) as deployed now.
    Replicas import the working tree at deploy time; where others edit it concurrently, equal
    fingerprints before every deploy are what makes graphs of one comparison comparable."""
    import hashlib

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha1()
    for p in sorted([*(root / "pdd_serve").rglob("*.py"), *(root / "graphs").glob("*.yaml")]):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def parse_link(spec: str | None) -> Any:
    """`--link`: a preset name, or a YAML/JSON mapping like the graphs' `link:` (None: pdd.yaml's)."""
    import yaml

    if spec is None:
        return None
    try:
        v = yaml.safe_load(spec)
    except yaml.YAMLError as e:
        raise EvalError(f"--link {spec!r} is not a preset name or a YAML mapping: {e}") from None
    if not isinstance(v, (str, dict)):
        raise EvalError(f"--link {spec!r} must be a preset name or a mapping")
    return v


def default_link() -> Any:
    """graphs/pdd.yaml's `link:` (the repository's, else the working directory's)."""
    import yaml

    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        if (root / LINK_SOURCE).is_file():
            doc = yaml.safe_load((root / LINK_SOURCE).read_text())
            return doc["applications"][0]["args"]["link"]
    raise EvalError(f"{LINK_SOURCE} not found (it defines the default emulated link): pass --link")


@dataclass(frozen=True)
class PreparedGraph:
    name: str  # the graph's own label (args.graph): pd_same_dc | pd_cross_dc | pdd | ...
    source: Path
    path: Path  # the private copy that is deployed
    cfg: PDDConfig
    link: Any  # the link spec as written in the deployed YAML

    @property
    def cross_site(self) -> bool:
        return self.cfg.sites.prefill != self.cfg.sites.main_decode


def prepare_graphs(paths: Sequence[str | Path], out_dir: Path, http_port: int, link: Any = None,
                   stream_first_token: bool = False, emulate: Any = None) -> list[PreparedGraph]:
    """Private copies of the graph YAMLs: HTTP port `http_port`, every cross-site graph on the
    same link (`link`, else graphs/pdd.yaml's), one first-token convention for all (PD's by
    default: the first token leaves with the decoder's stream), and cache-hit facts in responses
    (measurement only). Validated as the Router would load them."""
    import dataclasses

    import yaml

    from pdd_serve.config import ServerConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    out: list[PreparedGraph] = []
    for p in map(Path, paths):
        repo_copy = Path(__file__).resolve().parents[1] / p
        if not p.is_file() and not p.is_absolute() and repo_copy.is_file():
            p = repo_copy  # graphs/*.yaml from outside the repository root
        if not p.is_file():
            raise EvalError(f"graph {p} not found: run from the repository root or pass --graphs PATH,...")
        try:
            doc = yaml.safe_load(p.read_text())
            load_graph_yaml(p)
        except (ConfigError, yaml.YAMLError) as e:
            raise EvalError(str(e)) from None
        doc = copy.deepcopy(doc)
        doc.setdefault("http_options", {})["port"] = http_port
        args = doc["applications"][0].setdefault("args", {})
        sites = args.get("sites") or {}
        cross = sites.get("prefill", "a") != sites.get("main_decode", "b")
        if cross:
            args["link"] = link if link is not None else default_link()
        args.setdefault("policy", {})["stream_first_token"] = stream_first_token
        if emulate is not None:  # an EmulatedScenario (evaluations/sim/emulated.py): chips per graph
            args["emulate"] = emulate.emulate_block(str(args.get("graph", p.stem)))
            args["time_scale"] = emulate.time_scale
            if emulate.context_scale != 1:
                args["context_scale"] = emulate.context_scale
            # the SLA's TPOT caps each decoder's batch on its chips (pdd_serve.emulation.pacer.decode_batch_cap)
            args["policy"]["tpot_slo_s"] = emulate.sla.tpot_s
        if "expose_cache_hits" in {f.name for f in dataclasses.fields(ServerConfig)}:
            args.setdefault("server", {})["expose_cache_hits"] = True  # the compare reads hit rates
        name = str(args.get("graph", p.stem))
        dst = out_dir / f"{name}.yaml"
        dst.write_text(f"# generated by pdd_serve evaluations from {p}\n" + yaml.safe_dump(doc, sort_keys=False))
        try:
            cfg = load_graph_yaml(dst)
        except ConfigError as e:
            raise EvalError(str(e)) from None
        out.append(PreparedGraph(name, p, dst, cfg, args.get("link")))
    names = [g.name for g in out]
    if len(set(names)) != len(names):
        raise EvalError(f"graphs must have distinct `graph:` labels, got {names}")
    return out


def link_seed(g: PreparedGraph) -> int | None:
    """The seed of a cross-site graph's link jitter as deployed (None: same site)."""
    if not g.cross_site:
        return None
    return int(g.cfg.link.line(2048).seed)


def for_repeat(g: PreparedGraph, rep: int) -> PreparedGraph:
    """The graph as repeat `rep` deploys it: a cross-site link draws its jitter from seed + rep,
    so repeats are independent draws of the line's weather (the same draw for every graph of one
    repeat), not one draw seen N times; repeat 0 is the graph as prepared."""
    import yaml

    if rep == 0 or not g.cross_site:
        return g
    doc = yaml.safe_load(g.path.read_text())
    args = doc["applications"][0]["args"]
    link = args.get("link")
    link = {"preset": link} if isinstance(link, str) else dict(link or {})
    link["seed"] = int(link_seed(g) or 0) + rep
    args["link"] = link
    dst = g.path.with_name(f"{g.path.stem}.repeat{rep}.yaml")
    dst.write_text(f"# {g.path.name} with the link jitter of repeat {rep}\n" + yaml.safe_dump(doc, sort_keys=False))
    try:
        cfg = load_graph_yaml(dst)
    except ConfigError as e:
        raise EvalError(str(e)) from None
    return PreparedGraph(g.name, g.source, dst, cfg, link)


def link_params(g: PreparedGraph) -> dict[str, Any]:
    """The emulated link as MLflow params (what was configured and what it amounts to)."""
    out: dict[str, Any] = {"link": json.dumps(g.link, sort_keys=True) if not isinstance(g.link, str) else g.link}
    try:
        from pdd_serve.checkpoints import SPEC_FILE, default_model_path

        spec = json.loads((default_model_path() / SPEC_FILE).read_text()) if g.cfg.model.path == "default" else {}
        kv = int(spec.get("kv_bytes_per_token_fp32", 2048))
    except Exception:  # params only: a missing spec must not stop a run
        kv = 2048
    if g.cfg.emulated:  # the bytes on the line are the emulated model's
        kv = build_emulation(g.cfg, "prefill").model.kv_bytes_per_token
    lm = g.cfg.link.line(kv, raw=g.cfg.emulated)  # the line's configured rate, per emulated byte when emulated
    out.update({"link.bandwidth_bps": lm.bandwidth_bps, "link.one_way_latency_s": lm.one_way_latency_s,
                "link.jitter": lm.jitter, "link.sigma": lm.sigma, "link.epoch_s": lm.epoch_s,
                "kv_bytes_per_token": kv})
    return out


def policy_params(cfg: PDDConfig) -> dict[str, Any]:
    p = cfg.policy
    return {"policy.pipelines": ",".join(p.pipelines), "policy.wan_budget_s": p.wan_budget_s,
            "policy.handoff_mode": p.handoff_mode, "policy.handoff_token_threshold": p.handoff_token_threshold,
            "policy.relay_max_running": p.relay_max_running, "policy.drc": p.drc,
            "policy.anomalous_max_output_tokens": p.anomalous_max_output_tokens}


def engine_params(cfg: PDDConfig) -> dict[str, Any]:
    """Each deployed role's effective engine (`model` + `engines.<site>` + `engines.<role>`) as MLflow
    params, `engine.<role>.<field>`, and the graph's `sites.chips` (BCR's chips: cost.params())."""
    out: dict[str, Any] = {}
    for role in cfg.engine_roles():
        m = cfg.engine_for(role)
        prefix = f"engine.{role}"
        out.update({f"{prefix}.site": getattr(cfg.sites, role), f"{prefix}.device": m.device,
                    f"{prefix}.dtype": m.kv_dtype, f"{prefix}.max_batch": m.max_batch,
                    f"{prefix}.kv_cache_bytes": m.kv_cache_bytes,
                    f"{prefix}.prefix_cache_bytes": (m.kv_cache_bytes // 2 if m.prefix_cache_bytes is None
                                                     else m.prefix_cache_bytes),
                    f"{prefix}.threads": "default" if m.threads is None else m.threads})
    out["engines"] = json.dumps({k: e.set_fields() for k, e in cfg.engines}, sort_keys=True) if cfg.engines else ""
    out["sites.chips"] = ",".join(f"{s}={c}" for s, c in cfg.sites.chips)
    return out


def settle_for(graph: PreparedGraph) -> Callable[[list[RequestRecord]], float]:
    """How long to wait after a warm-up: until its KV has crossed the link (with margin), because a
    warm-up answered by the relay alone is absorbed into MD's cache only once its KV arrived."""
    lm = graph.cfg.link.line(2048, raw=graph.cfg.emulated)

    def settle(warm: list[RequestRecord]) -> float:  # emulated seconds when the graph emulates
        if lm.bandwidth_bps is None:
            return 1.0
        wan = sum(int(r.pdd.get("wan_bytes") or 0) for r in warm)
        return 2.0 + 1.5 * wan / (lm.bandwidth_bps / 8)

    return settle


def run_graph(graph: PreparedGraph, denv: dict[str, str], workloads: Sequence[Workload], load: LoadConfig,
              env: EvalEnv, log: Callable[[str], None] = log_err, progress: bool = True,
              before_shutdown: Callable[[PreparedGraph], None] | None = None) -> list[list[RequestRecord]]:
    """Deploy one graph, drive each workload through it in order, shut it down (`before_shutdown`
    reads what the live graph knows, e.g. the emulated engines' overrun)."""
    with deployed(graph, denv, env, log) as url:
        out = [drive(url, w, load, desc=f"{graph.name} {w.name}", log=log, progress=progress,
                     settle_s=settle_for(graph)) for w in workloads]
        if before_shutdown is not None:
            before_shutdown(graph)
        return out


@contextlib.contextmanager
def deployed(graph: PreparedGraph, denv: dict[str, str], env: EvalEnv,
             log: Callable[[str], None] = log_err) -> Iterator[str]:
    """One graph deployed on the cluster for the block (its API's URL), shut down after it."""
    from pdd_serve.cluster.deploy import DeployError, deploy_graph, shutdown_serve

    shutdown_serve(denv)  # whatever ran before (a crashed earlier run, another app) goes
    try:
        url = deploy_graph(graph.path, denv, timeout_s=env.deploy_timeout_s, log=log)
    except DeployError as e:
        raise EvalError(str(e)) from None
    try:
        yield url
    finally:
        shutdown_serve(denv)
