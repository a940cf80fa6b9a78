"""Launch for real, end to end: `ray up` a two-site cluster, `serve deploy` the graph, `ray down`.

    python -m evaluations.launch.e2e                  # about 5 minutes; one JSON line at the end

What it does, each step as a user would type it (README.md, "Launch on your hosts"):

1. `python -m evaluations.launch.hosts up`: two emulated hosts on this machine (network, PID and mount
   namespaces of their own, sshd on each; site a 10.197.0.11, site b 10.197.0.12);
2. `python -m pdd_serve.launch validate|secrets|preflight` on the cluster config;
3. `ray up -y cluster_configs/local-two-site.yaml`: Ray's `local` provider reaches the head over
   ssh, rsyncs the repo and the secrets, runs the setup and start commands (the template every
   provider shares), and the head's autoscaler starts the worker over ssh the same way;
4. `ray exec ... wait-nodes` on the head: both hosts alive, labelled pdd.site=a and b;
5. `ray exec ... serve deploy`: graphs/pdd.yaml with HTTP on the head's address behind API keys and
   KV Flight between the hosts over TLS;
6. OpenAI requests to the head with an API key (and one without, which must get 401): a short
   prompt (P-MD) and a 1200-token cold one (P-RLD-MD across the hosts), greedy output compared token
   by token with one local engine's greedy generate;
7. `ray down -y`, `evaluations.launch.hosts down`, then a look for anything left: namespaces, links,
   processes, the hosts' files, the launcher's temp files.

Teardown runs however the run ended. `--config` takes another local-provider config (the tests use
broken copies: a wrong key, an unreachable worker, a host without its site label), which must fail
at the step that catches it with a message saying what to fix, and leave nothing behind.

Ray 2.60's `ray up` starts autoscaler v2 by default, which never launches a local-provider worker
(it keeps "Adding 1 node" and loses track of the head); `RAY_UP_enable_autoscaler_v2=0` selects the
v1 autoscaler that the local provider works with. This script sets it; a user must too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evaluations.launch.hosts import HostsConfig, HostsError
from evaluations.launch.hosts import down as hosts_down
from evaluations.launch.hosts import leftovers as hosts_leftovers
from evaluations.launch.hosts import up as hosts_up

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = "cluster_configs/local-two-site.yaml"
LAUNCH_ENV = {"RAY_UP_enable_autoscaler_v2": "0"}  # see the module docstring


class LaunchE2EError(RuntimeError):
    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step


@dataclass(frozen=True)
class LaunchE2EConfig:
    config: str = DEFAULT_CONFIG  # relative to the repo root, as `ray up` is run from there
    secrets_dir: str = ".pdd/launch"  # what the config's file_mounts carry to ~/.pdd/launch
    up_timeout_s: float = 900.0  # `ray up`: the head's venv from the wheel directory, then Ray
    nodes_timeout_s: float = 420.0  # the worker: the head's autoscaler installs and starts it
    deploy_timeout_s: float = 420.0  # every host builds the small model on first use
    request_timeout_s: float = 300.0
    preflight_timeout_s: float = 8.0
    cold_prompt_tokens: int = 1200  # its KV needs > wan_budget over the 16 Mbit/s line: P-RLD-MD
    cold_max_tokens: int = 800  # long enough that main decode takes over: the relay alone ran 300 in 1.7 s, the KV needs ~1.5 s
    short_max_tokens: int = 24
    http_port: int = 8000
    hosts: HostsConfig = field(default_factory=HostsConfig)

    def __post_init__(self) -> None:
        for name in ("up_timeout_s", "nodes_timeout_s", "deploy_timeout_s", "request_timeout_s", "preflight_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.cold_prompt_tokens < 64 or self.cold_max_tokens < 1 or self.short_max_tokens < 1:
            raise ValueError("cold_prompt_tokens >= 64, cold_max_tokens and short_max_tokens >= 1")


def _log(msg: str) -> None:
    print(f"[launch_e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Launch:
    """One run's commands: from the repo root, with the launcher's temp files in a directory of its own."""

    def __init__(self, cfg: LaunchE2EConfig, run_dir: Path, log_dir: Path) -> None:
        self.cfg, self.run_dir, self.log_dir = cfg, run_dir, log_dir
        self.env = {**os.environ, **LAUNCH_ENV, "TMPDIR": str(run_dir), "PYTHONUNBUFFERED": "1"}
        self.env.pop("RAY_ADDRESS", None)

    def sh(self, step: str, cmd: list[str], timeout_s: float, check: bool = True) -> subprocess.CompletedProcess:
        """Run a command with its output streamed to `<log_dir>/<step>.log` (follow it while it runs)."""
        log_path = self.log_dir / f"{step}.log"
        with open(log_path, "ab") as f:
            f.write(f"$ {' '.join(cmd)}\n".encode())
            f.flush()
            start = f.tell()
            # a session of its own: a timeout ends the command's ssh and rsync children too
            p = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL, stdout=f,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                raise LaunchE2EError(step, f"`{' '.join(cmd[:4])} ...` did not finish in {timeout_s:.0f}s "
                                           f"(its output: {log_path})") from None
            r = subprocess.CompletedProcess(cmd, rc)
        with open(log_path, "rb") as f:
            f.seek(start)
            r.stdout = f.read().decode(errors="replace")
        if check and r.returncode != 0:
            tail = "\n".join(r.stdout.strip().splitlines()[-15:])
            raise LaunchE2EError(step, f"`{' '.join(cmd[:4])} ...` failed (exit {r.returncode}; {log_path}):\n{tail}")
        return r

    def pdd(self, step: str, *args: str, timeout_s: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
        return self.sh(step, [sys.executable, "-m", "pdd_serve.launch", *args], timeout_s, check)

    def ray(self, step: str, *args: str, timeout_s: float, check: bool = True) -> subprocess.CompletedProcess:
        return self.sh(step, [str(Path(sys.executable).parent / "ray"), *args], timeout_s, check)

    def on_head(self, step: str, command: str, timeout_s: float, check: bool = True) -> subprocess.CompletedProcess:
        # the head's login shell has ~/pdd-venv/bin first on PATH (the setup commands put it there)
        return self.ray(step, "exec", self.cfg.config, f"RAY_AUTH_MODE=token {command}", timeout_s=timeout_s,
                        check=check)


def _ssh_control_dirs() -> set[str]:
    # the launcher's ssh ControlPath directories: /tmp/ray_ssh_<hash>, whatever TMPDIR says
    return {str(p) for p in Path("/tmp").glob("ray_ssh_*")}


def _reference(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """One local engine's greedy generate: the outputs the launched cluster must reproduce."""
    from pdd_serve.checkpoints import default_model_path
    from pdd_serve.engine.engine import Engine
    from pdd_serve.engine.sampling import SamplingParams

    eng = Engine.from_pretrained(default_model_path())
    return [eng.generate_batch([p], SamplingParams(max_tokens=n, ignore_eos=True))[0]
            for p, n in zip(prompts, max_tokens, strict=True)]


