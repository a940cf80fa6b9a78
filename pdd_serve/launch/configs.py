"""Ray cluster launcher configs for PDD's two sites: validation against Ray and against the graph.

`validate_cluster_config(path)` loads a cluster YAML (cluster_configs/*-two-site.yaml) and checks,
in order, stopping at the first problem with a message that names the file and the field:

1. Ray's own schema (`ray/autoscaler/ray-schema.json`, the one `ray up` uses), then Ray's own
   preparation and cross-field checks (`prepare_config` + `validate_config`: defaults, head type,
   min/max workers, the local provider's rules).
2. PDD's node types: cloud configs use `available_node_types`; the local (on-prem) provider allows
   only one node type, so its PDD node types live in `metadata.pdd.node_types` (hosts, labels,
   resources) and must list exactly `provider.head_ip` + `provider.worker_ips`. Every node type
   carries a `pdd.site` label and declares CPU (and GPU where it has any).
3. The graph (`metadata.pdd.graph`, a Serve config): every deployment it builds (Router, Prefill,
   Relay, MainDecode, with `args.sites`' replica counts), with the YAML's `deployments[]`
   overrides (Serve *replaces* the code's ray_actor_options with the YAML's, so a YAML entry must
   restate its `label_selector`; `num_replicas` or an `autoscaling_config` replaces the count),
   must land on a node type with its site's label, and its replicas x num_cpus/num_gpus/resources
   must pack onto that site's nodes at max_workers, an autoscaling deployment at its max_replicas
   (a warning when what runs at deploy time, min_replicas or initial_replicas, doesn't fit at
   min_workers). Cross-site Flight must be reachable (no loopback bind) and a fixed Flight port
   must not be shared by two MD replicas on one node.

4. The generated setup and start commands (`pdd_serve/launch/template.py`) match the file's
   `metadata.pdd.launch`: every provider runs the same commands.

`python -m pdd_serve.launch validate FILE...` (cli.py) runs it from a shell; `secrets CONFIG` makes
`.pdd/launch` (keys.py); `render FILE...` rewrites
the generated commands (`--check`: say which file drifted); `node-args CONFIG` prints
`--labels=... --resources=... --node-ip-address=...` for this host from an on-prem config's
metadata (the on-prem start commands use it); `preflight CONFIG` checks, before `ray up`, that
every host answers ssh with the config's key (checks.py); `wait-nodes CONFIG`, on the
head after `ray up`, waits until every host has joined with its site label.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdd_serve.config import ConfigError, PDDConfig, check_http_bind, load_config
from pdd_serve.launch.template import GENERATED_MARK, rendered

SITE_LABEL = "pdd.site"
SERVE_DEFAULT_NUM_CPUS = 1.0  # what Serve gives a replica whose ray_actor_options lack num_cpus
ROUTER_NUM_CPUS = 0.25  # build_app's Router default
_META = "metadata.pdd"
_LOOPBACK = ("localhost", "::1")


class LaunchConfigError(ValueError):
    """A cluster or graph YAML that can't run PDD; `str(e)` is `FILE: FIELD: what is wrong`."""

    def __init__(self, file: str | Path, where: str, what: str) -> None:
        self.file, self.field, self.what = str(file), where, what
        super().__init__(f"{file}: {where}: {what}" if where else f"{file}: {what}")


@dataclass(frozen=True)
class NodeType:
    """One kind of node as PDD sees it, and how many of it the cluster may have."""

    name: str
    where: str  # the YAML field that defines it, for messages
    labels: dict[str, str]
    resources: dict[str, float]
    min_count: int
    max_count: int
    is_head: bool = False
    hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.min_count <= self.max_count:
            raise ValueError(f"{self.where}: need 0 <= min_count <= max_count, got {self.min_count}, {self.max_count}")

    @property
    def site(self) -> str | None:
        return self.labels.get(SITE_LABEL)


