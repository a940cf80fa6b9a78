"""The launcher configs' shared template, the secrets they mount, and the checks around `ray up`
(pure parts; tests/evaluations/test_launch_e2e.py runs the launch itself)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from pdd_serve.launch.checks import missing_nodes
from pdd_serve.launch.cli import main
from pdd_serve.launch.configs import LaunchConfigError, node_args, validate_cluster_config
from pdd_serve.launch.template import (
    GENERATED_MARK,
    RAY_VERSION,
    TORCH_VERSION,
    LaunchSpec,
    render_tail,
    rendered,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "cluster_configs").glob("*-two-site.yaml"))
LOCAL = ROOT / "cluster_configs/local-two-site.yaml"
COMMAND_KEYS = ("setup_commands", "head_setup_commands", "worker_setup_commands", "head_start_ray_commands",
                "worker_start_ray_commands")


def test_every_shipped_config_is_rendered_from_its_metadata() -> None:
    assert len(CONFIGS) == 4
    assert main(["render", "--check", *map(str, CONFIGS)]) == 0


def test_every_provider_runs_the_same_commands_but_for_packages_and_node_args() -> None:
    """What the local launch runs is what runs on cloud VMs: the commands differ only where the
    metadata says (pip sources, the head's torch index, the provider SDK, node-args, ray_start_args)."""
    docs = {p.name: yaml.safe_load(p.read_text()) for p in CONFIGS}
    for name, doc in docs.items():
        spec = LaunchSpec.from_metadata(doc["metadata"]["pdd"].get("launch"))
        plain = yaml.safe_load(render_tail(LaunchSpec(node_args=spec.node_args), name))
        strip = [a for a in (spec.pip_args, spec.head_torch_args, spec.ray_start_args, *spec.extra_packages) if a]
        for key in COMMAND_KEYS:
            got = [" ".join(c.split()) for c in doc[key]]
            for a in strip:
                got = [" ".join(c.replace(a, " ").split()) for c in got]
            assert got == [" ".join(c.split()) for c in plain[key]], (name, key)
        assert doc["file_mounts"] == {"~/pdd_serve": ".", "~/.pdd/launch": ".pdd/launch"}
        heads = " ".join(doc["head_setup_commands"])
        assert f"torch=={TORCH_VERSION}" in heads and f"ray[default,serve]=={RAY_VERSION}" in heads


def test_folded_commands_read_back_as_one_line_each() -> None:
    doc = yaml.safe_load(LOCAL.read_text())
    start = doc["head_start_ray_commands"][1]
    assert "\n" not in start and "ray start --head --port=6379 --object-manager-port=8076" in start
    assert "node-args ~/pdd_serve/cluster_configs/local-two-site.yaml)\" && ray start" in start
    assert start.endswith("$PDD_NODE_ARGS --autoscaling-config=~/ray_bootstrap_config.yaml")
    assert "--object-store-memory=500000000" in doc["worker_start_ray_commands"][1]
    assert all(c.startswith("~/pdd-venv/bin/pip install -q --no-index --find-links http://10.197.0.1:8999/")
               for c in doc["worker_setup_commands"])


@pytest.mark.parametrize(("meta", "pattern"), [
    ({"pip_args": "--index-url 'x'"}, r"^pip_args: one line of shell words without single quotes"),
    ({"ray_start_args": "a\nb"}, r"^ray_start_args: one line"),
    ({"head_torch_args": '--index-url "unclosed'}, r"^head_torch_args: not valid shell words"),
    ({"extra_packages": "boto3"}, r"^extra_packages: a list of package names"),
    ({"extra_packages": ["a b"]}, r"^extra_packages: a list of package names"),
    ({"node_args": "yes"}, r"^node_args: true or false"),
    ({"python": " "}, r"^python: empty"),
    ({"pip_arg": "-q"}, r"^pip_arg: unknown key; valid: extra_packages, head_torch_args, node_args, pip_args"),
    (["pip_args"], r"^must be a mapping"),
], ids=["quote", "newline", "shell-words", "packages-str", "package-space", "node-args-str", "python-empty",
        "typo", "not-mapping"])
def test_launch_spec_refuses_bad_metadata_naming_the_key(meta, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        LaunchSpec.from_metadata(meta)


def _copy(tmp_path: Path, edit=lambda t: t, name: str = "local-two-site.yaml") -> Path:
    p = tmp_path / name
    p.write_text(edit(LOCAL.read_text()))
    return p


def test_validate_refuses_drift_and_bad_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    ok = _copy(tmp_path)
    validate_cluster_config(ok)
    drifted = _copy(tmp_path, lambda t: t.replace("  - ray stop\n", "  - ray stop --force\n", 1), "drift.yaml")
    with pytest.raises(LaunchConfigError, match=r"drift\.yaml: setup_commands: the generated commands differ from "
                                                r"metadata\.pdd\.launch .*run `python -m pdd_serve\.launch render"):
        validate_cluster_config(drifted)
    assert main(["render", "--check", str(drifted)]) == 1
    assert main(["render", str(drifted)]) == 0  # rewrites it: now it matches
    assert "ray stop --force" not in drifted.read_text()
    validate_cluster_config(drifted)
    bad = _copy(tmp_path, lambda t: t.replace("      node_args: true\n", "      node_args: maybe\n"), "bad.yaml")
    with pytest.raises(LaunchConfigError, match=r"bad\.yaml: metadata\.pdd\.launch\.node_args: true or false"):
        validate_cluster_config(bad)
    hand = _copy(tmp_path, lambda t: t.split(GENERATED_MARK)[0] + "setup_commands: [echo hi]\n", "hand.yaml")
    with pytest.raises(LaunchConfigError, match=r"not generated from the shared template: add metadata\.pdd\.launch"):
        validate_cluster_config(hand)


def test_render_writes_the_config_name_into_node_args(tmp_path: Path) -> None:
    p = _copy(tmp_path, name="mine-two-site.yaml")
    doc = yaml.safe_load(rendered(p, yaml.safe_load(p.read_text())))
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert "node-args ~/pdd_serve/cluster_configs/mine-two-site.yaml)" in doc[key][1]


def test_local_node_args_name_each_hosts_site_and_address() -> None:
    assert node_args(LOCAL, "10.197.0.11") == ["--labels=pdd.site=a,pdd.chip=cpu", "--node-ip-address=10.197.0.11",
                                               '--resources={"site_a":1000}']
    assert node_args(LOCAL, "10.197.0.12")[:2] == ["--labels=pdd.site=b,pdd.chip=cpu", "--node-ip-address=10.197.0.12"]
    with pytest.raises(LaunchConfigError, match=r"host 10\.197\.0\.13 is in no node type's hosts"):
        node_args(LOCAL, "10.197.0.13")


def _node(ip: str, alive: bool = True, **labels: str) -> dict:
    return {"ip": ip, "alive": alive, "labels": labels, "death_reason": "" if alive else "raylet died"}


def test_missing_nodes_names_each_host_and_what_it_lacks() -> None:
    want = {"10.0.0.1": {"pdd.site": "a"}, "10.0.0.2": {"pdd.site": "b"}}
    assert missing_nodes(want, [_node("10.0.0.1", **{"pdd.site": "a"}), _node("10.0.0.2", **{"pdd.site": "b"})]) == []
    assert missing_nodes(want, [_node("10.0.0.1", **{"pdd.site": "a"})]) == ["10.0.0.2: not in the cluster"]
    dead = missing_nodes(want, [_node("10.0.0.1", **{"pdd.site": "a"}), _node("10.0.0.2", alive=False)])
    assert dead == ["10.0.0.2: not in the cluster (died: raylet died)"]
    unlabelled = missing_nodes(want, [_node("10.0.0.1", **{"pdd.site": "a"}), _node("10.0.0.2")])
    assert len(unlabelled) == 1 and re.match(r"10\.0\.0\.2: joined without pdd\.site=b \(has no labels\): its "
                                             r"`ray start` must pass `--labels`", unlabelled[0])
    wrong = missing_nodes(want, [_node("10.0.0.1", **{"pdd.site": "b"}), _node("10.0.0.2", **{"pdd.site": "b"})])
    assert wrong[0].startswith("10.0.0.1: joined without pdd.site=a (has {'pdd.site': 'b'})")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_secrets_are_private_kept_across_runs_and_the_cert_follows_the_hosts(tmp_path: Path) -> None:
    from pdd_serve.launch.keys import cert_names, make_secrets

    out = tmp_path / "launch"
    made = make_secrets(out, ["10.1.2.3", "md.example"])
    assert sorted(made) == ["api_keys", "flight_token", "ray_auth_token", "tls/ca.crt", "tls/md.crt", "tls/md.key"]
    assert (out.stat().st_mode & 0o777) == 0o700
    assert all((p.stat().st_mode & 0o077) == 0 for p in out.rglob("*") if p.is_file())
    assert cert_names(out / "tls/md.crt") == {"IP:10.1.2.3", "DNS:md.example"}
    key = (out / "api_keys").read_text()
    assert key.startswith("sk-") and make_secrets(out, ["10.1.2.3"]) == []  # complete: nothing remade
    assert make_secrets(out, ["10.9.9.9"]) == ["tls/ca.crt", "tls/md.crt", "tls/md.key"]  # other hosts: remade
    assert cert_names(out / "tls/md.crt") == {"IP:10.9.9.9"} and (out / "api_keys").read_text() == key


def test_cli_help_names_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for sub in ("validate", "node-args", "render", "preflight", "wait-nodes", "secrets"):
        assert sub in text