def _cold_prompt(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def _wait_http(launch: Launch, url: str, key: str, timeout_s: float) -> float:
    """Until /v1/models answers with the API key; `serve status` is read now and then so a failed
    deployment ends the wait with its message instead of running into the timeout."""
    import httpx

    t0 = time.monotonic()
    next_status = t0 + 45.0
    last = "no answer yet"
    while time.monotonic() - t0 < timeout_s:
        try:
            r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5.0)
            if r.status_code == 200:
                return time.monotonic() - t0
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > next_status:
            st = launch.on_head("serve-status", "serve status", timeout_s=60, check=False).stdout
            if "DEPLOY_FAILED" in st or "UNHEALTHY" in st:
                raise LaunchE2EError("serve deploy", "a deployment failed on the cluster:\n" + st[-1500:])
            next_status = time.monotonic() + 45.0
        time.sleep(2.0)
    raise LaunchE2EError("serve deploy", f"{url}/v1/models did not answer 200 within {timeout_s:.0f}s (last: {last}); "
                                         f"see `ray exec {launch.cfg.config} 'RAY_AUTH_MODE=token serve status'`")


def _requests(cfg: LaunchE2EConfig, url: str, key: str) -> dict[str, Any]:
    import httpx

    no_key = httpx.post(f"{url}/v1/completions", json={"model": "pdd-small", "prompt": [5, 6, 7], "max_tokens": 2},
                        timeout=30)
    cases = [("short", list(range(40, 72)), cfg.short_max_tokens),
             ("cold", _cold_prompt(23, cfg.cold_prompt_tokens), cfg.cold_max_tokens)]
    got, infos = [], []
    for name, prompt, n in cases:
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=cfg.request_timeout_s,
                       json={"model": "pdd-small", "prompt": prompt, "max_tokens": n, "temperature": 0,
                             "ignore_eos": True, "return_token_ids": True})
        if r.status_code != 200:
            raise LaunchE2EError("requests", f"{name}: HTTP {r.status_code}: {r.text[:300]}")
        body = r.json()
        got.append(body["choices"][0]["token_ids"])
        infos.append({"case": name, "prompt_tokens": len(prompt), "max_tokens": n, "wall_s": round(time.monotonic() - t0, 2),
                      **{k: body.get("pdd", {}).get(k) for k in ("pipeline", "handoff_mode", "eager_tokens",
                                                                   "md_tokens", "handoff_batches")}})
        _log(f"{name}: {len(prompt)}-token prompt, {n} tokens via {infos[-1]['pipeline']} in {infos[-1]['wall_s']}s")
    want = _reference([c[1] for c in cases], [c[2] for c in cases])
    mismatched = [c[0] for c, g, w in zip(cases, got, want, strict=True) if g != w]
    return {"requests": infos, "outputs_identical": not mismatched, "mismatched": mismatched,
            "pipelines_seen": sorted({i["pipeline"] for i in infos if i["pipeline"]}),
            "no_key_status": no_key.status_code}