@dataclass(frozen=True)
class Demand:
    """One deployment of the graph: where it must run and what each replica asks for."""

    deployment: str
    site: str
    replicas: int  # the most it runs: num_replicas, or autoscaling_config.max_replicas (what the site must hold)
    resources: dict[str, float]  # per replica: CPU, GPU, custom
    where: str  # the graph field that sets it
    min_replicas: int | None = None  # autoscaling_config.min_replicas; None: a fixed num_replicas
    initial_replicas: int | None = None  # autoscaling: what runs at deploy time (Serve: initial, else min)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"{self.where}: replicas must be >= 1, got {self.replicas}")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.replicas:
            raise ValueError(f"{self.where}: need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, "
                             f"{self.replicas}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    @property
    def at_start(self) -> int:
        """The replicas Serve starts when the graph is deployed."""
        if self.min_replicas is None:
            return self.replicas
        return self.min_replicas if self.initial_replicas is None else self.initial_replicas

    def label(self) -> str:
        """`Prefill x4`, `MainDecode 2-6 (autoscaling)`."""
        if self.autoscaling:
            return f"{self.deployment} {self.min_replicas}-{self.replicas} (autoscaling)"
        return f"{self.deployment} x{self.replicas}"


@dataclass(frozen=True)
class ClusterCheck:
    """What `validate_cluster_config` found: the node types, the graph's demand and how it fits."""

    path: str
    graph_path: str
    provider: str
    node_types: tuple[NodeType, ...]
    demands: tuple[Demand, ...]
    # site -> resource -> (asked by the graph, capacity at max_workers)
    usage: dict[str, dict[str, tuple[float, float]]]
    warnings: tuple[str, ...] = field(default=())

    def summary(self) -> list[str]:
        out = [f"{self.path}: OK ({self.provider}; graph {self.graph_path})"]
        for site in sorted(self.usage):
            types = ", ".join(f"{t.name} x{t.min_count}-{t.max_count}" for t in self.node_types if t.site == site)
            deps = _deployments_text([d for d in self.demands if d.site == site])
            res = ", ".join(f"{r} {asked:g}/{cap:g}" for r, (asked, cap) in sorted(self.usage[site].items()))
            out.append(f"  site {site}: nodes {types}; runs {deps}; uses {res}")
        out += [f"  warning: {w}" for w in self.warnings]
        return out


def _deployments_text(demands: list[Demand]) -> str:
    """`Router x2, Prefill x4, Relay x2`, `MainDecode 2-6 (autoscaling)`."""
    return ", ".join(d.label() for d in demands)


def _asks_text(demands: list[Demand], resource: str) -> str:
    """`Prefill 4 x 16, MainDecode max 6 x 12`: what each deployment asks of one resource (an
    autoscaling deployment at its max_replicas)."""
    return ", ".join(f"{d.deployment} {'max ' if d.autoscaling else ''}{d.replicas} x {d.resources[resource]:g}"
                     for d in demands)


def _shown(p: Path) -> str:
    """p relative to the working directory when it is under it (shorter messages)."""
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


# ---- loading ----------------------------------------------------------------------------------


def load_yaml(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise LaunchConfigError(path, "", f"cannot read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise LaunchConfigError(path, "", f"not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise LaunchConfigError(path, "", f"expected a mapping at the top, got {type(doc).__name__}")
    return doc


def ray_schema() -> dict[str, Any]:
    """The cluster-config JSON schema of the installed Ray (what `ray up` validates with)."""
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def _dotted(parts: Iterable[Any]) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in parts).replace(".[", "[") or "(top level)"


def _check_ray_schema(path: Path, config: dict[str, Any]) -> None:
    import jsonschema

    errors = sorted(jsonschema.Draft7Validator(ray_schema()).iter_errors(config),
                    key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        e = max(errors, key=lambda e: len(e.absolute_path))  # the deepest: the most precise field
        more = f" (and {len(errors) - 1} more schema error(s))" if len(errors) > 1 else ""
        raise LaunchConfigError(path, _dotted(e.absolute_path), f"{e.message}{more} [Ray's cluster schema]")


def _check_ray_prepare(path: Path, config: dict[str, Any]) -> None:
    """Ray's own preparation and cross-field checks, on a copy (what `ray up` runs before launching)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    if config["provider"].get("type") == "local" and config.get("available_node_types"):
        raise LaunchConfigError(path, "available_node_types",
                                "the local provider has a single node type and rejects this field; put PDD's "
                                f"node types under {_META}.node_types (see cluster_configs/onprem-two-site.yaml)")
    try:
        validate_config(prepare_config(copy.deepcopy(config)))
    except Exception as e:  # noqa: BLE001 - Ray raises ValueError, RuntimeError, click exceptions...
        msg = getattr(e, "message", None) or str(e) or type(e).__name__
        named = re.search(r"`([a-z_]+)`", msg)  # Ray names the field in backticks
        raise LaunchConfigError(path, named.group(1) if named else "", f"Ray rejects it: {msg}") from None


# ---- node types ---------------------------------------------------------------------------------


def _resources(path: Path, where: str, res: Any, need_cpu: bool = True) -> dict[str, float]:
    if not isinstance(res, dict):
        raise LaunchConfigError(path, where, f"must be a mapping of resource -> amount, got {res!r}")
    out = {}
    for k, v in res.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise LaunchConfigError(path, f"{where}.{k}", f"must be a number >= 0, got {v!r}")
        out[str(k)] = float(v)
    if need_cpu and "CPU" not in out:
        raise LaunchConfigError(path, f"{where}.CPU", "missing: PDD needs each node type's CPUs to check the graph fits")
    return out


def _labels(path: Path, where: str, labels: Any) -> dict[str, str]:
    if labels is None:
        raise LaunchConfigError(path, where, f"missing {SITE_LABEL}: every node belongs to a site (a or b)")
    if not isinstance(labels, dict):
        raise LaunchConfigError(path, where, f"must be a mapping, got {labels!r}")
    if SITE_LABEL not in labels:
        raise LaunchConfigError(path, where, f"missing {SITE_LABEL}: every node belongs to a site (a or b)")
    for k, v in labels.items():
        if not isinstance(v, str) or not v:
            raise LaunchConfigError(path, f"{where}.{k}", f"must be a non-empty string, got {v!r}")
    return {str(k): v for k, v in labels.items()}


def _cloud_node_types(path: Path, config: dict[str, Any]) -> list[NodeType]:
    head = config["head_node_type"]
    global_max = int(config.get("max_workers", 2))
    out = []
    for name, nt in config["available_node_types"].items():
        where = f"available_node_types.{name}"
        is_head = name == head
        lo = 0 if is_head else int(nt.get("min_workers", 0))
        hi = 0 if is_head else int(nt.get("max_workers", global_max))
        if is_head:  # the head is one node; its type's min/max_workers count extra copies of it
            lo, hi = 1 + int(nt.get("min_workers", 0)), 1 + int(nt.get("max_workers", 0))
        out.append(NodeType(name, where, _labels(path, f"{where}.labels", nt.get("labels")),
                            _resources(path, f"{where}.resources", nt.get("resources")), lo, hi, is_head))
    return out


def _local_node_types(path: Path, config: dict[str, Any]) -> list[NodeType]:
    prov = config["provider"]
    meta = ((config.get("metadata") or {}).get("pdd") or {}).get("node_types")
    if not isinstance(meta, dict) or not meta:
        raise LaunchConfigError(path, f"{_META}.node_types",
                                "missing: the local provider has one node type, so PDD's node types (hosts, labels, "
                                "resources per site) must be listed here")
    head_ip = prov.get("head_ip")
    workers = list(prov.get("worker_ips") or [])
    seen: dict[str, str] = {}
    out = []
    for name, nt in meta.items():
        where = f"{_META}.node_types.{name}"
        if not isinstance(nt, dict):
            raise LaunchConfigError(path, where, f"must be a mapping with hosts, labels, resources; got {nt!r}")
        unknown = sorted(set(nt) - {"hosts", "labels", "resources"})
        if unknown:
            raise LaunchConfigError(path, f"{where}.{unknown[0]}", "unknown key; valid: hosts, labels, resources")
        hosts = nt.get("hosts")
        if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) and h for h in hosts):
            raise LaunchConfigError(path, f"{where}.hosts", f"must be a non-empty list of host addresses, got {hosts!r}")
        for h in hosts:
            if h in seen:
                raise LaunchConfigError(path, f"{where}.hosts", f"{h} is already listed in {seen[h]}")
            if h != head_ip and h not in workers:
                raise LaunchConfigError(path, f"{where}.hosts", f"{h} is neither provider.head_ip nor in "
                                                                "provider.worker_ips: ray up would never start it")
            seen[h] = where
        is_head = head_ip in hosts
        if is_head and len(hosts) != 1:
            raise LaunchConfigError(path, f"{where}.hosts", f"the head type lists only provider.head_ip ({head_ip})")
        out.append(NodeType(name, where, _labels(path, f"{where}.labels", nt.get("labels")),
                            _resources(path, f"{where}.resources", nt.get("resources")), len(hosts), len(hosts),
                            is_head, tuple(hosts)))
    missing = [h for h in [head_ip, *workers] if h not in seen]
    if missing:
        raise LaunchConfigError(path, f"{_META}.node_types",
                                f"host {missing[0]} (provider) is in no node type: it would join without a "
                                f"{SITE_LABEL} label")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        cmds = " ".join(config.get(key) or [])
        if cmds and "pdd_serve.launch node-args" not in cmds and "--labels" not in cmds:
            raise LaunchConfigError(path, key, f"no `--labels` (or `python -m pdd_serve.launch node-args`): "
                                               f"these nodes would start without a {SITE_LABEL} label")
    return out


# ---- the graph ----------------------------------------------------------------------------------


def resolve_graph(path: Path, graph: str | Path | None, config: dict[str, Any]) -> Path:
    where = f"{_META}.graph"
    if graph is None:
        graph = ((config.get("metadata") or {}).get("pdd") or {}).get("graph")
        if not graph:
            raise LaunchConfigError(path, where, "missing: name the Serve graph YAML this cluster runs")
    g = Path(graph).expanduser()
    if g.is_absolute():
        candidates = [g]
    else:  # as given from here, next to the config, or from the repo root (cluster_configs/..)
        candidates = [Path.cwd() / g, path.parent / g, path.parent.parent / g]
    for c in candidates:
        if c.is_file():
            return Path(_shown(c))
    raise LaunchConfigError(path, where, f"{graph} not found (looked in {', '.join(str(c.parent) for c in candidates)})")


def _site_of(role: str, cfg: PDDConfig) -> tuple[str, str]:
    return getattr(cfg.sites, role), f"args.sites.{role}"


def graph_demands(graph_path: str | Path) -> tuple[PDDConfig, list[Demand]]:
    """The deployments a graph YAML builds, each with its site and per-replica resources."""
    gp = Path(graph_path)
    doc = load_yaml(gp)
    apps = doc.get("applications")
    if not isinstance(apps, list) or not apps or not isinstance(apps[0], dict):
        raise LaunchConfigError(gp, "applications", "expected a list of {import_path, args, deployments}")
    if len(apps) != 1:
        raise LaunchConfigError(gp, "applications", f"PDD graphs have one application, got {len(apps)}")
    app = apps[0]
    pre = "applications[0]"
    try:
        cfg = load_config(app.get("args") or {})
    except ConfigError as e:
        raise LaunchConfigError(gp, f"{pre}.args", str(e)) from None
    try:  # the HTTP bind is outside `args`: checked here, where the whole Serve config is seen
        check_http_bind((doc.get("http_options") or {}).get("host"), cfg.server)
    except ConfigError as e:
        raise LaunchConfigError(gp, "http_options.host", str(e)) from None
    s = cfg.sites
    # what build_app builds: name -> (role, replicas, num_cpus)
    built: dict[str, tuple[str, int, float]] = {"Router": ("router", s.router_replicas, ROUTER_NUM_CPUS),
                                                "Prefill": ("prefill", s.prefill_replicas, s.cpus_per_replica)}
    if cfg.uses_relay:
        built["Relay"] = ("relay", s.relay_replicas, s.cpus_per_replica)
    built["MainDecode"] = ("main_decode", s.main_decode_replicas, s.cpus_per_replica)
    given_sites = (app.get("args") or {}).get("sites") or {}  # what args.sites states (not its defaults)
    overrides: dict[str, tuple[int, dict[str, Any]]] = {}
    for i, d in enumerate(app.get("deployments") or []):
        where = f"{pre}.deployments[{i}]"
        name = d.get("name") if isinstance(d, dict) else None
        if name not in built:
            hint = ""
            if isinstance(name, str) and re.fullmatch(r"MainDecode\d+", name):
                hint = ("; main decode is one deployment, MainDecode: set its num_replicas or autoscaling_config "
                        "(one entry, not one per replica)")
            raise LaunchConfigError(gp, f"{where}.name", f"{name!r} is not a deployment of this graph; it builds "
                                                         f"{', '.join(built)} (from args.sites and args.policy){hint}")
        overrides[name] = (i, d)
    demands = []
    for name, (role, replicas, cpus) in built.items():
        site, site_field = _site_of(role, cfg)
        where = f"{pre}.{site_field}"
        res: dict[str, float] = {"CPU": cpus}
        lo = initial = None
        if name in overrides:
            i, d = overrides[name]
            where = f"{pre}.deployments[{i}]"
            replicas, lo, initial = _replicas(gp, where, name, role, d, replicas, given_sites)
            if "ray_actor_options" in d:
                ao = d["ray_actor_options"] or {}
                aw = f"{where}.ray_actor_options"
                selector = (ao.get("label_selector") or {}).get(SITE_LABEL)
                if selector is None:
                    raise LaunchConfigError(gp, f"{aw}.label_selector",
                                            f"missing {SITE_LABEL}: Serve replaces the code's ray_actor_options with "
                                            f"these, so {name} would not be pinned to site {site!r} ({site_field})")
                if selector != site:
                    raise LaunchConfigError(gp, f"{aw}.label_selector.{SITE_LABEL}",
                                            f"{selector!r}, but {site_field} puts {name} at site {site!r}")
                res = {"CPU": float(ao.get("num_cpus", SERVE_DEFAULT_NUM_CPUS))}
                if ao.get("num_gpus"):
                    res["GPU"] = float(ao["num_gpus"])
                for k, v in (ao.get("resources") or {}).items():
                    res[str(k)] = float(v)
                if cfg.model.device.startswith("cuda") and role != "router" and not res.get("GPU"):
                    raise LaunchConfigError(gp, f"{aw}.num_gpus", f"{name} runs the model on {cfg.model.device} "
                                            "but asks for no GPU (Ray would hide every GPU from it)")
        demands.append(Demand(name, site, replicas, res, where, lo, initial))
    return cfg, demands


def _replicas(gp: Path, where: str, name: str, role: str, d: dict[str, Any], default: int,
              given_sites: dict[str, Any]) -> tuple[int, int | None, int | None]:
    """(max replicas, min_replicas, initial_replicas) of a YAML `deployments[]` entry, as Serve reads
    it: a fixed `num_replicas`, or an `autoscaling_config` (with `num_replicas` absent or "auto");
    the min and initial counts are None for a fixed count. Without either, the code's default
    (`args.sites.<role>_replicas`)."""
    from ray.serve.config import AutoscalingConfig

    n, auto = d.get("num_replicas"), d.get("autoscaling_config")
    key = f"{role}_replicas"
    if n is not None and n != "auto":
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise LaunchConfigError(gp, f"{where}.num_replicas", f"must be an int >= 1 or \"auto\", got {n!r}")
        if auto is not None:
            raise LaunchConfigError(gp, f"{where}.autoscaling_config", "set num_replicas or autoscaling_config, not "
                                    "both (Serve refuses a fixed num_replicas with an autoscaling_config)")
        if key in given_sites and given_sites[key] != n:
            raise LaunchConfigError(gp, f"{where}.num_replicas",
                                    f"{n}, but args.sites.{key} says {given_sites[key]}: Serve runs {n} {name} "
                                    f"replicas while whatever reads args.sites (the cost model) counts "
                                    f"{given_sites[key]}; make them agree, or drop args.sites.{key}")
        return n, None, None
    if auto is None and n is None:
        return default, None, None
    if auto is not None and not isinstance(auto, dict):
        raise LaunchConfigError(gp, f"{where}.autoscaling_config",
                                f"must be a mapping (min_replicas, max_replicas, target_ongoing_requests...), got {auto!r}")
    if n == "auto" and "max_replicas" not in (auto or {}):
        raise LaunchConfigError(gp, f"{where}.autoscaling_config.max_replicas",
                                f"missing: num_replicas \"auto\" lets Serve run up to "
                                f"{AutoscalingConfig.default().max_replicas} {name} replicas, and the site must "
                                "hold the most it may run; give autoscaling_config.max_replicas")
    base = AutoscalingConfig.default().model_dump() if n == "auto" else {}
    try:
        ac = AutoscalingConfig(**{**base, **(auto or {})})
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError (Serve's own check)
        errs = getattr(e, "errors", None)
        first = errs()[0] if callable(errs) and errs() else None
        field_ = ".".join(map(str, first["loc"])) if first and first.get("loc") else ""
        msg = first["msg"] if first else str(e)
        raise LaunchConfigError(gp, f"{where}.autoscaling_config" + (f".{field_}" if field_ else ""),
                                f"{msg} [Serve's AutoscalingConfig]") from None
    return ac.max_replicas, ac.min_replicas, ac.initial_replicas


# ---- fitting ------------------------------------------------------------------------------------


def _pack(demands: list[Demand], nodes: list[NodeType], count: str) -> tuple[list[tuple[NodeType, dict[str, float]]],
                                                                             list[Demand]]:
    """First-fit-decreasing of every replica onto the node instances (count: min_count | max_count;
    at max_count every deployment at its most replicas, at min_count at what it starts with).
    Returns the instances with what is left on each, and the replicas that found no room."""
    inst = [(t, dict(t.resources)) for t in nodes for _ in range(getattr(t, count))]
    items = sorted((d for d in demands for _ in range(d.replicas if count == "max_count" else d.at_start)),
                   key=lambda d: (-d.resources.get("GPU", 0), -d.resources.get("CPU", 0)))
    unplaced = []
    for d in items:
        for _t, free in inst:
            if all(free.get(r, 0.0) + 1e-9 >= v for r, v in d.resources.items() if v > 0):
                for r, v in d.resources.items():
                    free[r] = free.get(r, 0.0) - v
                break
        else:
            unplaced.append(d)
    return inst, unplaced


def _fit(path: Path, graph_path: Path, flavor: str, types: list[NodeType], demands: list[Demand],
         cfg: PDDConfig) -> tuple[dict[str, dict[str, tuple[float, float]]], list[str]]:
    usage: dict[str, dict[str, tuple[float, float]]] = {}
    warnings = []
    for site in sorted({d.site for d in demands}):
        here = [d for d in demands if d.site == site]
        nodes = [t for t in types if t.site == site]
        names = _deployments_text(here)
        if not nodes:
            raise LaunchConfigError(path, flavor, f"no node type has labels.{SITE_LABEL}: {site}, but {graph_path} "
                                                  f"runs {names} there")
        field_of = nodes[0].where if len(nodes) == 1 else f"{flavor}.{{{','.join(t.name for t in nodes)}}}"
        asked: dict[str, float] = {}
        for d in here:
            for r, v in d.resources.items():
                asked[r] = asked.get(r, 0.0) + v * d.replicas
        cap = {r: sum(t.resources.get(r, 0.0) * t.max_count for t in nodes) for r in asked}
        usage[site] = {r: (asked[r], cap[r]) for r in asked}
        for d in here:  # one replica must fit on one node
            if not any(all(t.resources.get(r, 0.0) + 1e-9 >= v for r, v in d.resources.items() if v > 0) for t in nodes):
                short = next(r for r, v in d.resources.items()
                             if v > max(t.resources.get(r, 0.0) for t in nodes) + 1e-9)
                best = max(t.resources.get(short, 0.0) for t in nodes)
                raise LaunchConfigError(path, f"{field_of}.resources.{short}",
                                        f"at most {best:g} {short} per node at site {site}, but one {d.deployment} "
                                        f"replica asks for {d.resources[short]:g} ({graph_path}: {d.where})")
        for r in sorted(asked):
            if asked[r] > cap[r] + 1e-9:
                parts = _asks_text([d for d in here if d.resources.get(r)], r)
                n = sum(t.max_count for t in nodes)
                raise LaunchConfigError(path, f"{field_of}.resources.{r}",
                                        f"site {site} has {cap[r]:g} {r} on {n} node(s) at max_workers, but "
                                        f"{graph_path} asks for {asked[r]:g} ({parts})")
        inst, unplaced = _pack(here, nodes, "max_count")
        if unplaced:
            raise LaunchConfigError(path, field_of, f"site {site}'s totals suffice but the replicas don't pack onto its "
                                                    f"nodes ({len(unplaced)} left over, e.g. {unplaced[0].deployment}); "
                                                    "add nodes or shrink replicas")
        _, unplaced_min = _pack(here, nodes, "min_count")
        if unplaced_min:
            warnings.append(f"site {site}: {len(unplaced_min)} replica(s) don't fit at min_workers; the autoscaler "
                            "must add nodes before the graph is up")
        if site == cfg.sites.main_decode and cfg.flight.port != 0 and cfg.sites.prefill != cfg.sites.main_decode:
            md = next((d for d in here if d.deployment == "MainDecode"), None)
            if md is not None:
                _check_md_port(path, graph_path, nodes, md, cfg)
    return usage, warnings


def _check_md_port(path: Path, graph_path: Path, nodes: list[NodeType], md: Demand, cfg: PDDConfig) -> None:
    """A fixed Flight port collides when two MainDecode replicas (up to its max_replicas) share a node."""
    if md.replicas < 2:
        return
    for t in nodes:
        per_node = min((int(t.resources.get(r, 0.0) // v) for r, v in md.resources.items() if v > 0),
                       default=md.replicas)
        if per_node >= 2:
            raise LaunchConfigError(graph_path, "applications[0].args.flight.port",
                                    f"fixed port {cfg.flight.port}, but {min(per_node, md.replicas)} MainDecode "
                                    f"replicas fit on one {t.name} node ({path}) and would collide on it; use port 0 "
                                    "(and open the ephemeral range) or size MDs to one per node")


def _check_flight(graph_path: Path, cfg: PDDConfig) -> None:
    if cfg.sites.prefill == cfg.sites.main_decode:
        return
    host = cfg.flight.bind_host
    loop = host in _LOOPBACK
    if not loop:
        try:
            loop = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loop = False
    if loop:
        raise LaunchConfigError(graph_path, "applications[0].args.flight.bind_host",
                                f"{host!r} is loopback: main decode at site {cfg.sites.main_decode} would be "
                                f"unreachable from prefill at site {cfg.sites.prefill} on another host; use 0.0.0.0")


# ---- the entry point ----------------------------------------------------------------------------


def validate_cluster_config(path: str | Path, graph: str | Path | None = None) -> ClusterCheck:
    """Check a cluster launcher YAML with Ray's own validation, then against its PDD graph.

    `graph` overrides `metadata.pdd.graph`. Raises LaunchConfigError (`FILE: FIELD: problem`).
    """
    path = Path(path)
    config = load_yaml(path)
    _check_ray_schema(path, config)
    _check_ray_prepare(path, config)
    provider = config["provider"]["type"]
    if provider == "local":
        flavor, types = f"{_META}.node_types", _local_node_types(path, config)
    else:
        if not config.get("available_node_types"):
            raise LaunchConfigError(path, "available_node_types", "missing: PDD needs a node type per site")
        flavor, types = "available_node_types", _cloud_node_types(path, config)
    graph_path = resolve_graph(path, graph, config)
    cfg, demands = graph_demands(graph_path)
    _check_flight(graph_path, cfg)
    usage, warnings = _fit(path, graph_path, flavor, types, demands, cfg)
    _check_commands(path, config)
    return ClusterCheck(str(path), str(graph_path), provider, tuple(types), tuple(demands), usage, tuple(warnings))


def _check_commands(path: Path, config: dict[str, Any]) -> None:
    """The setup/start commands are the shared template's, rendered from metadata.pdd.launch."""
    try:
        want = rendered(path, config)
    except ValueError as e:
        key, _, why = str(e).partition(": ")
        if not why or " " in key:  # a message about the whole mapping
            key, why = "", str(e)
        raise LaunchConfigError(path, f"{_META}.launch" + (f".{key}" if key else ""), why) from None
    if GENERATED_MARK not in path.read_text():
        raise LaunchConfigError(path, "setup_commands", "not generated from the shared template: add metadata.pdd.launch "
                                                        f"and run `python -m pdd_serve.launch render {path}`")
    if path.read_text() != want:
        raise LaunchConfigError(path, "setup_commands", "the generated commands differ from metadata.pdd.launch (someone "
                                                        "edited below the marker, or the template changed): run "
                                                        f"`python -m pdd_serve.launch render {path}`")


# ---- on-prem: this host's labels ----------------------------------------------------------------


def _is_local_address(ip: str) -> bool:
    """Whether `ip` belongs to this host: a UDP 'connect' to a local address picks that address as
    the source (nothing is sent)."""
    try:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return s.getsockname()[0] == ip
    except OSError:
        return False


def node_args(config_path: str | Path, ip: str | None = None) -> list[str]:
    """`ray start` arguments for this host of an on-prem config: its node type's labels and custom
    resources (CPU/GPU are left to Ray's detection). `ip` names the host; default: whichever listed
    address is local."""
    path = Path(config_path)
    config = load_yaml(path)
    if (config.get("provider") or {}).get("type") != "local":
        raise LaunchConfigError(path, "provider.type", "node-args is for the local (on-prem) provider; cloud node "
                                                       "types get their labels from available_node_types")
    for t in _local_node_types(path, config):
        if (ip in t.hosts) if ip else any(_is_local_address(h) for h in t.hosts):
            labels = ",".join(f"{k}={v}" for k, v in t.labels.items())
            custom = {k: v for k, v in t.resources.items() if k not in ("CPU", "GPU", "memory", "object_store_memory")}
            # The listed address is the one the other hosts reach: Ray's own guess on a multi-homed
            # host (or one without a default route) can be another.
            out = [f"--labels={labels}", f"--node-ip-address={ip or next(h for h in t.hosts if _is_local_address(h))}"]
            if custom:  # compact JSON: no spaces, so an unquoted $(...) keeps it one word
                out.append("--resources=" + json.dumps({k: int(v) if v == int(v) else v for k, v in custom.items()},
                                                       separators=(",", ":")))
            return out
    raise LaunchConfigError(path, f"{_META}.node_types",
                            f"host {ip} is in no node type's hosts" if ip else
                            "none of this host's addresses is in a node type's hosts (pass --ip)")


__all__ = ["ClusterCheck", "Demand", "LaunchConfigError", "NodeType", "graph_demands", "node_args", "ray_schema",
           "validate_cluster_config"]
