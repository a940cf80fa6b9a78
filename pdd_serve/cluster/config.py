"""Settings, recorded state and driver environment of the local two-site cluster (see local.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd_serve.cluster.netns import ShapedLink, VethNamespace

SITE_LABEL = "pdd.site"
SITES = ("a", "b")
SITE_RESOURCE_UNITS = 1000  # custom resource site_a / site_b per node, the label fallback
STATE_DIR_ENV = "PDD_CLUSTER_DIR"
DEFAULT_PORT = 6390  # not Ray's 6379, so a stock `ray start --head` elsewhere doesn't collide
DEFAULT_NODE_IP = "127.0.0.1"
SERVE_DEFAULT_HTTP_PORT = 8000  # Serve's own default; the app YAML's http_options.port overrides it
MIN_OBJECT_STORE_MIB = 76  # ray: OBJECT_STORE_MINIMUM_MEMORY_BYTES = 75 MiB
# Unix socket paths are limited to 107 bytes: TEMP/session_<date>_<pid>/sockets/plasma_store.1
# adds up to ~66, so the temp dir must stay short.
MAX_TEMP_DIR_LEN = 40
STATE_FILE = "cluster.json"
TOKEN_FILE = "auth_token"
ENV_FILE = "env.sh"
LOG_DIR = "logs"
AUTH_VARS = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")


class ClusterError(RuntimeError):
    """A cluster operation failed; the message is meant for humans (no traceback needed)."""


class ShapedLinkUnavailable(ClusterError):
    """--shaped-link can't work on this machine (no root, no namespaces, no `ip`); nothing started."""