def _ssh_logins(hosts: HostsConfig) -> dict[str, int]:
    out = {}
    for name, _ip in hosts.hosts:
        with contextlib.suppress(OSError):
            out[name] = (hosts.dir(name) / "sshd.log").read_text(errors="replace").count("Accepted publickey")
    return out


def run(cfg: LaunchE2EConfig = LaunchE2EConfig(), log_dir: Path | None = None) -> dict[str, Any]:
    """The whole launch; returns the result (`ok` false and `failed_step`/`error` on a failure).
    Never leaves the cluster or the hosts behind."""
    from pdd_serve.launch.configs import LaunchConfigError, validate_cluster_config

    log_dir = log_dir or REPO / ".pdd/launch_e2e"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    run_dir = Path(tempfile.mkdtemp(prefix="pdd-launch-e2e-"))
    ssh_dirs_before = _ssh_control_dirs()
    launch = Launch(cfg, run_dir, log_dir)
    out: dict[str, Any] = {"provider": "local", "config": cfg.config, "launched": False, "nodes": 0, "sites": [],
                           "serve_deployed": False, "pipelines_seen": [], "outputs_identical": False,
                           "ssh_used": False, "torn_down": False, "launch_s": None, "logs": str(log_dir)}
    t_start = time.monotonic()
    ray_up_started = False
    try:
        with contextlib.chdir(REPO):  # the config's relative paths (graph, key) are from the repo root
            try:
                check = validate_cluster_config(cfg.config)
            except LaunchConfigError as e:
                raise LaunchE2EError("validate", str(e)) from None
        if check.provider != "local":
            raise LaunchE2EError("validate", f"{cfg.config}: provider.type is {check.provider}; this evaluation "
                                             "launches the local provider on emulated hosts")
        _log(f"{cfg.config}: valid; making the hosts")
        try:
            hosts_up(cfg.hosts, log=_log)
        except HostsError as e:
            raise LaunchE2EError("hosts up", str(e)) from None
        launch.pdd("secrets", "secrets", cfg.config, "--out", cfg.secrets_dir)
        t_pre = time.monotonic()
        r = launch.pdd("preflight", "preflight", cfg.config, "--timeout", str(cfg.preflight_timeout_s), check=False)
        out["preflight_s"] = round(time.monotonic() - t_pre, 1)
        if r.returncode != 0:
            raise LaunchE2EError("preflight", r.stdout.strip())
        _log("preflight: every host answers ssh; ray up (head: venv from the wheel directory, then Ray) ...")
        t0 = time.monotonic()
        ray_up_started = True
        launch.ray("ray up", "up", "-y", "--no-config-cache", cfg.config, timeout_s=cfg.up_timeout_s)
        out["ray_up_s"] = round(time.monotonic() - t0, 1)
        _log(f"head up in {out['ray_up_s']}s; waiting for the worker (the head's autoscaler starts it over ssh) ...")
        r = launch.on_head("wait-nodes", f"python -m pdd_serve.launch wait-nodes ~/pdd_serve/{cfg.config} "
                           f"--timeout {cfg.nodes_timeout_s:.0f}", timeout_s=cfg.nodes_timeout_s + 120, check=False)
        line = next((ln for ln in reversed(r.stdout.splitlines()) if ln.startswith("{")), None)
        if r.returncode != 0 or line is None:
            raise LaunchE2EError("wait-nodes", "\n".join(r.stdout.strip().splitlines()[-12:]))
        nodes = json.loads(line)["nodes"]
        out.update(nodes=len(nodes), sites=sorted({n["labels"].get("pdd.site", "") for n in nodes}),
                   node_ips={n["labels"].get("pdd.site", ""): n["ip"] for n in nodes}, launched=True,
                   launch_s=round(time.monotonic() - t0, 1))
        _log(f"cluster up in {out['launch_s']}s: {out['node_ips']}; serve deploy ...")
        graph = (REPO / check.graph_path).resolve().relative_to(REPO)  # where it is in the rsynced repo
        t1 = time.monotonic()
        launch.on_head("serve deploy", f"serve deploy ~/pdd_serve/{graph}", timeout_s=300)
        url = f"http://{_head_ip(check)}:{cfg.http_port}"
        key = (REPO / cfg.secrets_dir / "api_keys").read_text().split()[0]
        _wait_http(launch, url, key, cfg.deploy_timeout_s)
        out.update(serve_deployed=True, deploy_s=round(time.monotonic() - t1, 1), url=url)
        _log(f"serving at {url} after {out['deploy_s']}s; requests ...")
        out.update(_requests(cfg, url, key))
        st = launch.on_head("serve-status", "serve status", timeout_s=60, check=False).stdout
        out["serve_status_healthy"] = "HEALTHY" in st and "UNHEALTHY" not in st
        out["ok"] = True
    except LaunchE2EError as e:
        out.update(ok=False, failed_step=e.step, error=str(e))
        _log(f"FAILED at {e.step}: {e}")
    except Exception as e:  # a bug here: still torn down, still one JSON line
        out.update(ok=False, failed_step="launch_e2e", error=f"{type(e).__name__}: {e}")
        _log(f"FAILED: {type(e).__name__}: {e}")
    finally:
        out.update(_teardown(cfg, launch, ray_up_started, ssh_dirs_before))
        shutil.rmtree(run_dir, ignore_errors=True)
        out["total_s"] = round(time.monotonic() - t_start, 1)
    return out


