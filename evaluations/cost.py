"""Hardware cost and BCR (docs/pdd.md: benefit-cost ratio = effective throughput within the SLA / cost).

A graph's cost per hour is one chip per replica of each role at that role's site (the chip a site
runs comes from the graph's `sites.chips` when it names one, else from the command line's `--chip`;
its price from the one catalog, pdd_serve/emulation/costmodel.yaml, or `--catalog`), plus the
inter-DC line when Prefill and Main decode sit at different sites. BCR is reported as SLA-meeting
requests per USD: goodput (req/s) x 3600 / cost (USD/h).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdd_serve.config import PDDConfig
from pdd_serve.emulation.costmodel import Catalog


class CatalogError(ValueError):
    """A graph's chips that can't be priced (a site without a chip, a chip the catalog lacks)."""


@dataclass(frozen=True)
class HardwareCost:
    roles: tuple[tuple[str, str, int, str, float], ...]  # (role, site, replicas, chip, USD/h per chip)
    link_per_hour: float
    cross_site: bool

    @property
    def per_hour(self) -> float:
        return sum(n * price for _, _, n, _, price in self.roles) + self.link_per_hour

    def params(self) -> dict[str, Any]:
        """MLflow params: replicas and chip per site, each chip's hourly price."""
        out: dict[str, Any] = {}
        sites = sorted({s for _, s, _, _, _ in self.roles})
        for site in sites:
            rows = [r for r in self.roles if r[1] == site]
            out[f"replicas.{site}"] = ",".join(f"{role}:{n}" for role, _, n, _, _ in rows)
            out[f"chip.{site}"] = rows[0][3]
            out[f"chip.{site}.price_per_hour"] = rows[0][4]
        out["link.price_per_hour"] = self.link_per_hour
        out["cost_per_hour_usd"] = round(self.per_hour, 6)
        return out


def effective_site_chips(cfg: PDDConfig, site_chips: Mapping[str, str]) -> dict[str, str]:
    """The chip at each site: the graph's `sites.chips` win (the deployment says what it runs on),
    `site_chips` (the command line's --chip, default cpu) fill the sites the graph leaves out."""
    return {**dict(site_chips), **cfg.sites.chip_map}


def hardware_cost(cfg: PDDConfig, site_chips: Mapping[str, str], catalog: Catalog) -> HardwareCost:
    s = cfg.sites
    from_graph = cfg.sites.chip_map
    site_chips = effective_site_chips(cfg, site_chips)
    roles = [("prefill", s.prefill, s.prefill_replicas)]
    if cfg.uses_relay:
        roles.append(("relay", s.relay, s.relay_replicas))
    roles.append(("main_decode", s.main_decode, s.main_decode_replicas))
    out = []
    for role, site, n in roles:
        if site not in site_chips:
            raise CatalogError(f"no chip given for site {site!r} (graph {cfg.graph}); pass --chip {site}=NAME "
                               f"or set sites.chips.{site} in the graph")
        name = site_chips[site]
        if name not in catalog.chips:
            msg = f"chip {name!r} is not in the catalog {catalog.path} (known: {', '.join(sorted(catalog.chips))})"
            raise CatalogError(f"graph {cfg.graph}: sites.chips.{site}: {msg}" if site in from_graph else msg)
        chip = catalog.chips[name]
        out.append((role, site, n, chip.name, float(chip.price_per_hour)))
    cross = s.prefill != s.main_decode
    return HardwareCost(tuple(out), catalog.link_price(cross), cross)


def bcr(goodput_rps: float, cost_per_hour: float) -> float:
    """SLA-meeting requests per USD."""
    if not cost_per_hour > 0 or goodput_rps is None or math.isnan(goodput_rps):
        return math.nan
    return goodput_rps * 3600.0 / cost_per_hour
