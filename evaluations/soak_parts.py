"""The soak's parts (evaluations/soak.py runs them): its HTTP client, the records it keeps of each
request, the workload, the open-loop arrivals, the attribution of fallbacks to faults, what the
replicas still hold after the drain, and the RSS figures. Each works without a cluster
(tests/evaluations/test_soak_parts.py); soak.py is the run itself.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MAX_RETRIES = 30  # a refused request (every pool full) is sent again after its Retry-After
SLOW_READ_S = 1.0  # a slow client reads one SSE chunk a second
LATE_REPLICA_SETTLE_S = 30.0  # a replica started after warm-up (an MD replacing a killed one): RSS counts from here
CAPACITY_RAMP_S = 5.0  # the capacity phase counts completions after its clients are all busy
REFERENCE_BATCH = 16  # references computed together after a phase

# what each fallback kind means, and which faults or loads cause it (printed with fallbacks_by_cause)
FALLBACK_KINDS = {
    "md_lost": "an MD failed mid-request: a killed MD replica, a restarted Flight server",
    "kv_timeout": "the KV did not reach MD within kv_wait_timeout_s: a stalled or cut WAN, or a line "
                  "and CPUs backed up under load",
    "md_unavailable": "the MD picked did not answer: killed, or its replacement still starting",
    "md_full": "every MD's KV pool was full: load, or one MD left after a kill",
    "relay_lost": "the relay stream failed: a relay killed mid-stream",
    "relay_full": "the relay was at relay_max_running: load",
    "relay_finish": "no MD could take the request: the relay finished it",
    "prefill_retry": "a prefill call failed or passed its budget: load (a queue past the budget), a dead Prefill",
    "prefill_full": "Prefill's KV pool was full: load",
    "index_miss": "the Router's view of an MD's cache was stale: the KV it lacked was resent",
}


@dataclass
class StreamResult:
    """What one HTTP call gave a client."""

    ids: list[int] = field(default_factory=list)
    id: str = ""  # the response's id (the Router's request id starts with it)
    info: dict = field(default_factory=dict)
    finish: str | None = None
    error: str = ""
    retry_after: float | None = None  # refused as overloaded: seconds to wait before a retry
    shed: str | None = None  # "door": a 503 before the stream; "in_band": overloaded_error mid-stream
    disconnected: str | None = None  # where the client went away on purpose: before_headers | at_headers | mid_stream
    chunks: int = 0  # SSE data chunks read


_CLIENT = None
_CLIENT_LOCK = threading.Lock()


def http_client():  # noqa: ANN202 - httpx is imported lazily
    """One HTTP client for every request thread. `httpx.stream` builds a client per call, and with
    it an SSL context (~20 ms of CPU): on a box the graph keeps busy, that alone left the open-loop
    driver seconds behind its schedule. A stream closed early still closes its own connection."""
    global _CLIENT
    import httpx

    with _CLIENT_LOCK:
        if _CLIENT is None:
            _CLIENT = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))
        return _CLIENT


def stream_request(url: str, prompt: list[int], n: int, stop: str | None, pdd: dict | None, *,
            read_delay_s: float = 0.0, disconnect_after: int | None = None,
            header_timeout_s: float | None = None) -> StreamResult:
    """One streamed completion. `read_delay_s`: a slow reader sleeps this long after each chunk;
    `disconnect_after`: the client closes the stream after that many chunks; `header_timeout_s`:
    the client gives up waiting for the answer to begin after that long (the Router sends its 200
    with the first token, so this leaves during prefill or the KV's crossing), or leaves at once
    when it begins."""
    import httpx

    client = http_client()
    body = {"model": "pdd-small", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    if stop is not None:
        body["stop"] = [stop]
    if pdd:
        body["pdd"] = pdd
    out = StreamResult()
    timeout = httpx.Timeout(300.0) if header_timeout_s is None else httpx.Timeout(300.0, read=header_timeout_s)
    headers = False
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
            headers = True
            if r.status_code == 503:
                out.shed, out.retry_after = "door", float(r.headers.get("retry-after", 1))
                return out
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                return out
            if header_timeout_s is not None:  # the answer began: this client leaves now
                out.disconnected = "at_headers"
                return out
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    if obj["error"].get("type") == "overloaded_error":  # every pool full, mid-stream
                        out.shed, out.retry_after = "in_band", 1.0
                    else:
                        out.error = obj["error"]["message"]
                    return out
                ch = obj["choices"][0] if obj.get("choices") else {}
                out.id = out.id or obj.get("id", "")
                out.ids += ch.get("token_ids", [])
                out.finish = ch.get("finish_reason") or out.finish
                out.info = obj.get("pdd", out.info)
                out.chunks += 1
                if disconnect_after is not None and out.chunks >= disconnect_after and out.finish is None:
                    out.disconnected = "mid_stream"  # leaving the `with` closes the connection
                    return out
                if read_delay_s:
                    time.sleep(read_delay_s)
    except Exception as e:  # noqa: BLE001 - counted as an error
        if header_timeout_s is not None and not headers and isinstance(e, httpx.TimeoutException):
            out.disconnected = "before_headers"  # the client gave up waiting, as planned
            return out
        out.error = f"{type(e).__name__}: {e}"
        return out
    return out


def mismatch(r: Rec) -> dict:
    """Where a stream read to the end left its reference: enough to find the path that did it."""
    got, want = r.s.ids, r.want or []
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return {"phase": r.phase, "role": r.role, "pipeline": r.s.info.get("pipeline"), "handoff_mode": r.s.info.get("handoff_mode"),
            "fallbacks": r.s.info.get("fallbacks", []), "last_fallback": r.s.info.get("fallback"), "eager_tokens": r.s.info.get("eager_tokens"),
            "md_tokens": r.s.info.get("md_tokens"), "stop": r.stop, "finish": r.s.finish,
            "tokens": len(got), "reference_tokens": len(want), "first_difference": at,
            "got": got[max(0, at - 2): at + 3], "want": want[max(0, at - 2): at + 3]}


def top2_gap(engine, tokens: list[int]) -> float:  # noqa: ANN001 - an Engine
    """The reference model's margin between its two best next tokens after `tokens`: a greedy
    choice whose margin is within fp32 rounding (~1e-5 here) can flip with the batch it is
    computed in, a difference of kernels, not of tokens moved; a large one is a wrong context."""
    import torch

    from pdd_serve.engine.engine import SamplingParams

    out: dict = {}
    forward = engine.model.forward

    def capture(*a, **k):  # noqa: ANN002, ANN003, ANN202
        out["logits"] = forward(*a, **k)
        return out["logits"]

    seq = engine.add("top2-gap", list(tokens), SamplingParams(1, ignore_eos=True))
    engine.model.forward = capture
    try:
        engine.prefill(seq, use_cache=False)
    finally:
        del engine.model.forward  # the class's forward again
        engine.release(seq, cache=False)
    logits = out["logits"].reshape(-1, out["logits"].shape[-1])[-1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


@dataclass
class Rec:
    """One client request, over its retries."""

    phase: str  # warmup | capacity | faults | overload | fill
    role: str  # normal | slow | disconnect
    prompt: list[int]
    n: int
    stop: str | None
    want: list[int] | None  # the reference output; None until computed (after a phase, off the clock)
    s: StreamResult
    error: str
    refusals: int  # refused as overloaded, sent again after Retry-After
    shed: Counter  # door / in_band refusals, retried or not
    t0: float
    t1: float

    @property
    def completed(self) -> bool:
        """The client read the stream to the end."""
        return not self.error and self.s.shed is None and self.s.disconnected is None


class Workload:
    """The capacity and overload phases' requests (one generator, so the two see the same mix):
    1 in 4 a cold document, else the next turn of one of `sessions` agentic sessions; 32-160 output
    tokens; 2 in 10 forced onto P->RLD->MD, 1 in 10 onto P->RLD. Thread-safe."""

    def __init__(self, seed: int, sessions: int = 8) -> None:
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.systems = [[self.rng.randrange(3, 2000) for _ in range(200)] for _ in range(sessions)]
        self.contexts = [list(s) for s in self.systems]

    def next(self) -> tuple[list[int], int, dict | None]:
        with self.lock:
            rng = self.rng
            if rng.random() < 0.25:
                prompt = [rng.randrange(3, 2000) for _ in range(rng.randrange(600, 1300))]
            else:
                i = rng.randrange(len(self.contexts))
                self.contexts[i] += [rng.randrange(3, 2000) for _ in range(rng.randrange(20, 80))]
                if len(self.contexts[i]) > 2000:
                    self.contexts[i] = list(self.systems[i])
                prompt = list(self.contexts[i])
            return prompt, rng.randrange(32, 160), pick_pdd(rng)


def pick_pdd(rng: random.Random) -> dict | None:
    """2 in 10 requests forced onto P->RLD->MD (either handoff mode), 1 in 10 onto P->RLD, the rest
    left to the policy."""
    r = rng.random()
    return ({"pipeline": "P-RLD-MD", "handoff_mode": rng.choice(["one-shot", "catch-up"])} if r < 0.2
            else {"pipeline": "P-RLD"} if r < 0.3 else None)


def disconnect_plan(rng: random.Random) -> dict:
    """How a disconnecting client leaves: half after 1-6 chunks, half while it waits for the answer
    to begin (0.2-1.5 s: during prefill or the KV's crossing) or the moment it begins."""
    if rng.random() < 0.5:
        return {"disconnect_after": rng.randrange(1, 7)}
    return {"header_timeout_s": rng.uniform(0.2, 1.5)}


def arrival_times(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Open-loop arrivals at `rate` per second over `duration_s` (offsets from the phase's start):
    a Poisson process given its count, ceil(rate x duration) arrivals uniform over the span (so the
    phase offers at least `rate`, where a free Poisson count falls short half the time). The
    last half second is left out: a request scheduled there still leaves within the phase."""
    if rate <= 0 or duration_s <= 0.5:
        return []
    span = duration_s - 0.5
    return sorted(rng.uniform(0.0, span) for _ in range(math.ceil(rate * duration_s)))


def completed_rate(ends: list[float], start: float, stop: float) -> float:
    """Completions per second of a closed loop: those that ended in [start, stop]."""
    if stop <= start:
        return 0.0
    return sum(1 for t in ends if start <= t <= stop) / (stop - start)


# the fallbacks each injected fault can cause (orchestrator.py's fault paths); any other fallback
# near a fault is not put on it
FAULT_EFFECTS = {
    "kill_md": {"md_lost", "kv_timeout", "md_unavailable", "md_full", "relay_finish", "index_miss"},
    "stall": {"kv_timeout", "md_lost", "relay_finish"},
    "cut": {"kv_timeout", "md_lost", "relay_finish"},
    "restart_flight": {"md_lost", "kv_timeout", "md_unavailable", "relay_finish"},
    "kill_relay": {"relay_lost", "relay_finish"},
}


def fallback_causes(requests: list[tuple[str, float, float, list[str]]], faults: list[tuple[float, str]],
                    window_s: float) -> dict[str, dict[str, int]]:
    """{cause: {fallback kind: count}}. requests: (phase, start, end, fallback kinds); faults:
    (time injected, kind). Each fallback goes to the latest fault that can cause it (FAULT_EFFECTS)
    injected while its request ran or up to `window_s` before it began (stall, cut and kill_relay
    wait for the next transfer or stream; a killed MD's replacement takes a while); with none, to
    its request's phase: `overload`, `pool_fill`, or `no_fault:<phase>` (load, or a cause this
    soak did not inject)."""
    by_phase = {"overload": "overload", "fill": "pool_fill"}
    out: dict[str, Counter] = {}
    for phase, t0, t1, kinds in requests:
        near = sorted((tf, kind) for tf, kind in faults if t0 - window_s <= tf <= t1)
        for fb in kinds:
            causes = [kind for _, kind in near if fb in FAULT_EFFECTS.get(kind, ())]
            cause = f"fault:{causes[-1]}" if causes else by_phase.get(phase, f"no_fault:{phase}")
            out.setdefault(cause, Counter())[fb] += 1
    return {cause: dict(c) for cause, c in sorted(out.items())}


def held_requests(every: dict, results: list[Rec]) -> list[dict]:
    """What a replica still holds after the drain (a leak, or the relay pool's drift): the replica,
    the request, and how its client's request ended (found by the response id the Router's request
    id starts with; a client that left before its first chunk never saw one)."""
    by_id = {r.s.id: r for r in results if r.s.id}
    out = []
    for name, st in every.items():
        extra = getattr(st, "extra", None) or {}
        ids = list(extra.get("live", ())) + list(extra.get("held", ()))
        for rid in ids:
            rec = by_id.get(rid.rsplit("-", 1)[0])
            ended = ("no client record (the client left before its first chunk)" if rec is None else
                     rec.error or (f"shed ({rec.s.shed})" if rec.s.shed else None)
                     or (f"client disconnected {rec.s.disconnected}" if rec.s.disconnected else None)
                     or f"finished ({rec.s.finish}) after {len(rec.s.ids)} tokens")
            out.append({"replica": name, "request": rid, "phase": rec.phase if rec else None,
                        "role": rec.role if rec else None, "pipeline": (rec.s.info.get("pipeline") if rec else None),
                        "fallbacks": (rec.s.info.get("fallbacks") if rec else None), "ended": ended})
        if not ids and st.running:  # a holder that reports no ids (Prefill's running prefills)
            out.append({"replica": name, "request": None, "running": st.running, "ended": "unknown"})
    return out


def parse_rss_mb(status_text: str) -> tuple[float, float] | None:
    """(RSS, the shared-memory part of it) of a /proc/<pid>/status text, in MiB; None without a
    VmRSS line (a zombie, a kernel thread). The shared part is mostly Ray's object store: its
    pages count in the RSS of every process that wrote or read them, and the store is bounded
    (object_store_mib per raylet), so a replica's own growth is RSS less it."""
    fields = {}
    for line in status_text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssShmem"):
            fields[key] = int(rest.split()[0]) / 1024
    if "VmRSS" not in fields:
        return None
    return fields["VmRSS"], fields.get("RssShmem", 0.0)


def growth_by_phase(times: list[float], samples: list[float], phase_ends: dict[str, float]) -> dict[str, float]:
    """How far a series had grown over its first sample by the end of each phase (MiB): where a
    replica's memory went up."""
    out = {}
    for phase, end in sorted(phase_ends.items(), key=lambda kv: kv[1]):
        seen = [v for t, v in zip(times, samples) if t <= end]
        if seen:
            out[phase] = round(max(seen) - samples[0], 1)
    return out


def rss_growth_mb(samples: dict[str, list[float]]) -> dict[str, float]:
    """Each replica's peak over its first sample (its baseline), in MiB."""
    return {name: round(max(s) - s[0], 1) for name, s in samples.items() if s}


def prefill_orphans(every: dict[str, object]) -> dict[str, tuple[int, int]]:
    """{Prefill replica: (prefills running, KV transfers still open)} of every replica's `stats`:
    once the load is gone, work for nobody."""
    out = {}
    for name, s in every.items():
        if name.startswith("Prefill#"):
            x = s.extra
            sending = x.get("started", 0) - sum(x.get(k, 0) for k in ("done", "failed", "dropped", "aborted"))
            out[name] = (s.running, max(0, sending))
    return out


class RssSampler:
    """Every live replica's RSS of one Serve app, every 2 s on a thread, in MiB: `rss` less its
    shared-memory pages (the object store's, kept apart in `shm`), `at` when each was taken. A
    replica started after the first listing (an MD replacing a killed one) counts only once it
    has run LATE_REPLICA_SETTLE_S, so its start-up is not growth."""

    def __init__(self, app: str, log: Callable[[str], None]) -> None:
        self.prefix = f"SERVE_REPLICA::{app}#"
        self.log = log
        self.rss: dict[str, list[float]] = {}  # replica actor name -> samples, the first the baseline
        self.shm: dict[str, list[float]] = {}
        self.at: dict[str, list[float]] = {}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def replica_pids(self) -> dict[str, int]:
        """{actor name: pid} of the app's live replica actors (the GCS actor table: no dashboard)."""
        from ray._private import state as ray_state

        return {a["Name"]: a["Pid"] for a in ray_state.actors(actor_state_name="ALIVE").values()
                if a.get("Name", "").startswith(self.prefix) and a.get("Pid")}

    def run(self) -> None:
        pids: dict[str, int] = {}
        first_seen: dict[str, float] = {}
        initial: set[str] | None = None
        listed = 0.0
        while True:
            now = time.monotonic()
            if now - listed >= 5.0:
                try:
                    pids, listed = self.replica_pids(), now
                except Exception as e:  # noqa: BLE001 - the GCS busy: keep the last listing
                    self.log(f"could not list replica pids: {e}")
                if initial is None:
                    initial = set(pids)
            for name, pid in pids.items():
                try:
                    mb = parse_rss_mb(Path(f"/proc/{pid}/status").read_text())
                except OSError:  # the replica died (a kill): its samples so far stand
                    continue
                first_seen.setdefault(name, now)
                if mb is not None and (name in (initial or ()) or now - first_seen[name] >= LATE_REPLICA_SETTLE_S):
                    self.rss.setdefault(name, []).append(mb[0] - mb[1])
                    self.shm.setdefault(name, []).append(mb[1])
                    self.at.setdefault(name, []).append(now)
            if self.stopped.wait(2.0):
                return

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=30)

    def short(self, actor_name: str) -> str:
        """`Deployment#replic` of a replica's actor name, for the report."""
        dep, rid = actor_name[len(self.prefix):].split("#", 1)
        return f"{dep}#{rid[:6]}"
