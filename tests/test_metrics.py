"""GET /metrics's pure parts on fabricated node exports (parse, merge, vLLM names, access), the
metrics RouterMetrics records, and the Grafana dashboard's PromQL against the names our code defines."""

from __future__ import annotations

import ast
import asyncio
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdd_serve import metrics as pm
from pdd_serve.config import ServerConfig
from pdd_serve.emulation.clock import Clock
from pdd_serve.serve import openai_api as oai

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "cluster_configs/grafana/pdd_dashboard.json"

_RAY_TAGS = 'Component="core_worker",NodeAddress="10.0.0.1",SessionName="s1",Version="2.60.0"'

# Site a's node: the Router replica's PDD metrics, a Serve metric, Ray's own system metrics.
NODE_A = f"""# HELP ray_node_cpu_utilization Total CPU usage on a ray node
# TYPE ray_node_cpu_utilization gauge
ray_node_cpu_utilization{{InstanceId="",ip="10.0.0.1"}} 12.5
# HELP ray_pdd_requests_total finished requests by pipeline and finish reason
# TYPE ray_pdd_requests_total counter
ray_pdd_requests_total{{{_RAY_TAGS},WorkerId="w1",application="pdd",deployment="Router",finish_reason="stop",pipeline="P-RLD-MD",replica="r1"}} 3.0
ray_pdd_requests_total{{{_RAY_TAGS},WorkerId="w1",application="pdd",deployment="Router",finish_reason="length",pipeline="P-MD",replica="r1"}} 2.0
# HELP ray_pdd_ttft_seconds time to first token
# TYPE ray_pdd_ttft_seconds histogram
ray_pdd_ttft_seconds_bucket{{{_RAY_TAGS},WorkerId="w1",le="0.1",pipeline="P-MD",replica="r1"}} 1.0
ray_pdd_ttft_seconds_bucket{{{_RAY_TAGS},WorkerId="w1",le="+Inf",pipeline="P-MD",replica="r1"}} 2.0
ray_pdd_ttft_seconds_sum{{{_RAY_TAGS},WorkerId="w1",pipeline="P-MD",replica="r1"}} 0.35
ray_pdd_ttft_seconds_count{{{_RAY_TAGS},WorkerId="w1",pipeline="P-MD",replica="r1"}} 2.0
# HELP ray_pdd_output_tokens_total output tokens streamed to clients
# TYPE ray_pdd_output_tokens_total counter
ray_pdd_output_tokens_total{{{_RAY_TAGS},WorkerId="w1",replica="r1"}} 160.0
# HELP ray_serve_replica_processing_queries The current number of queries being processed.
# TYPE ray_serve_replica_processing_queries gauge
ray_serve_replica_processing_queries{{{_RAY_TAGS},deployment="Router",replica="r1"}} 1.0
# HELP target_info Target metadata
# TYPE target_info gauge
target_info{{service_name="ray"}} 1.0
"""