@dataclass(frozen=True)
class LocalClusterConfig:
    """Settings of the local two-site cluster; validated on construction.

    The state dir is the cluster's identity: it records the address, process groups, ports and
    token, so `cluster_down` / `cluster_status` / `driver_env` find the cluster from it alone.
    """

    port: int = DEFAULT_PORT  # GCS port of the head (site a)
    dashboard: bool = False  # off saves CPU; Serve's HTTP proxy works without it
    dashboard_port: int = 8265  # used only when dashboard is on
    cpus_a: int = 4  # logical CPUs per raylet; may exceed the physical cores
    cpus_b: int = 4
    gpus_a: int | None = None  # None: Ray autodetects (on site a only, so GPUs aren't counted twice)
    gpus_b: int = 0
    object_store_mib: int = 512  # per raylet
    state_dir: str | Path | None = None  # default $PDD_CLUSTER_DIR, else ./.pdd/cluster
    temp_dir: str | Path | None = None  # ray --temp-dir; default /tmp/pdd-ray-PORT
    node_ip: str = DEFAULT_NODE_IP  # both raylets and drivers use it, so drivers attach to site a
    start_timeout_s: float = 120.0
    # "RATE[,DELAY,JITTER,LOSS]" or a ShapedLink: site b behind a kernel-shaped veth (netns.py)
    shaped_link: ShapedLink | str | None = None

    def __post_init__(self) -> None:
        _check_port("port", self.port)
        if self.dashboard:
            _check_port("dashboard_port", self.dashboard_port)
            if self.dashboard_port == self.port:
                raise ValueError("dashboard_port must differ from port")
        for name in ("cpus_a", "cpus_b"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        for name in ("gpus_a", "gpus_b"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name} must be an int >= 0 (or None for gpus_a), got {v!r}")
        if not isinstance(self.object_store_mib, int) or self.object_store_mib < MIN_OBJECT_STORE_MIB:
            raise ValueError(f"object_store_mib must be an int >= {MIN_OBJECT_STORE_MIB} (Ray's minimum), "
                             f"got {self.object_store_mib!r}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s!r}")
        if not self.node_ip or any(c.isspace() for c in self.node_ip):
            raise ValueError(f"node_ip must be an IP address, got {self.node_ip!r}")
        sd = self.state_dir
        if sd is None:
            sd = os.environ.get(STATE_DIR_ENV) or Path.cwd() / ".pdd" / "cluster"
        object.__setattr__(self, "state_dir", Path(sd).expanduser().absolute())
        td = Path(self.temp_dir).expanduser().absolute() if self.temp_dir else Path(f"/tmp/pdd-ray-{self.port}")
        if len(str(td)) > MAX_TEMP_DIR_LEN:
            raise ValueError(f"temp_dir {str(td)!r} is too long ({len(str(td))} > {MAX_TEMP_DIR_LEN} chars): "
                             "Ray puts its unix sockets under it and socket paths are limited to 107 bytes")
        object.__setattr__(self, "temp_dir", td)
        if self.shaped_link is not None:
            link = self.shaped_link if isinstance(self.shaped_link, ShapedLink) else ShapedLink.parse(self.shaped_link)
            object.__setattr__(self, "shaped_link", link)
            host_ip = VethNamespace.for_port(self.port).host_ip
            if self.node_ip == DEFAULT_NODE_IP:  # site a must be reachable from inside the namespace
                object.__setattr__(self, "node_ip", host_ip)
            elif self.node_ip != host_ip:
                raise ValueError(f"with shaped_link, node_ip is the host end of the veth ({host_ip}), "
                                 f"got {self.node_ip!r}")

    @property
    def veth(self) -> VethNamespace | None:
        """The namespace + veth pair site b runs behind (None without a shaped link)."""
        return VethNamespace.for_port(self.port) if self.shaped_link is not None else None

    @property
    def address(self) -> str:
        return f"{self.node_ip}:{self.port}"

    @property
    def token_path(self) -> Path:
        return Path(self.state_dir) / TOKEN_FILE

    def identity(self) -> dict[str, Any]:
        """The settings a running cluster must match for `cluster_up` to reuse it."""
        return {"port": self.port, "node_ip": self.node_ip, "temp_dir": str(self.temp_dir),
                "dashboard": self.dashboard, "cpus_a": self.cpus_a, "cpus_b": self.cpus_b,
                "gpus_a": self.gpus_a, "gpus_b": self.gpus_b, "object_store_mib": self.object_store_mib,
                **({"shaped_link": self.shaped_link.spec} if isinstance(self.shaped_link, ShapedLink) else {})}


def _check_port(name: str, port: object) -> None:
    if not isinstance(port, int) or isinstance(port, bool) or not 1024 <= port <= 65535:
        raise ValueError(f"{name} must be an int in 1024..65535, got {port!r}")


@dataclass(frozen=True)
class ClusterInfo:
    """What a driver needs to know about a running local cluster."""

    address: str  # RAY_ADDRESS, "IP:PORT" of the head's GCS
    node_ids: dict[str, str]  # site -> node id (hex)
    env: dict[str, str]  # driver environment: RAY_ADDRESS, RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH
    token_path: str
    state_dir: str
    temp_dir: str
    session_dir: str | None
    dashboard_url: str | None  # None when the dashboard is off
    serve_port: int = SERVE_DEFAULT_HTTP_PORT  # where Serve's proxy (on the head, site a) listens by default
    ports: dict[str, int] = field(default_factory=dict)  # the extra ports picked at start
    already_running: bool = False  # cluster_up found it healthy and did nothing
    config: LocalClusterConfig | None = None  # the config it runs with (for cluster_status / cluster_down)
    shaped_link: dict[str, Any] | None = None  # the netns record (veth, link, kernel, describe); None: off


# ---- state ----------------------------------------------------------------------------------


def _state_path(cfg: LocalClusterConfig) -> Path:
    return Path(cfg.state_dir) / STATE_FILE


def load_state(cfg: LocalClusterConfig) -> dict[str, Any] | None:
    try:
        return json.loads(_state_path(cfg).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ClusterError(f"cannot read cluster state {_state_path(cfg)}: {e}; remove it to start over") from e


def save_state(cfg: LocalClusterConfig, state: dict[str, Any]) -> None:
    p = _state_path(cfg)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, p)


def recorded_config(cfg: LocalClusterConfig, state: dict[str, Any] | None) -> LocalClusterConfig:
    """cfg with the address-defining fields taken from the recorded state, when there is one."""
    if not state:
        return cfg
    ident = state.get("identity", {})
    try:
        return LocalClusterConfig(port=ident["port"], node_ip=ident["node_ip"], temp_dir=ident["temp_dir"],
                                  state_dir=cfg.state_dir, start_timeout_s=cfg.start_timeout_s)
    except (KeyError, ValueError):
        return cfg


def driver_env(cfg: LocalClusterConfig) -> dict[str, str]:
    """Environment a driver (`ray.init`, `serve run`, `ray status`) needs for this cluster.

    RAY_ADDRESS: the head's GCS; RAY_AUTH_MODE=token: without it a driver given an address does not
    send the token (and retries InvalidAuthToken forever); RAY_AUTH_TOKEN_PATH: the cluster's token
    file. Also make sure RAY_AUTH_TOKEN is unset in that environment (it would win over the path).
    Read from the recorded state when there is one, else derived from cfg (same values).
    """
    rcfg = recorded_config(cfg, load_state(cfg))
    return {"RAY_ADDRESS": rcfg.address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(rcfg.token_path)}


def apply_driver_env(cfg: LocalClusterConfig, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Put `driver_env` into `environ` (default os.environ) and drop RAY_AUTH_TOKEN.

    Returns the previous values (None-able via absence) so a caller can restore them. If ray is
    already imported in this process, its cached auth config is refreshed too.
    """
    environ = os.environ if environ is None else environ
    old = {k: environ[k] for k in (*AUTH_VARS, "RAY_AUTH_TOKEN") if k in environ}
    environ.pop("RAY_AUTH_TOKEN", None)
    environ.update(driver_env(cfg))
    if environ is os.environ:
        refresh_ray_auth_config()
    return old


def refresh_ray_auth_config() -> None:
    """Make an already-imported ray re-read RAY_AUTH_* (it caches them at import / first use)."""
    if "ray._raylet" not in sys.modules:
        return
    with contextlib.suppress(Exception):
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def ray_subprocess_env(cfg: LocalClusterConfig) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_ADDRESS", None)
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN_PATH"] = str(cfg.token_path)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def env_lines(cfg: LocalClusterConfig) -> list[str]:
    """Shell lines for `eval "$(pdd cluster env)"`."""
    lines = [f"export {k}={shlex.quote(v)}" for k, v in driver_env(cfg).items()]
    lines.append("unset RAY_AUTH_TOKEN")
    return lines
