"""Asynchronous OpenAI-API load generator: streams every request, measures TTFT/TPOT on the client.

Sessions run concurrently (open loop on their start times); a session's turns run in order, each
turn's context being the previous context plus the answer plus the next turn's text.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from evaluations.workloads import Session


@dataclass
class RequestRecord:
    session_id: str
    turn: int
    kind: str
    prompt_chars: int
    status: int = 0
    error: str = ""
    text: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    pdd: dict[str, Any] = field(default_factory=dict)

    def as_row(self) -> dict[str, Any]:
        row = asdict(self)
        row.pop("pdd")
        row.update({f"pdd_{k}": v for k, v in self.pdd.items()})
        return row


async def stream_completion(client: Any, base_url: str, model: str, prompt: str, max_tokens: int,
                            rec: RequestRecord, timeout_s: float = 300.0, api_key: str | None = None) -> None:
    """One streaming /v1/completions call (greedy), filling `rec`."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.monotonic()
    t_last = None
    parts: list[str] = []
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers,
                                 timeout=timeout_s) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                rec.error = (await r.aread()).decode(errors="replace")[:300]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    rec.error = obj["error"].get("message", "stream error")
                    continue
                if obj.get("usage"):
                    rec.output_tokens = obj["usage"]["completion_tokens"]
                    rec.prompt_tokens = obj["usage"]["prompt_tokens"]
                for ch in obj.get("choices", []):
                    if ch.get("text"):
                        now = time.monotonic()
                        if rec.ttft_s is None:
                            rec.ttft_s = now - t0
                        t_last = now
                        parts.append(ch["text"])
                    if ch.get("finish_reason"):
                        rec.finish_reason = ch["finish_reason"]
                if "pdd" in obj:
                    rec.pdd = obj["pdd"]
    except Exception as e:  # recorded, the run goes on
        rec.error = f"{type(e).__name__}: {e}"
        return
    rec.e2e_s = time.monotonic() - t0
    rec.text = "".join(parts)
    if rec.ttft_s is not None and t_last is not None and rec.output_tokens > 1:
        rec.tpot_s = (t_last - t0 - rec.ttft_s) / (rec.output_tokens - 1)


async def run_sessions(base_url: str, sessions: list[Session], model: str = "pdd-small", timeout_s: float = 300.0,
                       progress: Any = None, api_key: str | None = None) -> list[RequestRecord]:
    import httpx

    records: list[RequestRecord] = []
    t_start = time.monotonic()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:

        async def one(s: Session) -> None:
            await asyncio.sleep(max(0.0, s.start_s - (time.monotonic() - t_start)))
            context = ""
            for i, turn in enumerate(s.turns):
                context += turn.text
                rec = RequestRecord(s.session_id, i, turn.kind, len(context))
                await stream_completion(client, base_url, model, context, turn.max_tokens, rec, timeout_s, api_key)
                records.append(rec)
                if progress is not None:
                    progress.update(1)
                if rec.error:
                    return
                context += rec.text
                if s.think_s:
                    await asyncio.sleep(s.think_s)

        await asyncio.gather(*(one(s) for s in sessions))
    return records


def percentile(values: list[float], q: float) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    k = (len(vals) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None
