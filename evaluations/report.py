"""What an evaluation leaves behind: side-by-side tables, TTFT CDF / sweep plots, per-request Parquet."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from evaluations.loadgen import RequestRecord

# (row label, summary key, format); seconds are printed as they are
TABLE_ROWS: tuple[tuple[str, str, str], ...] = (
    ("requests (errors)", "_requests", "s"),
    ("TTFT p50 s", "ttft_p50_s", ".3f"),
    ("TTFT p90 s", "ttft_p90_s", ".3f"),
    ("TTFT p99 s", "ttft_p99_s", ".3f"),
    ("TT2T p50 s", "tt2t_p50_s", ".3f"),
    ("TT2T p90 s", "tt2t_p90_s", ".3f"),
    ("TT2T p99 s", "tt2t_p99_s", ".3f"),
    ("TPOT p50 s", "tpot_p50_s", ".4f"),
    ("TPOT p90 s", "tpot_p90_s", ".4f"),
    ("TPOT p99 s", "tpot_p99_s", ".4f"),
    ("ITL p50 s", "itl_p50_s", ".4f"),
    ("ITL p90 s", "itl_p90_s", ".4f"),
    ("ITL p99 s", "itl_p99_s", ".4f"),
    ("max ITL p90 s", "itl_max_p90_s", ".3f"),
    ("e2e p50 s", "e2e_p50_s", ".2f"),
    ("e2e p90 s", "e2e_p90_s", ".2f"),
    ("SLA attainment", "sla_attainment", ".2f"),
    ("goodput req/s", "goodput_rps", ".3f"),
    ("cost USD/h", "cost_per_hour_usd", ".3f"),
    ("BCR req/USD", "bcr_req_per_usd", ".0f"),
    ("emulated chips USD/h", "emulated_cost_per_hour_usd", ".1f"),  # emulated runs only (others: row dropped)
    ("BCR emulated req/USD", "bcr_emulated", ".1f"),
    ("overrun prefill / decode", "_overrun", "s"),
    ("RLD token share", "rld_token_share", ".3f"),
    ("WAN MB", "wan_mb", ".1f"),
    ("prefix hit P / MD", "_hits", "s"),
    ("pipelines", "_pipelines", "s"),
    ("handoffs", "_handoffs", "s"),
)


EMULATED_KEYS = ("emulated_cost_per_hour_usd", "bcr_emulated", "_overrun")  # rows only emulated runs fill


def _fmt(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, fmt) if fmt != "s" else str(v)


def _derived(s: Mapping[str, Any], key: str) -> Any:
    if key == "_requests":
        return f"{s['requests']} ({s['errors']})"
    if key == "_hits":
        return f"{_fmt(s.get('prefix_hit_p_mean'), '.2f')} / {_fmt(s.get('prefix_hit_md_mean'), '.2f')}"
    if key == "_pipelines":
        return " ".join(f"{k}:{v}" for k, v in s.get("pipelines", {}).items()) or "-"
    if key == "_overrun":
        if s.get("overrun_share_prefill") is None:
            return None
        return f"{s['overrun_share_prefill']:.1%} / {s.get('overrun_share_decode', 0.0):.1%}"
    if key == "_handoffs":
        return " ".join(f"{k}:{v}" for k, v in s.get("handoffs", {}).items()) or "-"
    return s.get(key)


def comparison_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """Rows = metrics, one column per graph."""
    names = list(summaries)
    rows = [[label] + [_fmt(_derived(summaries[g], key), fmt) for g in names] for label, key, fmt in TABLE_ROWS]
    emulated_only = {label for label, key, _ in TABLE_ROWS if key in EMULATED_KEYS}
    rows = [r for r in rows if r[0] not in emulated_only or any(c != "-" for c in r[1:])]
    header = ["metric", *names]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    names = list(summaries)
    out = ["| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, key, fmt in TABLE_ROWS:
        out.append(f"| {label} | " + " | ".join(_fmt(_derived(summaries[g], key), fmt) for g in names) + " |")
    return "\n".join(out)


def simple_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A plain text table of dict rows: columns are (header, key, format)."""
    cells = [[h for h, _, _ in columns]] + [[_fmt(r.get(k), f) for _, k, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def record_rows(records: Sequence[RequestRecord], **extra: Any) -> list[dict[str, Any]]:
    """One row per request (all RequestRecord fields, `pdd_*` from the response's pdd object)."""
    return [{**extra, **r.as_row()} for r in records]


def write_parquet(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    cols: dict[str, list[Any]] = {k: [row.get(k) for row in rows] for k in keys}
    for k, vals in cols.items():
        # JSON gives 0 for some rows and 0.25 for others: one column, one type
        if any(isinstance(v, float) for v in vals) and all(v is None or isinstance(v, (int, float)) for v in vals):
            cols[k] = [None if v is None else float(v) for v in vals]
        elif any(isinstance(v, (dict, tuple)) for v in vals) or (k != "token_ids" and any(isinstance(v, list) for v in vals)):
            cols[k] = [None if v is None else str(v) for v in vals]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path)
    return path


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ttft_cdf_plot(by_graph: Mapping[str, Sequence[RequestRecord]], path: Path, title: str = "") -> Path:
    """CDFs of TTFT (solid) and time to the second token (dashed) per graph."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, recs) in enumerate(by_graph.items()):
        color = f"C{i}"
        for attr, style, label in (("ttft_s", "-", "TTFT"), ("tt2t_s", "--", "2nd token")):
            vals = sorted(getattr(r, attr) for r in recs if getattr(r, attr) is not None)
            if vals:
                ys = [(j + 1) / len(vals) for j in range(len(vals))]
                ax.step(vals, ys, where="post", linestyle=style, color=color, label=f"{name} {label}")
    ax.set_xscale("log")
    ax.set_xlabel("seconds (log)")
    ax.set_ylabel("fraction of requests")
    ax.axhline(0.9, color="grey", linewidth=0.5, linestyle=":")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title or "TTFT CDF", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sweep_plot(points: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    """Benefit of PDD over cross-DC PD against the prefix-hit rate (docs/pdd.md's bathtub)."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [p["hit_rate"] for p in points]
    for key, label in (("tt2t_p90_speedup", "P90 2nd-token speedup"), ("ttft_p90_speedup", "P90 TTFT speedup"),
                       ("e2e_p90_speedup", "P90 e2e speedup"), ("goodput_ratio", "goodput ratio")):
        ys = [p.get(key) for p in points]
        if any(y is not None for y in ys):
            ax1.plot(xs, [math.nan if y is None else y for y in ys], marker="o", label=label)
    ax1.axhline(1.0, color="grey", linewidth=0.6)
    ax1.set_xlabel("prefix-hit rate")
    ax1.set_ylabel("PDD vs pd_cross_dc (x)")
    ax1.set_yscale("log")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=7)
    for key, label in (("pdd_tt2t_p90_s", "pdd"), ("cross_tt2t_p90_s", "pd_cross_dc")):
        ax2.plot(xs, [p.get(key) for p in points], marker="o", label=f"{label} P90 2nd token")
    ax2.plot(xs, [p.get("rld_token_share") for p in points], marker="x", linestyle=":", label="pdd RLD token share")
    ax2.set_xlabel("prefix-hit rate")
    ax2.set_ylabel("seconds / share")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle(title or "PDD benefit vs prefix-hit rate", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
