"""Workloads: agentic multi-turn sessions (PDD's target traffic) as text requests.

A session is a system prompt shared by every session, a task, then turns whose context grows by
the model's answer plus a tool output. Most turns therefore hit the prefix caches almost fully;
a few cold requests (new long documents) and rare anomalous ones (long input, tiny output) make
the tail PDD is built for.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache


@dataclass(frozen=True)
class Turn:
    text: str  # appended to the session's context before this request
    max_tokens: int
    kind: str = "agentic"  # agentic | cold | anomalous


@dataclass(frozen=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]
    start_s: float = 0.0  # arrival offset of the first turn
    think_s: float = 0.0  # pause between a turn's answer and the next request


@dataclass(frozen=True)
class AgenticWorkload:
    sessions: int = 4
    turns: int = 3
    system_words: int = 300  # shared by every session: hits at P and MD across sessions
    task_words: int = 120
    tool_words: int = 60  # tool output appended per turn
    max_tokens: int = 64
    cold: int = 2  # sessions of one request over a fresh long document (low hit)
    cold_words: int = 900
    anomalous: int = 1  # long input, very short output
    anomalous_words: int = 1600
    anomalous_max_tokens: int = 4
    arrival_gap_s: float = 0.5
    think_s: float = 0.3  # tool execution between turns
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for k in ("sessions", "turns", "system_words", "task_words", "tool_words", "max_tokens", "cold_words",
                  "anomalous_words", "anomalous_max_tokens"):
            if getattr(self, k) <= 0:
                raise ValueError(f"AgenticWorkload.{k} must be > 0")
        if self.cold < 0 or self.anomalous < 0 or self.arrival_gap_s < 0:
            raise ValueError("cold, anomalous and arrival_gap_s must be >= 0")


@lru_cache(maxsize=1)
def _words() -> tuple[str, ...]:
    from pdd_serve.models import corpus_text

    return tuple(corpus_text().split())


def _text(rng: random.Random, n: int) -> str:
    words = _words()
    start = rng.randrange(len(words) - n - 1)
    return " ".join(words[start : start + n])


def agentic_sessions(w: AgenticWorkload) -> list[Session]:
    rng = random.Random(w.seed)
    system = "System: you are a coding agent. " + _text(random.Random(12345), w.system_words)
    out: list[Session] = []
    for i in range(w.sessions):
        turns = [Turn(f"{system}\nTask {i}: {_text(rng, w.task_words)}\n", w.max_tokens)]
        turns += [Turn(f"\nTool output: {_text(rng, w.tool_words)}\n", w.max_tokens) for _ in range(w.turns - 1)]
        out.append(Session(f"agent-{i}", tuple(turns), start_s=i * w.arrival_gap_s, think_s=w.think_s))
    t = w.sessions * w.arrival_gap_s
    for i in range(w.cold):
        doc = f"Summarize this new document:\n{_text(rng, w.cold_words)}\n"
        out.append(Session(f"cold-{i}", (Turn(doc, w.max_tokens, "cold"),), start_s=t + (i + 0.5) * w.arrival_gap_s))
    for i in range(w.anomalous):
        doc = f"Classify this log in one word:\n{_text(rng, w.anomalous_words)}\n"
        out.append(Session(f"anomalous-{i}", (Turn(doc, w.anomalous_max_tokens, "anomalous"),),
                           start_s=t + (i + 0.75) * w.arrival_gap_s))
    return sorted(out, key=lambda s: s.start_s)