def _head_ip(check: Any) -> str:
    return next(t.hosts[0] for t in check.node_types if t.is_head)


def _teardown(cfg: LaunchE2EConfig, launch: Launch, ray_up_started: bool, ssh_dirs_before: set[str]) -> dict[str, Any]:
    """`ray down`, the hosts down, then what is left. Runs whatever happened before."""
    res: dict[str, Any] = {"ssh_logins": _ssh_logins(cfg.hosts)}
    res["ssh_used"] = ray_up_started and all(res["ssh_logins"].get(n, 0) > 0 for n, _ in cfg.hosts.hosts)
    t0 = time.monotonic()
    if ray_up_started:  # each step on its own: one failing does not skip the next
        _log("ray down ...")
        try:
            r = launch.ray("ray down", "down", "-y", cfg.config, timeout_s=300, check=False)
            res["ray_down_rc"] = r.returncode
        except (LaunchE2EError, OSError) as e:
            res["ray_down_rc"] = None
            _log(f"ray down: {e}")
    try:
        hosts_down(cfg.hosts, log=_log)  # ends whatever `ray down` did not (the hosts' PID namespaces)
    except Exception as e:  # noqa: BLE001 - reported through the leftovers below
        _log(f"hosts down: {type(e).__name__}: {e}")
    new_ssh = _ssh_control_dirs() - ssh_dirs_before
    for d in new_ssh:
        shutil.rmtree(d, ignore_errors=True)
    time.sleep(0.5)
    left = hosts_leftovers(cfg.hosts)
    left["launcher_processes"] = _launcher_processes()
    left["temp_files"] = sorted(_ssh_control_dirs() - ssh_dirs_before)
    res["leftovers"] = {k: v for k, v in left.items() if v}
    res["torn_down"] = not res["leftovers"]
    res["teardown_s"] = round(time.monotonic() - t0, 1)
    return res


