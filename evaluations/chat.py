"""Closed-loop multi-turn chat against a graph that is already serving: how many requests it shed,
and the TTFT of the ones it answered.

    pdd cluster up && eval "$(pdd cluster env)" && serve run --non-blocking graphs/pdd.yaml
    python -m evaluations.chat --clients 4          # 10 conversations x 4 turns

`--clients` clients each run one conversation (`workloads.ChatWorkload`: a shared system prompt,
the conversation's own context, then questions, each answer appended) after another, streamed,
greedy, `ignore_eos`. A turn refused with a 503 ends its conversation (the next turn would need
its answer): `skipped` counts those. Prints one JSON line; each distinct error once, with its count
(a 503's body names the pool or queue that refused).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from collections import Counter

from evaluations.loadgen import SLA, LoadConfig, run_workload, summarize_run
from evaluations.workloads import ChatWorkload, chat_workload


def main(argv: list[str] | None = None) -> int:
    d = ChatWorkload()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the graph's API (default: %(default)s)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent closed-loop clients (default: %(default)s)")
    for k in ("conversations", "turns", "system_tokens", "context_tokens", "turn_tokens", "max_tokens", "seed"):
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=getattr(d, k), help="(default: %(default)s)")
    ap.add_argument("--sla-ttft", type=float, default=SLA().ttft_s, help="TTFT target, seconds (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        w = ChatWorkload(args.conversations, args.turns, args.system_tokens, args.context_tokens, args.turn_tokens,
                         args.max_tokens, args.seed)
        cfg = LoadConfig(clients=args.clients)
    except ValueError as e:
        ap.error(str(e))
    records = asyncio.run(run_workload(args.url, chat_workload(w).sessions, cfg))
    s = summarize_run(records, SLA(ttft_s=args.sla_ttft))
    skipped = sum(1 for r in records if r.error.startswith("skipped"))
    errors = Counter(r.error for r in records if r.error and not r.error.startswith("skipped"))
    answered = [r.ttft_s for r in records if not r.error and r.ttft_s is not None]
    out = {"command": "python -m evaluations.chat " + shlex.join(sys.argv[1:] if argv is None else argv),
           "clients": args.clients, "requests": len(records), "answered": len(answered),
           "shed_503": sum(1 for r in records if r.status == 503), "skipped": skipped,
           **{k: s[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "sla_attainment",
                                "prefix_hit_p_mean")},
           "ttft_max_s": max(answered, default=None), "errors": dict(errors)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
