"""`ray up` for real on two emulated hosts (evaluations/launch/e2e.py): the launch works end to end,
and a broken config fails at the step that catches it, in bounded time, leaving nothing behind.

Needs root (network, PID and mount namespaces) and installs sshd/rsync when missing; the launch
takes about five minutes on two cores.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from evaluations.launch.e2e import LaunchE2EConfig, run
from pdd_serve.launch.template import rendered

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "cluster_configs/local-two-site.yaml"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (namespaces)")


def _variant(tmp_path: Path, name: str, edit) -> str:
    p = tmp_path / name
    p.write_text(edit(LOCAL.read_text()))
    p.write_text(rendered(p, yaml.safe_load(p.read_text())))  # its generated commands name the copy
    return str(p)


def _assert_nothing_left(res: dict) -> None:
    assert res["torn_down"], res.get("leftovers")
    assert not any(Path("/tmp").glob("pdd-launch-e2e-*"))


def test_wrong_key_and_unreachable_worker_fail_at_preflight_and_leave_nothing(tmp_path: Path) -> None:
    key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    wrong_key = _variant(tmp_path, "wrong-key.yaml",
                         lambda t: t.replace("ssh_private_key: .pdd/hosts/id_ed25519", f"ssh_private_key: {key}"))
    res = run(LaunchE2EConfig(config=wrong_key, secrets_dir=str(tmp_path / "s1")), log_dir=tmp_path / "log1")
    assert res["ok"] is False and res["failed_step"] == "preflight", res
    assert re.search(rf"10\.197\.0\.11: refused the key {re.escape(str(key))} for user root: add "
                     rf"{re.escape(str(key))}\.pub to ~root/\.ssh/authorized_keys", res["error"]), res["error"]
    assert res["preflight_s"] < 30 and not res["launched"]
    _assert_nothing_left(res)

    # a worker address where nothing answers (on the hosts' bridge: ARP gets no reply)
    unreachable = _variant(tmp_path, "unreachable.yaml", lambda t: t.replace("10.197.0.12", "10.197.0.13"))
    res = run(LaunchE2EConfig(config=unreachable, secrets_dir=str(tmp_path / "s2"), preflight_timeout_s=5),
              log_dir=tmp_path / "log2")
    assert res["ok"] is False and res["failed_step"] == "preflight", res
    assert "10.197.0.13: did not answer ssh within 5s" in res["error"] and "10.197.0.11" not in res["error"]
    assert res["preflight_s"] < 30
    _assert_nothing_left(res)


def test_a_host_without_its_site_label_is_refused_before_anything_starts(tmp_path: Path) -> None:
    def unlabel(t: str) -> str:
        return t.replace("labels: {pdd.site: b, pdd.chip: cpu}", "labels: {pdd.chip: cpu}")

    res = run(LaunchE2EConfig(config=_variant(tmp_path, "unlabelled.yaml", unlabel)), log_dir=tmp_path / "log")
    assert res["ok"] is False and res["failed_step"] == "validate", res
    assert "metadata.pdd.node_types.site_b.labels: missing pdd.site" in res["error"]
    assert res["total_s"] < 30 and not res["ssh_used"]
    _assert_nothing_left(res)


def test_ray_up_serve_deploy_requests_ray_down(tmp_path: Path) -> None:
    """The issue's end to end: two labelled nodes over ssh, the secure graph deployed, P-MD and
    P-RLD-MD across the hosts with output identical to one engine, and nothing left after."""
    res = run(LaunchE2EConfig(), log_dir=tmp_path / "log")
    assert res["ok"], (res.get("error"), res.get("logs"))
    assert res["launched"] and res["nodes"] == 2 and res["sites"] == ["a", "b"]
    assert res["node_ips"] == {"a": "10.197.0.11", "b": "10.197.0.12"}
    assert res["serve_deployed"] and res["serve_status_healthy"]
    assert res["no_key_status"] == 401  # HTTP beyond loopback: only with an API key
    assert {"P-MD", "P-RLD-MD"} <= set(res["pipelines_seen"]), res["requests"]
    cold = next(r for r in res["requests"] if r["case"] == "cold")
    # main decode on the other host took over: the prompt's KV crossed (TLS Flight), then the handoff
    assert cold["pipeline"] == "P-RLD-MD" and cold["md_tokens"] > 0 and cold["handoff_batches"] >= 1, cold
    assert res["outputs_identical"], res["mismatched"]
    assert res["ssh_used"] and all(n > 0 for n in res["ssh_logins"].values())
    assert res["provider"] == "local" and res["launch_s"] > 0
    _assert_nothing_left(res)