def _launcher_processes() -> list[str]:
    """ssh masters, `ray up` children: anything still talking to the hosts' addresses."""
    out = []
    me = os.getpid()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == me:
            continue
        with contextlib.suppress(OSError):
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "10.197.0." in cmd or "ray_ssh_" in cmd:
                out.append(f"{p.name} {cmd[:120]}")
    return out


def table(res: dict[str, Any]) -> str:
    rows = [("step", "result")]
    rows += [("validate + hosts + secrets + preflight", f"{res.get('preflight_s', '-')} s preflight")]
    rows += [("ray up (head)", f"{res.get('ray_up_s', '-')} s"),
             ("both nodes labelled", f"{res.get('launch_s', '-')} s: {res.get('node_ips', {})}"),
             ("serve deploy to HTTP 200", f"{res.get('deploy_s', '-')} s"),
             ("requests without a key", f"HTTP {res.get('no_key_status', '-')}")]
    for r in res.get("requests", []):
        rows.append((f"{r['case']} ({r['prompt_tokens']} tok, {r['max_tokens']} out)",
                     f"{r['pipeline']} in {r['wall_s']} s, eager {r['eager_tokens']} / md {r['md_tokens']}"))
    rows += [("outputs identical to one engine", str(res.get("outputs_identical"))),
             ("ssh logins per host", str(res.get("ssh_logins"))),
             ("torn down, nothing left", f"{res.get('torn_down')} {res.get('leftovers') or ''}")]
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluations.launch.e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"local-provider cluster config (default {DEFAULT_CONFIG})")
    p.add_argument("--up-timeout", type=float, default=900.0, help="seconds for `ray up` (default 900)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("error: the emulated hosts need root (network, PID and mount namespaces)", file=sys.stderr)
        return 2
    res = run(LaunchE2EConfig(config=args.config, up_timeout_s=args.up_timeout))
    print(table(res), file=sys.stderr)
    print(json.dumps(res))
    return 0 if res.get("ok") and res["torn_down"] else 1


if __name__ == "__main__":
    sys.exit(main())