# Site b's node (another Router replica landed there in this fabricated cluster, plus MD's load),
# with a series that node a exports too (a duplicate a scrape must not carry).
NODE_B = f"""# HELP ray_pdd_requests_total finished requests by pipeline and finish reason
# TYPE ray_pdd_requests_total counter
ray_pdd_requests_total{{{_RAY_TAGS},WorkerId="w2",application="pdd",deployment="Router",finish_reason="abort",pipeline="none",replica="r2"}} 1.0
ray_pdd_requests_total{{{_RAY_TAGS},WorkerId="w1",application="pdd",deployment="Router",finish_reason="stop",pipeline="P-RLD-MD",replica="r1"}} 3.0
# HELP ray_pdd_replica_requests requests the replica holds
# TYPE ray_pdd_replica_requests gauge
ray_pdd_replica_requests{{{_RAY_TAGS},WorkerId="w3",deployment="MainDecode",replica="m1",role="main_decode"}} 4.0
# HELP ray_pdd_ttft_seconds time to first token
# TYPE ray_pdd_ttft_seconds histogram
ray_pdd_ttft_seconds_bucket{{{_RAY_TAGS},WorkerId="w2",le="0.1",pipeline="P-MD",replica="r2"}} 0.0
ray_pdd_ttft_seconds_bucket{{{_RAY_TAGS},WorkerId="w2",le="+Inf",pipeline="P-MD",replica="r2"}} 1.0
ray_pdd_ttft_seconds_sum{{{_RAY_TAGS},WorkerId="w2",pipeline="P-MD",replica="r2"}} 0.5
ray_pdd_ttft_seconds_count{{{_RAY_TAGS},WorkerId="w2",pipeline="P-MD",replica="r2"}} 1.0
"""


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _type_lines(text: str) -> list[str]:
    return [ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE ")]


def test_filter_keeps_pdd_and_serve_families_only():
    kept = pm.filter_text(NODE_A)
    assert "ray_pdd_requests_total" in kept and "ray_serve_replica_processing_queries" in kept
    assert "ray_node_cpu_utilization" not in kept and "target_info" not in kept
    assert "# HELP ray_pdd_ttft_seconds time to first token" in kept  # HELP/TYPE travel with their family
    assert pm.filter_text("# a comment\n\nray_gcs_x 1\n") == ""
    assert pm.line_metric('ray_pdd_x{a="b c"} 1') == "ray_pdd_x"
    assert pm.line_metric("ray_pdd_y 2") == "ray_pdd_y"


def test_cluster_exposition_merges_nodes_into_one_family_each():
    text = pm.cluster_exposition([NODE_A, NODE_B], "pdd-small")
    types = _type_lines(text)
    assert len(types) == len(set(types)), types  # every family once, samples of both nodes under it
    fams = _families(text)
    reqs = fams["ray_pdd_requests"]
    assert fams["ray_pdd_requests"].type == "counter"
    # both replicas' series, the one both nodes exported only once
    assert sorted(s.labels["replica"] for s in reqs.samples if s.name == "ray_pdd_requests_total") == ["r1", "r1", "r2"]
    assert sum(s.value for s in reqs.samples if s.name == "ray_pdd_requests_total") == 6.0
    ttft = fams["ray_pdd_ttft_seconds"]
    assert ttft.type == "histogram"
    assert sum(s.value for s in ttft.samples if s.name.endswith("_count")) == 3.0
    assert fams["ray_pdd_replica_requests"].samples[0].labels["role"] == "main_decode"
    assert "ray_node_cpu_utilization" not in fams and "target_info" not in fams
    nodes = {s.labels["outcome"]: s.value for s in fams[pm.SCRAPE_FAMILY].samples}
    assert nodes == {"ok": 2.0, "failed": 0.0}


def test_vllm_names_are_the_same_series_renamed():
    fams = _families(pm.cluster_exposition([NODE_A, NODE_B], "pdd-small"))
    ttft = fams["vllm:time_to_first_token_seconds"]
    src = fams["ray_pdd_ttft_seconds"]
    assert ttft.type == "histogram"
    assert [(s.name.replace("vllm:time_to_first_token_seconds", ""), s.value) for s in ttft.samples] == \
        [(s.name.replace("ray_pdd_ttft_seconds", ""), s.value) for s in src.samples]
    assert all(s.labels["model_name"] == "pdd-small" for s in ttft.samples)
    assert {s.labels["le"] for s in ttft.samples if s.name.endswith("_bucket")} == {"0.1", "+Inf"}
    ok = fams["vllm:request_success"]  # a counter: served as vllm:request_success_total
    assert ok.type == "counter" and {s.name for s in ok.samples} == {"vllm:request_success_total"}
    assert {s.labels["finished_reason"] for s in ok.samples} == {"stop", "length", "abort"}
    assert all("finish_reason" not in s.labels for s in ok.samples)
    gen = fams["vllm:generation_tokens"]
    assert [s.value for s in gen.samples] == [160.0]
    # families nobody recorded yet get no vLLM name (no empty family), and no gauge is aliased
    assert "vllm:e2e_request_latency_seconds" not in fams and "vllm:num_requests_running" not in fams
    text = pm.cluster_exposition([NODE_A], "m")
    assert "vllm:generation_tokens_total{" in text and "# TYPE vllm:time_to_first_token_seconds histogram" in text


def test_alias_table_names_real_pdd_metrics_and_real_vllm_names():
    defined = _defined_metric_names()
    for a in pm.VLLM_ALIASES:
        assert a.source in defined, a
        assert a.vllm.startswith("vllm:")
        # a counter's vLLM name ends in _total, like its source, and a histogram's in _seconds
        assert a.vllm.endswith("_total") == a.source.endswith("_total"), a
    assert len({a.vllm for a in pm.VLLM_ALIASES}) == len(pm.VLLM_ALIASES)


def test_a_failed_or_malformed_node_is_counted_not_fatal():
    text = pm.cluster_exposition([NODE_A, None, "ray_pdd_x{unclosed 1\n"], "m")
    fams = _families(text)
    assert {s.labels["outcome"]: s.value for s in fams[pm.SCRAPE_FAMILY].samples} == {"ok": 1.0, "failed": 2.0}
    assert "ray_pdd_requests" in fams
    empty = _families(pm.cluster_exposition([], "m"))
    assert set(empty) == {pm.SCRAPE_FAMILY}


def test_node_metrics_urls_skip_dead_nodes():
    nodes = [{"Alive": True, "NodeManagerAddress": "10.0.0.1", "MetricsExportPort": 8080},
             {"Alive": False, "NodeManagerAddress": "10.0.0.2", "MetricsExportPort": 8080},
             {"Alive": True, "NodeManagerAddress": "10.0.0.1", "MetricsExportPort": 8080},  # listed twice
             {"Alive": True, "NodeManagerAddress": "fd00::3", "MetricsExportPort": "61000"},
             {"Alive": True, "NodeManagerAddress": "10.0.0.4"}]
    assert pm.node_metrics_urls(nodes) == ["http://10.0.0.1:8080/metrics", "http://[fd00::3]:61000/metrics"]


def test_fetch_texts_gathers_concurrently_with_a_timeout():
    async def main():
        async def ok(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            body = NODE_B.encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            writer.close()

        async def hang(reader, writer):
            await asyncio.sleep(30)

        s1 = await asyncio.start_server(ok, "127.0.0.1", 0)
        s2 = await asyncio.start_server(hang, "127.0.0.1", 0)
        s3 = await asyncio.start_server(ok, "127.0.0.1", 0)
        closed_port = s3.sockets[0].getsockname()[1]
        s3.close()
        await s3.wait_closed()
        urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}/metrics" for s in (s1, s2)]
        urls.append(f"http://127.0.0.1:{closed_port}/metrics")
        t = asyncio.get_running_loop().time()
        out = await pm.fetch_texts(urls, timeout_s=0.5)
        took = asyncio.get_running_loop().time() - t
        for s in (s1, s2):
            s.close()
        return out, took

    out, took = asyncio.run(main())
    assert out[0] == NODE_B and out[1] is None and out[2] is None
    assert took < 2.0  # one timeout, not one per node


def _headers(key: str | None) -> dict:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def test_metrics_access_open_without_keys_admin_only_with_keys():
    oai.check_metrics_access({}, ServerConfig())  # no keys: open, as vLLM's /metrics
    keyed = ServerConfig(api_keys=("sk-user",), admin_api_keys=("sk-admin",))
    oai.check_metrics_access(_headers("sk-admin"), keyed)
    for key, status in ((None, 401), ("wrong", 401), ("sk-user", 403)):
        with pytest.raises(oai.APIError) as e:
            oai.check_metrics_access(_headers(key), keyed)
        assert e.value.status == status
    # a graph that already shows every caller its cache hits lets every API key read the counters
    shown = ServerConfig(api_keys=("sk-user",), expose_cache_hits=True)
    oai.check_metrics_access(_headers("sk-user"), shown)
    with pytest.raises(oai.APIError) as e:
        oai.check_metrics_access({}, shown)
    assert e.value.status == 401


class _Fake:
    made: dict = {}

    def __init__(self, name, description="", boundaries=None, tag_keys=()):
        self.name, self.calls, self.default = name, [], {}
        _Fake.made[name] = self

    def set_default_tags(self, tags):
        self.default = dict(tags)

    def inc(self, value=1.0, tags=None):
        self.calls.append((value, tags))

    def observe(self, value, tags=None):
        self.calls.append((value, tags))

    def set(self, value, tags=None):
        self.calls.append((value, tags))


@pytest.fixture
def fake_ray_metrics(monkeypatch):
    import ray.serve.metrics as rsm

    _Fake.made = {}
    for cls in ("Counter", "Histogram", "Gauge"):
        monkeypatch.setattr(rsm, cls, _Fake)
    return _Fake.made


def test_router_metrics_record_prompt_tokens_e2e_and_request_tpot(fake_ray_metrics, monkeypatch):
    m = pm.RouterMetrics()
    info = SimpleNamespace(pipeline="P-MD", handoff_mode="none", eager_tokens=0, wan_bytes=0, fallbacks=[],
                           ttft_s=0.5)
    st = SimpleNamespace(info=info, finish_reason="length", committed=[1, 2, 3, 4, 5],
                         gen=SimpleNamespace(prompt_token_ids=tuple(range(12))), t0=100.0)
    monkeypatch.setattr(pm.time, "monotonic", lambda: 102.5)
    m.record(st)
    made = fake_ray_metrics
    assert made["pdd_prompt_tokens_total"].calls == [(12, None)]
    assert made["pdd_output_tokens_total"].calls == [(5, None)]
    assert made["pdd_e2e_request_latency_seconds"].calls == [(2.5, {"pipeline": "P-MD"})]
    assert made["pdd_request_tpot_seconds"].calls == [(pytest.approx(0.5), {"pipeline": "P-MD"})]  # (2.5-0.5)/4
    # a request that never got a token: no prompt tokens (vLLM counts prefilled prompts), no TPOT
    failed = SimpleNamespace(info=SimpleNamespace(**{**vars(info), "pipeline": "", "ttft_s": 0.0}),
                             finish_reason=None, committed=[], gen=st.gen, t0=101.0)
    m.record(failed)
    assert len(made["pdd_prompt_tokens_total"].calls) == 1 and len(made["pdd_request_tpot_seconds"].calls) == 1
    assert made["pdd_e2e_request_latency_seconds"].calls[-1] == (1.5, {"pipeline": "none"})
    assert made["pdd_requests_total"].calls[-1] == (1.0, {"pipeline": "none", "finish_reason": "abort"})


def test_replica_gauges_poll_stats_on_the_loop(fake_ray_metrics):
    from pdd_serve.serve.messages import ReplicaStats

    seen = []

    def stats():
        seen.append(1)
        if len(seen) == 2:
            raise RuntimeError("replica shutting down")  # a failed poll does not end the loop
        return ReplicaStats("relay", 3, 25, 100)

    async def main():
        g = pm.ReplicaGauges.watch("relay", stats, period_s=0.01)
        await asyncio.sleep(0.1)
        g._task.cancel()
        return g

    g = asyncio.run(main())
    assert len(seen) >= 3
    assert fake_ray_metrics["pdd_replica_requests"].default == {"role": "relay"}
    assert fake_ray_metrics["pdd_replica_requests"].calls[0] == (3, None)
    assert fake_ray_metrics["pdd_replica_kv_usage"].calls[0] == (0.75, None)
    assert g.role == "relay"
    assert pm.kv_usage(0, 0) == 0.0 and pm.kv_usage(10, 10) == 0.0


def test_emulated_replicas_export_overrun_per_step_kind_and_latencies_in_emulated_seconds(fake_ray_metrics,
                                                                                          monkeypatch):
    from pdd_serve.serve.messages import ReplicaStats

    emu = {"prefill_steps": 10, "overrun_share_prefill": 0.1, "decode_steps": 200, "overrun_share_decode": 0.02}
    g = pm.ReplicaGauges("main_decode", lambda: ReplicaStats("main_decode", 1, 5, 10, extra={"emulation": emu}))
    g.update()
    calls = fake_ray_metrics["pdd_emulation_overrun_share"].calls
    assert (0.1, {"role": "main_decode", "kind": "prefill"}) in calls
    assert (0.02, {"role": "main_decode", "kind": "decode"}) in calls
    assert (200, {"role": "main_decode", "kind": "decode"}) in fake_ray_metrics["pdd_emulation_steps"].calls
    # an unemulated replica sets no emulation gauge
    pm.ReplicaGauges("relay", lambda: ReplicaStats("relay", 0, 5, 10)).update()
    assert fake_ray_metrics["pdd_emulation_overrun_share"].calls == []  # the relay's gauge object
    # slow motion x10: 25 real seconds of a request are 2.5 emulated ones
    m = pm.RouterMetrics(Clock(10))
    info = SimpleNamespace(pipeline="P-MD", handoff_mode="none", eager_tokens=0, wan_bytes=0, fallbacks=[], ttft_s=0.5)
    st = SimpleNamespace(info=info, finish_reason="length", committed=[1, 2], gen=SimpleNamespace(prompt_token_ids=(1,)),
                         t0=100.0)
    monkeypatch.setattr(pm.time, "monotonic", lambda: 125.0)
    m.record(st)
    assert fake_ray_metrics["pdd_e2e_request_latency_seconds"].calls[-1] == (2.5, {"pipeline": "P-MD"})


# ------------------------------------------------------------------ the Grafana dashboard


def _defined_metric_names() -> set[str]:
    """Every metric name metrics.py gives Ray (Counter/Histogram/Gauge first arguments)."""
    tree = ast.parse((ROOT / "pdd_serve/metrics.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("Counter", "Histogram", "Gauge") and node.args
                and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value)
    return names


def _ray_serve_metric_names() -> set[str]:
    import ray.serve

    root = Path(ray.serve.__file__).parent
    out = set()
    for p in root.rglob("*.py"):
        out.update(re.findall(r'"(serve_[a-z0-9_]+)"', p.read_text(errors="replace")))
    return out


def _exprs(obj) -> list[str]:
    if isinstance(obj, dict):
        return [v for k, v in obj.items() if k == "expr" and isinstance(v, str)] + \
            [e for k, v in obj.items() if k != "expr" for e in _exprs(v)]
    if isinstance(obj, list):
        return [e for v in obj for e in _exprs(v)]
    return []


def _strip(name: str, suffixes: tuple[str, ...]) -> str:
    for suf in suffixes:
        if name.endswith(suf):
            return name[: -len(suf)]
    return name


def test_dashboard_queries_only_metrics_our_code_defines():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["panels"]
    exprs = _exprs(dash)
    assert len(exprs) >= 10
    defined = _defined_metric_names()
    histograms = {n for n in defined if n.endswith("_seconds")}
    serve = _ray_serve_metric_names()
    used = set()
    for expr in exprs:
        for name in re.findall(r"\b(ray_[a-z0-9_]+|vllm:[a-z0-9_:]+|pdd_[a-z0-9_]+)", expr):
            used.add(name)
            if name.startswith("ray_pdd_"):
                base = name[len("ray_"):]
                hist = _strip(base, ("_bucket", "_sum", "_count"))
                assert base in defined or (hist in histograms and hist != base), f"{name} in {expr!r}"
            elif name.startswith("ray_serve_"):
                assert _strip(name[len("ray_"):], ("_total", "_bucket", "_sum", "_count")) in serve, name
            else:
                pytest.fail(f"{name}: the dashboard reads Ray's names (ray_pdd_*, ray_serve_*), in {expr!r}")
    # the panels the issue asks for
    for must in ("ray_pdd_ttft_seconds_bucket", "ray_pdd_tpot_seconds_bucket", "ray_pdd_requests_total",
                 "ray_pdd_handoffs_total", "ray_pdd_wan_bytes_total", "ray_pdd_fallbacks_total",
                 "ray_pdd_router_index_misses_total", "ray_pdd_replica_requests"):
        assert must in used, must
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p.get("datasource", {}).get("uid") == "${datasource}" for p in dash["panels"] if p["type"] != "row")
