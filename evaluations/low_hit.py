"""P->RLD->MD TTFT against the same low-hit requests on pd_cross_dc, from a `pdd compare` run.

    python -m evaluations.low_hit .pdd/eval/pdd-compare-TIME/requests.parquet

Picks the requests PDD's policy sent through the relay (its low-hit ones) and sets each beside the
same request (same session, turn and repeat) on pd_cross_dc (strong: decode-side cache),
pd_cross_dc_naive (when the run has it) and pd_same_dc. Prints a table and one JSON line with the
medians and their ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("requests", help="requests.parquet written by `pdd compare`")
    args = ap.parse_args(argv)
    import pandas as pd

    try:
        df = pd.read_parquet(args.requests)
    except (OSError, ValueError) as e:
        print(f"{args.requests}: {e}", file=sys.stderr)
        return 2
    key = ["repeat", "session_id", "turn"]
    pdd = df[(df.graph == "pdd") & (df.pdd_pipeline == "P-RLD-MD") & (df.status == 200)]
    if pdd.empty:
        print("no P-RLD-MD requests in this run", file=sys.stderr)
        return 1
    rows = pdd[key + ["kind", "prompt_tokens", "pdd_prefix_hit_md", "ttft_s", "pdd_eager_tokens", "pdd_kv_ready_s"]]
    naive = "pd_cross_dc_naive" in set(df.graph)
    for g in ("pd_cross_dc", "pd_same_dc", *(("pd_cross_dc_naive",) if naive else ())):
        other = df[df.graph == g][key + ["ttft_s"]].rename(columns={"ttft_s": f"ttft_{g}"})
        rows = rows.merge(other, on=key, how="inner")
    print(f"{'session':<14}{'turn':>5}{'kind':>10}{'prompt':>8}{'MD hit':>8}{'pdd TTFT':>10}{'cross-DC':>10}"
          f"{'same-DC':>9}{'eager':>7}{'KV at MD':>10}")
    for r in rows.itertuples():
        print(f"{r.session_id:<14}{r.turn:>5}{r.kind:>10}{r.prompt_tokens:>8}{r.pdd_prefix_hit_md:>8.2f}"
              f"{r.ttft_s:>10.3f}{r.ttft_pd_cross_dc:>10.3f}{r.ttft_pd_same_dc:>9.3f}{r.pdd_eager_tokens:>7}"
              f"{r.pdd_kv_ready_s:>10.2f}")
    cols = ("ttft_s", "ttft_pd_cross_dc", "ttft_pd_same_dc", *(("ttft_pd_cross_dc_naive",) if naive else ()))
    med = {c: statistics.median(rows[c]) for c in cols}
    out = {"requests": len(rows), "pdd_p_rld_md_ttft_p50_s": round(med["ttft_s"], 4),
           "pd_cross_dc_ttft_p50_s": round(med["ttft_pd_cross_dc"], 4),
           "pd_same_dc_ttft_p50_s": round(med["ttft_pd_same_dc"], 4),
           "low_hit_ttft_vs_cross_dc": round(med["ttft_s"] / med["ttft_pd_cross_dc"], 4)}
    if naive:
        out["pd_cross_dc_naive_ttft_p50_s"] = round(med["ttft_pd_cross_dc_naive"], 4)
        out["low_hit_ttft_vs_cross_dc_naive"] = round(med["ttft_s"] / med["ttft_pd_cross_dc_naive"], 4)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
