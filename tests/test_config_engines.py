"""Per-site engines (issue 14 item 4): `engines:` overrides of `model` per role or site, their
precedence and rejections, `sites.chips` for the BCR cost model, and the MLflow run recording both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from evaluations.compare import CompareConfig, GraphResult, log_compare, summarize_graph
from evaluations.cost import CatalogError, hardware_cost
from evaluations.harness import engine_params, prepare_graphs
from evaluations.loadgen import SLA, RequestRecord
from evaluations.tracking import Tracker
from evaluations.workloads import Session, Turn, Workload
from pdd_serve.config import ConfigError, EngineOverrides, ModelConfig, load_config, load_graph_yaml
from pdd_serve.emulation.costmodel import load_catalog

ROOT = Path(__file__).resolve().parents[1]
HETERO = {
    "graph": "pdd_hetero",
    "model": {"device": "cpu", "kv_cache_bytes": 256 << 20, "max_batch": 32},
    "sites": {"prefill": "a", "relay": "a", "main_decode": "b", "router": "a",
              "chips": {"a": "h100-sxm", "b": "h20"}},
    "engines": {
        "a": {"threads": 2, "kv_cache_bytes": 128 << 20},  # the prefill-strong site
        "b": {"kv_cache_bytes": 1 << 30, "max_batch": 128},  # the memory-rich site
        "relay": {"max_batch": 8, "threads": 1},  # role beats site
    },
}


def _hetero_yaml(tmp_path: Path, args: dict) -> Path:
    doc = yaml.safe_load((ROOT / "graphs" / "pdd.yaml").read_text())
    a = doc["applications"][0]["args"]
    for k, v in args.items():
        a[k] = {**a[k], **v} if isinstance(a.get(k), dict) and k != "engines" else v
    p = tmp_path / "pdd_hetero.yaml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def test_precedence_role_over_site_over_model():
    cfg = load_config(HETERO)
    p, r, md = (cfg.engine_for(x) for x in ("prefill", "relay", "main_decode"))
    # prefill: model + engines.a
    assert (p.threads, p.kv_cache_bytes, p.max_batch) == (2, 128 << 20, 32)
    # relay: model + engines.a + engines.relay (role wins field by field, the site's other fields stay)
    assert (r.threads, r.kv_cache_bytes, r.max_batch) == (1, 128 << 20, 8)
    # main decode: model + engines.b
    assert (md.threads, md.kv_cache_bytes, md.max_batch) == (None, 1 << 30, 128)
    # everything not overridden is the base model's, and the fixed keys are the same everywhere
    for m in (p, r, md):
        assert (m.path, m.block_size, m.device, m.dtype, m.max_model_len) == ("default", 16, "cpu", None, None)
    assert cfg.sites.chip_map == {"a": "h100-sxm", "b": "h20"}
    # no engines: every role runs `model` itself
    plain = load_config({"model": {"max_batch": 4}})
    assert all(plain.engine_for(x) is plain.model for x in ("prefill", "relay", "main_decode"))
    with pytest.raises(ConfigError, match="role must be one of"):
        cfg.engine_for("router")
    hash(cfg)  # still a frozen, hashable config


def test_site_keys_follow_the_sites_section():
    # MD moved to site c: engines.c applies to it, engines.b is then unknown
    cfg = load_config({"sites": {"main_decode": "c"}, "link": "pdd_report", "engines": {"c": {"max_batch": 7}}})
    assert cfg.engine_for("main_decode").max_batch == 7 and cfg.engine_for("prefill").max_batch is None  # unset: the engine default
    with pytest.raises(ConfigError, match=r"engines\.b is neither a role .* nor a site an engine runs at \(a, c"):
        load_config({"sites": {"main_decode": "c"}, "link": "pdd_report", "engines": {"b": {"max_batch": 7}}})


@pytest.mark.parametrize("engines, match", [
    ({"b": {"block_size": 32}}, r"engines\.b\.block_size can't be set per role or site: KV crosses sites block by block"),
    ({"prefill": {"path": "/x"}}, r"engines\.prefill\.path can't be set per role or site"),
    ({"main_decode": {"max_model_len": 64}}, r"engines\.main_decode\.max_model_len can't be set"),
    ({"router": {"threads": 2}}, r"engines\.router is neither a role"),
    ({"z": {"threads": 2}}, r"engines\.z is neither a role"),
    ({"a": {"bogus": 1}}, r"unknown key\(s\) engines\.a\.bogus"),
    ({"a": {"max_batch": 0}}, r"engines\.a: max_batch must be an int > 0, got 0"),
    ({"a": {"max_batch": True}}, r"engines\.a: max_batch must be an int > 0"),
    ({"relay": {"threads": -1}}, r"engines\.relay: threads must be an int > 0"),
    ({"b": {"kv_cache_bytes": "1G"}}, r"engines\.b: kv_cache_bytes must be an int > 0"),
    ({"b": {"prefix_cache_bytes": -5}}, r"engines\.b: prefix_cache_bytes must be an int >= 0"),
    ({"b": {"device": "tpu"}}, r"engines\.b: device must be cpu or cuda"),
    ({"b": {"dtype": "int8"}}, r"engines\.b: dtype must be float32\|float16\|bfloat16"),
    ({"b": "big"}, r"engines\.b must be a mapping"),
    (["prefill"], r"engines must be a mapping of role or site"),
    # the effective engine is checked whole: a site's smaller KV pool under the base's prefix budget
    ({"a": {"kv_cache_bytes": 1 << 20}}, r"the prefill engine \(model \+ engines\.a\): model\.prefix_cache_bytes"),
])
def test_rejections_name_the_yaml_key(engines, match):
    base = {"model": {"prefix_cache_bytes": 64 << 20}}
    with pytest.raises(ConfigError, match=match):
        load_config({**base, "engines": engines})


def test_one_kv_dtype_across_prefill_relay_and_main_decode():
    # the transport refuses another dtype (codec LayoutMismatch): a mismatch is a config error
    with pytest.raises(ConfigError, match=r"one KV dtype, model's float32 .* main_decode: bfloat16"):
        load_config({"engines": {"b": {"dtype": "bfloat16"}}})
    # dtype None means bfloat16 on CUDA, so a device override alone changes the KV dtype too
    with pytest.raises(ConfigError, match=r"prefill: bfloat16, relay: bfloat16"):
        load_config({"engines": {"a": {"device": "cuda"}}})
    # ...and is fine when the dtype is pinned: a GPU site A and a CPU site B, one float32 KV
    cfg = load_config({"model": {"dtype": "float32"}, "engines": {"a": {"device": "cuda:0"}}})
    assert cfg.engine_for("prefill").device == "cuda:0" and cfg.engine_for("main_decode").device == "cpu"
    assert {cfg.engine_for(r).kv_dtype for r in ("prefill", "relay", "main_decode")} == {"float32"}
    # every role on bf16 GPUs, base CPU bf16 too: one dtype
    load_config({"model": {"dtype": "bfloat16"}, "engines": {"a": {"device": "cuda"}, "b": {"device": "cuda:1"}}})
    # a relay that is not deployed does not constrain the dtype
    load_config({"policy": {"pipelines": ["P-MD"]}, "engines": {"relay": {"dtype": "float16"}}})


def test_sites_chips_and_role_named_sites():
    with pytest.raises(ConfigError, match=r"sites\.chips\.c: no role runs at site 'c'"):
        load_config({"sites": {"chips": {"a": "cpu", "c": "h20"}}})
    with pytest.raises(ConfigError, match=r"sites: sites\.chips must map site labels to chip names"):
        load_config({"sites": {"chips": {"a": 3}}})
    with pytest.raises(ConfigError, match=r"sites\.main_decode is 'relay', a role name"):
        load_config({"sites": {"main_decode": "relay"}, "link": "pdd_report", "engines": {"prefill": {"threads": 1}}})
    with pytest.raises(ConfigError, match=r"model\.threads must be an int >= 1"):
        ModelConfig(threads=0)
    assert EngineOverrides(max_batch=3, threads=2).set_fields() == {"max_batch": 3, "threads": 2}


def test_engine_for_round_trip_from_a_graph_yaml(tmp_path):
    path = _hetero_yaml(tmp_path, HETERO)
    cfg = load_graph_yaml(path)
    assert cfg == load_config(HETERO | {"link": cfg.link, "policy": cfg.policy, "flight": cfg.flight,
                                        "server": cfg.server, "model": cfg.model,
                                        "sites": cfg.sites})
    assert cfg.engine_for("main_decode").max_batch == 128 and cfg.engine_for("relay").max_batch == 8
    assert cfg.engine_for("prefill").threads == 2
    bad = _hetero_yaml(tmp_path, {"engines": {"b": {"block_size": 8}}})
    with pytest.raises(ConfigError, match=r"applications\[0\]\.args: engines\.b\.block_size can't be set"):
        load_graph_yaml(bad)


def test_the_cost_model_reads_each_sites_chip_from_the_graph(tmp_path):
    cat = load_catalog()
    hetero, plain = prepare_graphs([_hetero_yaml(tmp_path, HETERO), ROOT / "graphs" / "pdd.yaml"],
                                   tmp_path / "prep", 18421)
    cli = {"a": "cpu", "b": "cpu"}  # the command line's default
    cost = hardware_cost(hetero.cfg, cli, cat)
    assert [(r[0], r[1], r[3]) for r in cost.roles] == [("prefill", "a", "h100-sxm"), ("relay", "a", "h100-sxm"),
                                                        ("main_decode", "b", "h20")]
    assert cost.per_hour == pytest.approx(2 * cat.chip("h100-sxm").price_per_hour + cat.chip("h20").price_per_hour
                                          + cat.link_price(True))
    assert cost.params()["chip.a"] == "h100-sxm" and cost.params()["chip.b"] == "h20"
    # without sites.chips: today's behaviour, the command line's chips
    assert {r[3] for r in hardware_cost(plain.cfg, cli, cat).roles} == {"cpu"}
    # the graph names one site only: --chip fills the other
    one = load_config({"sites": {"chips": {"b": "a100-80g"}}, "link": "pdd_report"})
    assert [r[3] for r in hardware_cost(one, cli, cat).roles] == ["cpu", "cpu", "a100-80g"]
    # a chip the catalog lacks fails with the graph key that named it
    bad = load_config({"sites": {"chips": {"b": "tpu9"}}, "link": "pdd_report"})
    with pytest.raises(CatalogError, match=r"graph pdd: sites\.chips\.b: chip 'tpu9' is not in the catalog"):
        hardware_cost(bad, cli, cat)


def test_the_mlflow_run_records_engines_and_chips(tmp_path):
    from mlflow.tracking import MlflowClient

    [g] = prepare_graphs([_hetero_yaml(tmp_path, HETERO)], tmp_path / "prep", 18422)
    recs = [RequestRecord(f"s{i}", 0, "agentic", 100, 0.5, 4, float(i), 200, token_ids=[1, 2, 3, 4], ttft_s=0.1,
                          tt2t_s=0.2, tpot_s=0.02, itl_max_s=0.03, e2e_s=0.2, output_tokens=4,
                          pdd={"pipeline": "P-MD", "eager_tokens": 0, "wan_bytes": 100, "handoff_mode": "none"})
            for i in range(3)]
    res = GraphResult(g, [recs])
    catalog = load_catalog()
    cli = {"a": "cpu", "b": "cpu"}
    summaries = {"pdd_hetero": summarize_graph(res, SLA(), cli, catalog)}
    assert summaries["pdd_hetero"]["cost_per_hour_usd"] == pytest.approx(hardware_cost(g.cfg, cli, catalog).per_hour)
    workload = Workload("tiny", tuple(Session(f"s{i}", (Turn((1, 2, 3), 4),)) for i in range(3)))
    out = tmp_path / "out"
    out.mkdir()
    for name in ("requests.parquet", "summary.json", "cdf.png"):
        (out / name).write_text("x")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    ids = log_compare(Tracker(uri, "pdd-test-engines"), workload, CompareConfig(), {"pdd_hetero": res}, summaries,
                       {"code_fingerprint": "f"}, catalog, cli, out, out / "cdf.png")
    params = MlflowClient(tracking_uri=uri).get_run(ids["pdd_hetero"]).data.params
    want = {"engine.prefill.site": "a", "engine.prefill.threads": "2", "engine.prefill.kv_cache_bytes": str(128 << 20),
            "engine.prefill.max_batch": "32", "engine.prefill.dtype": "float32", "engine.prefill.device": "cpu",
            "engine.relay.max_batch": "8", "engine.relay.threads": "1", "engine.relay.kv_cache_bytes": str(128 << 20),
            "engine.main_decode.site": "b", "engine.main_decode.max_batch": "128",
            "engine.main_decode.kv_cache_bytes": str(1 << 30), "engine.main_decode.prefix_cache_bytes": str(1 << 29),
            "engine.main_decode.threads": "default", "sites.chips": "a=h100-sxm,b=h20",
            "chip.a": "h100-sxm", "chip.b": "h20"}
    assert {k: params.get(k) for k in want} == want
    assert json.loads(params["engines"])["relay"] == {"max_batch": 8, "threads": 1}
    assert engine_params(load_config({}))["engines"] == ""  # a graph without engines logs its base model per role
