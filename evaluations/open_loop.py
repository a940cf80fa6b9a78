"""Open-loop probes for the capacity search (issue 40): every request's send time is fixed before
a probe starts, so an overloaded graph can't slow its own arrivals.

A multi-turn session normally sends turn k+1 after the answer to turn k. Here each turn is sent
at a time set in advance and its prompt already carries the *reference* answer of the turn
before: one engine's greedy generate of the same prompts, which every graph must reproduce token
for token (the master invariant), so the prompts are exactly those a closed-loop client would
have sent. This is how a trace replay works.

Times: a probe at `rate` offers `rate` requests per (emulated) second. Sessions arrive as in the
agentic workload, stretched so that sessions x turns arrive at `rate`, and turn k of a session is
sent k x `turn_gap_s` after its first: the time an answer that meets the SLA takes at most, plus
the think time (fixed from the SLA, never from a run).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from evaluations.loadgen import SLA, RequestRecord
from evaluations.workloads import AgenticWorkload, Session, Turn, Workload, agentic_workload

Answers = dict[tuple[str, int], list[int]]  # (session id, turn) -> reference token ids


@dataclass(frozen=True)
class ProbeLoad:
    """The requests of one probe before its times are set: a session's prompts, in turn order."""

    workload: Workload  # the agentic workload it came from (closed loop, session_rate 1)
    prompts: dict[tuple[str, int], list[int]]  # (session id, turn) -> the whole prompt
    answers: Answers

    @property
    def requests(self) -> int:
        return len(self.prompts)


def sessions_for(requests: int, w: AgenticWorkload) -> int:
    """Sessions of `w`'s shape that give at least `requests` requests (anomalous ones included)."""
    n = max(1, -(-requests // w.turns))
    while replace(w, sessions=n).anomalous + n * w.turns < requests:
        n += 1
    return n


def probe_load(w: AgenticWorkload, generate: Callable[[list[list[int]], list[int]], list[list[int]]]) -> ProbeLoad:
    """The prompts of `w`'s sessions with the reference answers fed back, turn by turn.
    `generate(prompts, max_tokens)` is one engine's greedy generate (ignore_eos)."""
    wl = agentic_workload(replace(w, session_rate=1.0))
    contexts: dict[str, list[int]] = {s.session_id: [] for s in wl.sessions}
    prompts: dict[tuple[str, int], list[int]] = {}
    answers: Answers = {}
    for k in range(max(len(s.turns) for s in wl.sessions)):
        live = [s for s in wl.sessions if k < len(s.turns)]
        batch = []
        for s in live:
            t = s.turns[k]
            ctx = contexts[s.session_id] if t.reset_to is None else contexts[s.session_id][: t.reset_to]
            ctx = ctx + list(t.tokens)
            prompts[(s.session_id, k)] = ctx
            batch.append(ctx)
        outs = generate(batch, [s.turns[k].max_tokens for s in live])
        for s, out in zip(live, outs):
            if len(out) != s.turns[k].max_tokens:
                raise RuntimeError(f"reference for {s.session_id} turn {k}: {len(out)} tokens, "
                                   f"asked {s.turns[k].max_tokens} (ignore_eos)")
            answers[(s.session_id, k)] = list(out)
            contexts[s.session_id] = prompts[(s.session_id, k)] + list(out)
    return ProbeLoad(wl, prompts, answers)


def turn_gap_s(sla: SLA, max_tokens: int, think_s: float) -> float:
    """The fixed gap between a session's turns: its answer's SLA budget, then the think time."""
    return sla.ttft_s + (max_tokens - 1) * sla.tpot_s + think_s


def at_rate(load: ProbeLoad, rate: float, gap_s: float) -> Workload:
    """`load`'s requests as single-request sessions with fixed send times, offered at `rate` req/s.
    Session ids are '<session>#<turn>'; `answer_of` maps a record back to its reference."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    wl = load.workload
    turns = load.requests / len(wl.sessions)  # mean requests per session
    stretch = turns / rate  # session_rate 1 -> rate / turns
    out = []
    for s in wl.sessions:
        for k, t in enumerate(s.turns):
            prompt = tuple(load.prompts[(s.session_id, k)])
            turn = Turn(prompt, t.max_tokens, t.kind, None, 0.0, t.planned_hit)
            out.append(Session(f"{s.session_id}#{k}", (turn,), start_s=s.start_s * stretch + k * gap_s))
    params = (*wl.params, ("open_loop", True), ("rate_rps", rate), ("turn_gap_s", gap_s))
    return Workload(f"{wl.name}@{rate:.4g}", tuple(sorted(out, key=lambda x: x.start_s)), wl.warmup, params)


def answer_of(rec: RequestRecord, answers: Mapping[tuple[str, int], list[int]]) -> list[int] | None:
    sid, _, k = rec.session_id.rpartition("#")
    return answers.get((sid, int(k))) if sid else None


def mismatches(records: list[RequestRecord], answers: Mapping[tuple[str, int], list[int]]) -> list[str]:
    """Answered requests whose tokens differ from the reference (a 503 answered nothing: not one)."""
    bad = []
    for r in records:
        if r.status == 503 or (r.error and not r.token_ids):
            continue
        ref = answer_of(r, answers)
        if ref is None or r.token_ids != ref:
            at = next((i for i, (a, b) in enumerate(zip(r.token_ids, ref or [])) if a != b), None)
            bad.append(f"{r.session_id}: {len(r.token_ids)} tokens, reference {None if ref is None else len(ref)}, "
                       f"first difference at {at}")
    return bad


def reference_generator(model_path: str, dtype: str | None = None, block_size: int = 16,
                        batch: int = 32) -> Callable[[list[list[int]], list[int]], list[list[int]]]:
    """One local engine's greedy generate (the reference every graph must match)."""
    from pdd_serve.engine import Engine, SamplingParams

    eng = Engine.from_pretrained(model_path, dtype=dtype, block_size=block_size)

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        out: list[list[int]] = []
        for i in range(0, len(prompts), batch):
            params = [SamplingParams(n, ignore_eos=True) for n in max_tokens[i:i + batch]]
            out.extend(eng.generate_batch(prompts[i:i + batch], params))
        return out

    return generate


__all__ = ["Answers", "ProbeLoad", "answer_of", "at_rate", "mismatches", "probe_load", "reference_generator",
           "sessions_for", "turn_gap_s"]
