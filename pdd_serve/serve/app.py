"""`build_app(args)`: the graph every YAML under graphs/ imports (`pdd_serve.serve.app:build_app`).

One PDDConfig flows from the YAML's `args` into every deployment; each deployment is pinned to
its site's nodes by a `pdd.site` label selector (the YAML may restate the same options).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from ray.serve import Application

from pdd_serve.config import PDDConfig, load_config
from pdd_serve.serve.common import actor_options
from pdd_serve.serve.line import Line, needs_line
from pdd_serve.serve.main_decode import MainDecode
from pdd_serve.serve.prefill import Prefill
from pdd_serve.serve.relay import Relay
from pdd_serve.serve.router import Router


def build_app(args: dict[str, Any] | PDDConfig | None = None) -> Application:
    cfg = load_config(args)
    if cfg.flight.token is None:  # one random Flight token per deployed graph, shared by P and MD
        cfg = dataclasses.replace(cfg, flight=dataclasses.replace(cfg.flight, token=secrets.token_urlsafe(24)))
    if cfg.flight.mac_key is None:  # one random KV MAC key per deployed graph: only P and MD hold it
        cfg = dataclasses.replace(cfg, flight=dataclasses.replace(cfg.flight, mac_key=secrets.token_urlsafe(32)))
    s = cfg.sites
    # one line per site pair, whatever the number of Prefill replicas: they all book on it. It only
    # keeps a ledger (no CPU reserved, as Serve's controller), at the senders' site
    line = (Line.options(ray_actor_options=actor_options(cfg, s.prefill, num_cpus=0)).bind(cfg)
            if needs_line(cfg) else None)
    prefill = Prefill.options(num_replicas=s.prefill_replicas,
                              ray_actor_options=actor_options(cfg, s.prefill)).bind(cfg, line)
    relay = None
    if cfg.uses_relay:
        relay = Relay.options(num_replicas=s.relay_replicas, ray_actor_options=actor_options(cfg, s.relay)).bind(cfg)
    # one deployment: the graph's `deployments:` entry for MainDecode sets `num_replicas` or an
    # `autoscaling_config` as for any Serve deployment (`sites.main_decode_replicas` is the default)
    md = MainDecode.options(num_replicas=s.main_decode_replicas, ray_actor_options=actor_options(cfg, s.main_decode)).bind(cfg)
    return Router.options(num_replicas=s.router_replicas,
                          ray_actor_options=actor_options(cfg, s.router, num_cpus=0.25)).bind(cfg, prefill, relay, md)
