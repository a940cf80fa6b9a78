"""The shared local two-site Ray cluster for tests: one per test session.

Use it from tests/conftest.py:  ``from tests.cluster_fixture import ray_two_sites  # noqa: F401``
(or ``pytest -p tests.cluster_fixture``). Tests that use it are marked ``@pytest.mark.cluster``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from pdd_serve.cluster.local import (
    ClusterError,
    ClusterInfo,
    LocalClusterConfig,
    apply_driver_env,
    cluster_down,
    cluster_up,
    log_tail,
    refresh_ray_auth_config,
    spawn_reaper,
)
from tests.helpers import free_port


@pytest.fixture(scope="session")
def ray_two_sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterInfo]:
    """Two raylets labelled pdd.site=a (head) and pdd.site=b, and this process connected as a driver.

    Brought up once per session in a tmp state dir on a free port (temp dir /tmp/pdd-ray-PORT),
    with the driver env (RAY_ADDRESS, RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH) in os.environ, and
    torn down at the end; a detached reaper tears it down too if this process dies hard.
    """
    import ray

    cfg = LocalClusterConfig(port=free_port(""), state_dir=tmp_path_factory.mktemp("pdd_cluster"),
                             cpus_a=4, cpus_b=4, object_store_mib=256, start_timeout_s=180.0)
    reaper = spawn_reaper(cfg)
    try:
        info = cluster_up(cfg)
    except ClusterError as e:
        cluster_down(cfg)
        reaper.kill()
        reaper.wait()
        pytest.fail(f"could not start the local two-site Ray cluster: {e}", pytrace=False)
    old_env = apply_driver_env(cfg)
    if ray.is_initialized():  # some earlier test's local ray.init(); a driver has one cluster
        ray.shutdown()
    try:
        ray.init(address=info.address, namespace="pdd-tests", logging_level="warning")
    except Exception as e:  # noqa: BLE001 - report with the logs, whatever ray raised
        tail = log_tail(cfg)
        cluster_down(cfg)
        reaper.kill()
        reaper.wait()
        pytest.fail(f"ray.init({info.address!r}) failed: {type(e).__name__}: {e}\n{tail}", pytrace=False)
    try:
        yield info
    finally:
        if "ray.serve" in sys.modules:  # a test used Serve: stop its controller and replicas first
            try:
                sys.modules["ray.serve"].shutdown()
            except Exception:  # noqa: BLE001 - teardown goes on regardless
                pass
        ray.shutdown()
        cluster_down(cfg, remove_logs=True)
        reaper.kill()
        reaper.wait()
        for k in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"):
            if k in old_env:
                os.environ[k] = old_env[k]
            else:
                os.environ.pop(k, None)
        refresh_ray_auth_config()


def running_mds(app: str) -> dict:
    """{replica id: a handle pinned to it} for every MainDecode replica that is running now.

    Ray lists a replica's actor as soon as it is created, before Serve routes to it; a call pinned
    to a replica Serve does not know yet goes to another one (`pinning.PinnedRequestRouter`). So a
    replica counts only once its pinned `stats` is answered by itself."""
    from pdd_serve.serve.pinning import pinned_handle, replica_actors

    out = {}
    for r in sorted(replica_actors(app, "MainDecode")):
        h = pinned_handle(app, "MainDecode", r)
        try:
            if h.stats.remote().result(timeout_s=30).extra["replica"] == r:
                out[r] = h
        except Exception:  # noqa: BLE001 - starting, stopping or just killed
            pass
    return out
