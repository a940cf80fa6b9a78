"""Hardware cost and BCR (PDD.md: benefit-cost ratio = effective throughput within the SLA / cost).

A graph's cost per hour is one chip per replica of each role at that role's site (the chip a site
runs comes from the graph's `sites.chips` when it names one, else from the command line's `--chip`;
its price from the catalog, evaluations/chips.yaml), plus the inter-DC line when Prefill and Main
decode sit at different sites. BCR is reported as SLA-meeting
requests per USD: goodput (req/s) x 3600 / cost (USD/h).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd_serve.config import PDDConfig

DEFAULT_CATALOG = Path(__file__).with_name("chips.yaml")


class CatalogError(ValueError):
    """A chip catalog that can't be used; the message names the file and entry."""


@dataclass(frozen=True)
class Chip:
    name: str
    price_per_hour: float  # USD per chip-hour
    peak_tflops: float | None = None
    memory_gb: float | None = None
    memory_bw_tbps: float | None = None
    interconnect_gbps: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.price_per_hour, (int, float)) and self.price_per_hour >= 0
                and math.isfinite(self.price_per_hour)):
            raise CatalogError(f"chip {self.name}: price_per_hour must be a number >= 0, got {self.price_per_hour!r}")


@dataclass(frozen=True)
class Catalog:
    chips: Mapping[str, Chip]
    links: Mapping[str, float] = field(default_factory=dict)  # line name -> USD/h
    path: str = ""

    def chip(self, name: str) -> Chip:
        try:
            return self.chips[name]
        except KeyError:
            raise CatalogError(f"chip {name!r} is not in the catalog {self.path or ''} "
                               f"(known: {', '.join(sorted(self.chips))})") from None

    def link_price(self, cross_site: bool) -> float:
        return float(self.links.get("cross_dc" if cross_site else "same_dc", 0.0))


def load_catalog(path: str | Path = DEFAULT_CATALOG) -> Catalog:
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise CatalogError(f"{path}: cannot read chip catalog: {e}") from None
    if not isinstance(doc.get("chips"), dict) or not doc["chips"]:
        raise CatalogError(f"{path}: expected a non-empty `chips:` mapping")
    chips = {}
    for name, entry in doc["chips"].items():
        if not isinstance(entry, dict) or "price_per_hour" not in entry:
            raise CatalogError(f"{path}: chips.{name} needs price_per_hour")
        known = {k: entry[k] for k in Chip.__dataclass_fields__ if k in entry and k != "name"}
        try:
            chips[str(name)] = Chip(str(name), **known)
        except CatalogError as e:
            raise CatalogError(f"{path}: {e}") from None
    links = {}
    for name, entry in (doc.get("links") or {}).items():
        price = entry.get("price_per_hour") if isinstance(entry, dict) else entry
        if not isinstance(price, (int, float)) or price < 0:
            raise CatalogError(f"{path}: links.{name}.price_per_hour must be a number >= 0")
        links[str(name)] = float(price)
    return Catalog(chips, links, str(path))


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
        try:
            chip = catalog.chip(site_chips[site])
        except CatalogError as e:
            if site not in from_graph:
                raise
            raise CatalogError(f"graph {cfg.graph}: sites.chips.{site}: {e}") from None
        out.append((role, site, n, chip.name, float(chip.price_per_hour)))
    cross = s.prefill != s.main_decode
    return HardwareCost(tuple(out), catalog.link_price(cross), cross)


def bcr(goodput_rps: float, cost_per_hour: float) -> float:
    """SLA-meeting requests per USD."""
    if not cost_per_hour > 0 or goodput_rps is None or math.isnan(goodput_rps):
        return math.nan
    return goodput_rps * 3600.0 / cost_per_hour
