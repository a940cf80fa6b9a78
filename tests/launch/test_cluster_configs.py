"""cluster_configs/: every shipped launcher YAML passes Ray's own validation and fits its graph;
broken ones fail with a message that names the file and the field."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdd_serve.config import load_graph_yaml
from pdd_serve.launch.cli import main
from pdd_serve.launch.configs import (
    LaunchConfigError,
    graph_demands,
    node_args,
    ray_schema,
    validate_cluster_config,
)
from pdd_serve.launch.template import GENERATED_MARK, LaunchSpec, render_tail, rendered

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "cluster_configs"
SHIPPED = [CONFIGS / f"{p}-two-site.yaml" for p in ("aws", "gcp", "onprem")]  # GPU hosts in two datacenters
LOCAL = CONFIGS / "local-two-site.yaml"  # the emulated hosts on this machine (evaluations/launch/e2e.py)


def test_all_flavours_are_shipped() -> None:
    assert sorted(CONFIGS.glob("*-two-site.yaml")) == sorted([*SHIPPED, LOCAL])


def test_ray_schema_supports_node_type_labels() -> None:
    # the premise of the cloud configs: Ray 2.60's launcher takes `labels` per node type
    props = ray_schema()["properties"]["available_node_types"]["patternProperties"][".*"]["properties"]
    assert props["labels"]["patternProperties"][".*"]["type"] == "string"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_is_valid_and_fits_its_graph(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    check = validate_cluster_config(path)
    assert set(check.usage) == {"a", "b"}
    for site, res in check.usage.items():
        for r, (asked, cap) in res.items():
            assert 0 < asked <= cap, (site, r)
    by_site = {d.deployment: d.site for d in check.demands}
    assert by_site["Prefill"] == by_site["Relay"] == by_site["Router"] == "a"
    assert by_site["MainDecode"] == "b" and not any(n.startswith("MainDecode") and n != "MainDecode" for n in by_site)
    assert all(d.resources.get("GPU") == 1 for d in check.demands if d.deployment != "Router")
    assert not check.warnings
    assert check.summary()[0].endswith(f"graph {check.graph_path})")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_graph_has_the_shape_of_graphs_pdd(path: Path) -> None:
    """Same graph as graphs/pdd.yaml (pipelines, sites, deployments), sized and moved to GPUs."""
    doc = yaml.safe_load(path.read_text())
    graph = ROOT / doc["metadata"]["pdd"]["graph"]
    product, cfg = load_graph_yaml(ROOT / "graphs" / "pdd.yaml"), load_graph_yaml(graph)
    assert cfg.graph == product.graph and cfg.policy.pipelines == product.policy.pipelines
    for role in ("prefill", "relay", "main_decode", "router"):
        assert getattr(cfg.sites, role) == getattr(product.sites, role)
    assert cfg.model.device == "cuda" and cfg.link.preset != "same_dc"
    assert cfg.flight.bind_host == "0.0.0.0" and cfg.flight.port == 0 and cfg.flight.token is None
    gdoc = yaml.safe_load(graph.read_text())
    assert gdoc["applications"][0]["import_path"] == "pdd_serve.serve.app:build_app"


def test_local_shaped_graphs_load_and_bind_beyond_loopback() -> None:
    for name in ("pdd", "pd_cross_dc"):
        cfg = load_graph_yaml(CONFIGS / "graphs" / f"local-shaped-{name}.yaml")
        paced = load_graph_yaml(ROOT / "graphs" / f"{name}.yaml")
        assert cfg.flight.bind_host == "0.0.0.0"  # MD sits in the namespace: loopback is unreachable
        assert cfg.link == paced.link and cfg.policy == paced.policy and cfg.sites == paced.sites


# ---- broken configs ---------------------------------------------------------------------------


GENERATED_KEYS = set(yaml.safe_load(render_tail(LaunchSpec(), "x.yaml")))


def _broken(tmp_path: Path, src: str, mutate: Callable[[dict[str, Any]], None], name: str | None = None) -> Path:
    """A copy of a shipped config, mutated; its generated commands re-rendered for the copy, unless
    the mutation is to them."""
    doc = yaml.safe_load((CONFIGS / src).read_text())
    doc["metadata"]["pdd"]["graph"] = str(ROOT / doc["metadata"]["pdd"]["graph"])
    before = {k: doc.get(k) for k in GENERATED_KEYS}
    mutate(doc)
    p = tmp_path / (name or src)
    if any(doc.get(k) != v for k, v in before.items()):
        p.write_text(yaml.safe_dump(doc, sort_keys=False))
        return p
    p.write_text(yaml.safe_dump({k: v for k, v in doc.items() if k not in GENERATED_KEYS}, sort_keys=False)
                 + GENERATED_MARK + "\n")
    p.write_text(rendered(p, doc))
    return p


def _fails(path: Path, pattern: str, graph: Path | None = None) -> str:
    with pytest.raises(LaunchConfigError) as ei:
        validate_cluster_config(path, graph)
    msg = str(ei.value)
    assert re.search(pattern, msg), msg
    return msg


def _nt(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return doc["available_node_types"][name]


def test_missing_site_label_names_file_and_field(tmp_path: Path) -> None:
    p = _broken(tmp_path, "aws-two-site.yaml", lambda d: _nt(d, "site_b")["labels"].pop("pdd.site"))
    msg = _fails(p, r"available_node_types\.site_b\.labels: missing pdd\.site")
    assert msg.startswith(f"{p}: available_node_types.site_b.labels: missing pdd.site")


def test_no_node_type_for_a_site(tmp_path: Path) -> None:
    p = _broken(tmp_path, "aws-two-site.yaml", lambda d: _nt(d, "site_b")["labels"].update({"pdd.site": "a"}))
    _fails(p, rf"^{re.escape(str(p))}: available_node_types: no node type has labels\.pdd\.site: b, but "
              r".*aws-pdd\.yaml runs MainDecode 2-6 \(autoscaling\) there")


@pytest.mark.parametrize(("mutate", "pattern"), [
    (lambda d: _nt(d, "site_a")["resources"].update({"CPU": "lots"}),
     r"available_node_types\.site_a\.resources\.CPU: 'lots' is not of type 'integer' \[Ray's cluster schema\]"),
    (lambda d: _nt(d, "site_b")["labels"].update({"pdd.site": 2}),
     r"available_node_types\.site_b\.labels\.pdd\.site: 2 is not of type 'string'"),
    (lambda d: _nt(d, "site_b").update({"min_workers": "1"}),
     r"available_node_types\.site_b\.min_workers: '1' is not of type 'integer'"),
    (lambda d: _nt(d, "site_b").update({"lables": {"pdd.site": "b"}}),
     r"available_node_types\.site_b: Additional properties are not allowed \('lables' was unexpected\)"),
    (lambda d: d["provider"].pop("type"), r"provider: 'type' is a required property"),
], ids=["cpu-not-int", "label-not-string", "min-workers-not-int", "typo-key", "provider-type-missing"])
def test_wrong_types_fail_ray_schema_with_the_field(tmp_path: Path, mutate: Callable, pattern: str) -> None:
    p = _broken(tmp_path, "aws-two-site.yaml", mutate)
    assert _fails(p, pattern).startswith(f"{p}: ")


def test_rays_cross_field_checks_run_too(tmp_path: Path) -> None:
    p = _broken(tmp_path, "gcp-two-site.yaml", lambda d: d.update({"max_workers": 1}))
    _fails(p, r"gcp-two-site\.yaml: max_workers: Ray rejects it: The specified global `max_workers` is smaller")
    p = _broken(tmp_path, "gcp-two-site.yaml", lambda d: d.update({"head_node_type": "nope"}))
    _fails(p, r"head_node_type: Ray rejects it: `head_node_type` must be one of `available_node_types`")


def test_too_few_cpus_for_the_graph(tmp_path: Path) -> None:
    # an autoscaling deployment is counted at its max_replicas: the site must hold the most it may run
    p = _broken(tmp_path, "aws-two-site.yaml", lambda d: _nt(d, "site_b")["resources"].update({"CPU": 24}))
    _fails(p, r"aws-two-site\.yaml: available_node_types\.site_b\.resources\.CPU: site b has 48 CPU on 2 node\(s\) "
              r"at max_workers, but .*aws-pdd\.yaml asks for 72 \(MainDecode max 6 x 12\)")
    p = _broken(tmp_path, "aws-two-site.yaml", lambda d: _nt(d, "site_b")["resources"].update({"GPU": 2}))
    _fails(p, r"available_node_types\.site_b\.resources\.GPU: site b has 4 GPU on 2 node\(s\) at max_workers, "
              r"but .* asks for 6 \(MainDecode max 6 x 1\)")
    g = _graph(tmp_path, "aws-pdd.yaml", lambda a: _fixed_md(a, 5))  # a fixed count: the same sum
    _fails(p, r"site b has 4 GPU on 2 node\(s\) at max_workers, but .* asks for 5 \(MainDecode 5 x 1\)", graph=g)


def test_too_few_gpus_and_one_replica_too_big(tmp_path: Path) -> None:
    p = _broken(tmp_path, "gcp-two-site.yaml", lambda d: _nt(d, "site_a").update({"max_workers": 1}) or
                _nt(d, "site_a")["resources"].update({"GPU": 4}))
    _fails(p, r"available_node_types\.\{head,site_a\}\.resources\.GPU: site a has 4 GPU on 2 node\(s\) at "
              r"max_workers, but .* asks for 6 \(Prefill 4 x 1, Relay 2 x 1\)")
    p = _broken(tmp_path, "aws-two-site.yaml", lambda d: _nt(d, "site_b")["resources"].update({"CPU": 10}))
    _fails(p, r"available_node_types\.site_b\.resources\.CPU: at most 10 CPU per node at site b, but one "
              r"MainDecode replica asks for 12")


def test_min_workers_short_is_a_warning(tmp_path: Path) -> None:
    p = _broken(tmp_path, "aws-two-site.yaml", lambda d: _nt(d, "site_b")["resources"].update({"GPU": 4}))
    check = validate_cluster_config(p, _graph(tmp_path, "aws-pdd.yaml", lambda a: _fixed_md(a, 6)))
    assert check.warnings == ("site b: 2 replica(s) don't fit at min_workers; the autoscaler must add nodes "
                              "before the graph is up",)
    # autoscaling: what runs at deploy time is min_replicas (or initial_replicas), which fits
    assert not validate_cluster_config(p).warnings
    g = _graph(tmp_path, "aws-pdd.yaml", lambda a: _dep(a, "MainDecode")["autoscaling_config"].update(
        {"initial_replicas": 5}))
    assert validate_cluster_config(p, g).warnings == (
        "site b: 1 replica(s) don't fit at min_workers; the autoscaler must add nodes before the graph is up",)


# ---- broken graphs ----------------------------------------------------------------------------


def _graph(tmp_path: Path, src: str, mutate: Callable[[dict[str, Any]], None]) -> Path:
    doc = yaml.safe_load((CONFIGS / "graphs" / src).read_text())
    mutate(doc["applications"][0])
    p = tmp_path / src
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def _dep(app: dict[str, Any], name: str) -> dict[str, Any]:
    return next(d for d in app["deployments"] if d["name"] == name)


def _fixed_md(app: dict[str, Any], n: int) -> None:
    """MainDecode at a fixed num_replicas instead of the shipped autoscaling_config."""
    md = _dep(app, "MainDecode")
    md.pop("autoscaling_config")
    md["num_replicas"] = n
    app["args"]["sites"]["main_decode_replicas"] = n


@pytest.mark.parametrize(("mutate", "pattern"), [
    (lambda a: _dep(a, "MainDecode")["ray_actor_options"]["label_selector"].update({"pdd.site": "a"}),
     r"applications\[0\]\.deployments\[3\]\.ray_actor_options\.label_selector\.pdd\.site: 'a', but "
     r"args\.sites\.main_decode puts MainDecode at site 'b'"),
    (lambda a: _dep(a, "Prefill")["ray_actor_options"].pop("label_selector"),
     r"deployments\[1\]\.ray_actor_options\.label_selector: missing pdd\.site: Serve replaces the code's "
     r"ray_actor_options with these, so Prefill would not be pinned to site 'a'"),
    (lambda a: a["deployments"].append({"name": "Decode", "ray_actor_options": {"num_cpus": 1}}),
     r"deployments\[4\]\.name: 'Decode' is not a deployment of this graph; it builds Router, Prefill, Relay, "
     r"MainDecode \(from args\.sites and args\.policy\)$"),
    (lambda a: a["deployments"].append({"name": "MainDecode6", "ray_actor_options": {"num_cpus": 1}}),
     r"deployments\[4\]\.name: 'MainDecode6' is not a deployment of this graph; .*main decode is one deployment, "
     r"MainDecode: set its num_replicas or autoscaling_config"),
    (lambda a: _dep(a, "Relay")["ray_actor_options"].pop("num_gpus"),
     r"deployments\[2\]\.ray_actor_options\.num_gpus: Relay runs the model on cuda but asks for no GPU"),
    (lambda a: a["args"]["flight"].update({"bind_host": "127.0.0.1"}),
     r"applications\[0\]\.args\.flight\.bind_host: '127\.0\.0\.1' is loopback"),
    (lambda a: a["args"]["flight"].update({"port": 50051}),
     r"applications\[0\]\.args\.flight\.port: fixed port 50051, but 6 MainDecode replicas fit on one site_b node"),
    (lambda a: a["args"]["sites"].update({"router_replicas": 3}),
     r"deployments\[0\]\.num_replicas: 2, but args\.sites\.router_replicas says 3: Serve runs 2 Router replicas"),
    (lambda a: _dep(a, "MainDecode").update({"num_replicas": 6}),
     r"deployments\[3\]\.autoscaling_config: set num_replicas or autoscaling_config, not both"),
    (lambda a: _dep(a, "MainDecode")["autoscaling_config"].update({"min_replicas": 7}),
     r"deployments\[3\]\.autoscaling_config: .*max_replicas \(6\) must be greater than or equal to min_replicas "
     r"\(7\).*\[Serve's AutoscalingConfig\]"),
    (lambda a: _dep(a, "MainDecode").update({"num_replicas": "auto", "autoscaling_config": {"min_replicas": 1}}),
     r"deployments\[3\]\.autoscaling_config\.max_replicas: missing: num_replicas \"auto\" lets Serve run up to 100"),
    (lambda a: _dep(a, "Prefill").update({"num_replicas": 0}),
     r"deployments\[1\]\.num_replicas: must be an int >= 1 or \"auto\", got 0"),
    (lambda a: a["args"]["policy"].update({"wan_budget_s": -1}),
     r"applications\[0\]\.args: policy: policy\.wan_budget_s must be >= 0"),
], ids=["selector-wrong-site", "selector-missing", "unknown-deployment", "old-per-replica-name", "cuda-without-gpu",
        "loopback-flight", "fixed-flight-port-shared", "replicas-vs-deployments", "replicas-and-autoscaling",
        "autoscaling-min-over-max", "auto-without-max", "zero-replicas", "bad-args"])
def test_broken_graph_names_graph_file_and_field(tmp_path: Path, mutate: Callable, pattern: str) -> None:
    g = _graph(tmp_path, "aws-pdd.yaml", mutate)
    msg = _fails(_broken(tmp_path, "aws-two-site.yaml", lambda d: None), pattern, graph=g)
    assert msg.startswith(f"{g}: "), msg


@pytest.mark.parametrize("src", ["aws-pdd.yaml", "gcp-pdd.yaml", "onprem-pdd.yaml"])
def test_shipped_cluster_graphs_are_secure(src: str) -> None:
    """HTTP on 0.0.0.0 takes API keys (from a file on the head), Flight on 0.0.0.0 speaks TLS, and
    nothing says allow_insecure or exposes cache hits."""
    cfg = load_graph_yaml(CONFIGS / "graphs" / src)
    assert yaml.safe_load((CONFIGS / "graphs" / src).read_text())["http_options"]["host"] == "0.0.0.0"
    assert cfg.server.api_keys_file and not cfg.server.allow_insecure and not cfg.server.expose_cache_hits
    assert cfg.flight.tls_cert and cfg.flight.tls_key and cfg.flight.tls_root_cert


@pytest.mark.parametrize(("mutate", "pattern"), [
    (lambda a: a["args"]["server"].pop("api_keys_file"),
     r"http_options\.host '0\.0\.0\.0' serves the API beyond this machine with no API key"),
    (lambda a: [a["args"]["flight"].pop(k) for k in ("tls_cert", "tls_key")],
     r"flight\.bind_host '0\.0\.0\.0' takes KV from beyond this machine in plaintext"),
], ids=["http-without-keys", "flight-without-tls"])
def test_an_open_graph_is_refused_at_load_unless_it_says_allow_insecure(tmp_path: Path, mutate: Callable,
                                                                       pattern: str) -> None:
    from pdd_serve.config import ConfigError

    g = _graph(tmp_path, "aws-pdd.yaml", mutate)
    with pytest.raises(ConfigError, match=pattern):
        load_graph_yaml(g)
    _fails(_broken(tmp_path, "aws-two-site.yaml", lambda d: None), pattern, graph=g)  # the launcher's check too
    g = _graph(tmp_path, "aws-pdd.yaml", lambda a: (mutate(a), a["args"]["server"].update({"allow_insecure": True})))
    load_graph_yaml(g)  # said explicitly: accepted
    graph_demands(g)


def test_graph_demands_follow_build_app_defaults(tmp_path: Path) -> None:
    """Without YAML overrides a deployment asks what build_app gives it (args.sites' replica counts,
    sites.cpus_per_replica): one MainDecode deployment of main_decode_replicas, router_replicas Routers."""
    doc = yaml.safe_load((ROOT / "graphs" / "pdd.yaml").read_text())
    app = doc["applications"][0]
    app.pop("deployments", None)
    app["args"]["sites"].update({"router_replicas": 2, "main_decode_replicas": 3})
    g = tmp_path / "pdd.yaml"
    g.write_text(yaml.safe_dump(doc, sort_keys=False))
    cfg, demands = graph_demands(g)
    asks = {d.deployment: (d.site, d.replicas, d.resources, d.autoscaling) for d in demands}
    assert asks == {"Router": ("a", 2, {"CPU": 0.25}, False), "Prefill": ("a", 1, {"CPU": 0.5}, False),
                    "Relay": ("a", 1, {"CPU": 0.5}, False), "MainDecode": ("b", 3, {"CPU": 0.5}, False)}


# ---- on-prem ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("mutate", "pattern"), [
    (lambda d: d["provider"]["worker_ips"].append("10.20.0.13"),
     r"metadata\.pdd\.node_types: host 10\.20\.0\.13 \(provider\) is in no node type: it would join without"),
    (lambda d: d["metadata"]["pdd"]["node_types"]["site_b"]["labels"].pop("pdd.site"),
     r"metadata\.pdd\.node_types\.site_b\.labels: missing pdd\.site"),
    (lambda d: d["metadata"]["pdd"]["node_types"]["site_b"]["hosts"].append("10.30.0.1"),
     r"metadata\.pdd\.node_types\.site_b\.hosts: 10\.30\.0\.1 is neither provider\.head_ip nor in provider\.worker_ips"),
    (lambda d: d.update({"worker_start_ray_commands": ["ray start --address=$RAY_HEAD_IP:6379"]}),
     r"worker_start_ray_commands: no `--labels`"),
    (lambda d: d.update({"available_node_types": {"x": {"resources": {}, "node_config": {}}}}),
     r"available_node_types: the local provider has a single node type"),
    (lambda d: d["metadata"]["pdd"]["node_types"]["site_b"]["resources"].update({"GPU": 4}),
     r"metadata\.pdd\.node_types\.site_b\.resources\.GPU: site b has 8 GPU on 2 node\(s\)"),
], ids=["unlisted-worker", "missing-label", "unknown-host", "start-without-labels", "node-types-field",
        "too-few-gpus"])
def test_broken_onprem_config(tmp_path: Path, mutate: Callable, pattern: str) -> None:
    p = _broken(tmp_path, "onprem-two-site.yaml", mutate)
    assert _fails(p, pattern).startswith(f"{p}: ")


def test_onprem_node_args_give_each_host_its_site() -> None:
    p = CONFIGS / "onprem-two-site.yaml"
    # the listed address goes too: the other site reaches the host there, whatever Ray would guess
    assert node_args(p, "10.10.0.10") == ["--labels=pdd.site=a,pdd.chip=cpu", "--node-ip-address=10.10.0.10",
                                          '--resources={"site_a":1000}']
    assert node_args(p, "10.10.0.12") == ["--labels=pdd.site=a,pdd.chip=h100", "--node-ip-address=10.10.0.12",
                                          '--resources={"site_a":1000}']
    assert node_args(p, "10.20.0.11") == ["--labels=pdd.site=b,pdd.chip=h20", "--node-ip-address=10.20.0.11",
                                          '--resources={"site_b":1000}']
    with pytest.raises(LaunchConfigError, match=r"node_types: host 10\.9\.9\.9 is in no node type's hosts"):
        node_args(p, "10.9.9.9")
    with pytest.raises(LaunchConfigError, match=r"provider\.type: node-args is for the local"):
        node_args(CONFIGS / "aws-two-site.yaml", "10.0.0.1")


def test_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["validate", *map(str, SHIPPED)]) == 0
    out = capsys.readouterr().out
    assert out.count(": OK (") == 3 and "site b: nodes site_b x2-2; runs MainDecode x12" in out
    assert "site b: nodes site_b x1-2; runs MainDecode 2-6 (autoscaling); uses CPU 72/192, GPU 6/16" in out
    assert "runs Router x2, Prefill x4, Relay x2" in out
    bad = _broken(tmp_path, "aws-two-site.yaml", lambda d: _nt(d, "site_b")["labels"].pop("pdd.site"))
    assert main(["validate", str(bad)]) == 1
    assert "available_node_types.site_b.labels: missing pdd.site" in capsys.readouterr().err
    assert main(["node-args", str(CONFIGS / "onprem-two-site.yaml"), "--ip", "10.20.0.12"]) == 0
    assert capsys.readouterr().out.strip() == ('--labels=pdd.site=b,pdd.chip=h20 --node-ip-address=10.20.0.12 '
                                               '--resources={"site_b":1000}')


def test_broken_yaml_and_missing_graph(tmp_path: Path) -> None:
    p = tmp_path / "x.yaml"
    p.write_text("cluster_name: [unclosed\n")
    _fails(p, rf"^{re.escape(str(p))}: not valid YAML")
    q = _broken(tmp_path, "aws-two-site.yaml", lambda d: d["metadata"]["pdd"].update({"graph": "nope.yaml"}))
    _fails(q, r"metadata\.pdd\.graph: nope\.yaml not found")
    r = _broken(tmp_path, "aws-two-site.yaml", lambda d: d.pop("metadata"), name="nometa.yaml")
    _fails(r, r"nometa\.yaml: metadata\.pdd\.graph: missing")
