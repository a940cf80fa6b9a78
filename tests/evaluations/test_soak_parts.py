"""The soak's parts (evaluations/soak_parts.py), without a cluster: its client (`stream_request`) against a
tiny local SSE server (slow reads, disconnects, 503s at the door, in-band overload), the open-loop
arrivals, the capacity rate, the attribution of fallbacks to their causes, and the RSS figures."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from evaluations import soak_parts

CHUNKS = 5  # token chunks the fake server streams before its final chunk


class _Handler(BaseHTTPRequestHandler):
    """/v1/completions as the Router streams it; the prompt's first token picks the behaviour:
    1 a 503 at the door, 2 an in-band overloaded_error, 3 a 2 s wait before the answer begins,
    4 a stream cut without a finish reason; anything else a normal stream."""

    protocol_version = "HTTP/1.1"
    served: list[dict] = []  # what each call ended as, server side (client_gone: it left mid-stream)

    def log_message(self, *args) -> None:  # noqa: ANN002 - quiet
        pass

    def _sse(self, obj: object) -> None:
        data = f"data: {json.dumps(obj)}\n\n".encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        mode = body["prompt"][0]
        if mode == 1:
            self.send_response(503)
            self.send_header("retry-after", "2")
            self.send_header("content-length", "0")
            self.end_headers()
            return
        if mode == 3:
            time.sleep(2.0)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        record = {"client_gone": False}
        self.served.append(record)
        try:
            for i in range(CHUNKS):
                if mode == 2 and i == 2:
                    self._sse({"error": {"type": "overloaded_error", "message": "full"}})
                    break
                self._sse({"choices": [{"token_ids": [10 + i], "finish_reason": None}]})
                time.sleep(0.05)
            else:
                if mode != 4:
                    self._sse({"choices": [{"token_ids": [], "finish_reason": "length"}],
                               "pdd": {"pipeline": "P-MD", "fallbacks": []}})
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            record["client_gone"] = True


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_stream_read_to_the_end(url: str) -> None:
    s = soak_parts.stream_request(url, [0, 5], 8, None, None)
    assert s.ids == [10, 11, 12, 13, 14] and s.finish == "length" and not s.error
    assert s.shed is None and s.disconnected is None and s.info["pipeline"] == "P-MD"
    assert s.chunks == CHUNKS + 1


def test_a_slow_reader_reads_every_chunk_a_delay_apart(url: str) -> None:
    t = time.monotonic()
    s = soak_parts.stream_request(url, [0], 8, None, None, read_delay_s=0.2)
    assert s.ids == [10, 11, 12, 13, 14] and s.finish == "length"
    assert time.monotonic() - t >= 0.2 * CHUNKS


def test_a_client_that_leaves_mid_stream(url: str) -> None:
    _Handler.served.clear()
    s = soak_parts.stream_request(url, [0], 8, None, None, disconnect_after=2, read_delay_s=0.0)
    assert s.disconnected == "mid_stream" and s.ids == [10, 11] and not s.error
    deadline = time.monotonic() + 5
    while not _Handler.served[-1]["client_gone"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the server notices at its next write
    assert _Handler.served[-1]["client_gone"]


def test_a_client_that_leaves_before_the_answer_begins(url: str) -> None:
    s = soak_parts.stream_request(url, [3], 8, None, None, header_timeout_s=0.3)
    assert s.disconnected == "before_headers" and not s.error and s.ids == []
    s = soak_parts.stream_request(url, [0], 8, None, None, header_timeout_s=5.0)
    assert s.disconnected == "at_headers" and not s.error


def test_503_at_the_door_and_in_band_overload_are_shed_not_errors(url: str) -> None:
    s = soak_parts.stream_request(url, [1], 8, None, None)
    assert s.shed == "door" and s.retry_after == 2.0 and not s.error
    s = soak_parts.stream_request(url, [2], 8, None, None)
    assert s.shed == "in_band" and s.retry_after == 1.0 and not s.error and s.ids == [10, 11]


def test_a_cut_stream_has_no_finish_reason(url: str) -> None:
    s = soak_parts.stream_request(url, [4], 8, None, None)
    assert s.finish is None and s.ids == [10, 11, 12, 13, 14]


def test_completed_means_read_to_the_end() -> None:
    def rec(**kw) -> soak_parts.Rec:  # noqa: ANN003
        return soak_parts.Rec("faults", "normal", [1], 4, None, None, soak_parts.StreamResult(**kw), "", 0, Counter(), 0.0, 1.0)

    assert rec(finish="length").completed
    assert not rec(disconnected="mid_stream").completed
    assert not rec(shed="door").completed


def test_arrival_times_offer_at_least_the_rate() -> None:
    a = soak_parts.arrival_times(5.73, 60.0, random.Random(1))
    assert len(a) == 344 and a == sorted(a) and all(0 <= t <= 59.5 for t in a)  # ceil(5.73 x 60)
    assert len(a) / 60.0 >= 5.73
    assert a == soak_parts.arrival_times(5.73, 60.0, random.Random(1))
    gaps = [b - x for x, b in zip(a, a[1:])]
    assert max(gaps) > 3 * (sum(gaps) / len(gaps))  # bursts and lulls, not a metronome
    assert soak_parts.arrival_times(0.0, 60.0, random.Random(1)) == []


def test_completed_rate_counts_the_window_only() -> None:
    assert soak_parts.completed_rate([1.0, 5.0, 6.0, 9.0, 11.0], 5.0, 10.0) == pytest.approx(3 / 5)
    assert soak_parts.completed_rate([1.0], 5.0, 5.0) == 0.0


def test_fallbacks_go_to_the_fault_that_causes_them_or_their_phase() -> None:
    faults = [(100.0, "kill_md"), (120.0, "stall")]
    reqs = [
        ("faults", 95.0, 110.0, ["md_lost"]),  # the kill happened while it ran
        ("faults", 121.0, 130.0, ["kv_timeout", "relay_finish"]),  # the stall was armed just before it began
        ("faults", 115.0, 140.0, ["kv_timeout", "md_unavailable"]),  # the later fault that can cause each
        ("faults", 121.0, 130.0, ["prefill_full"]),  # near faults that do not cause it: its phase
        ("faults", 10.0, 20.0, ["md_full"]),  # no fault near
        ("overload", 400.0, 410.0, ["relay_full", "md_full"]),
        ("fill", 500.0, 510.0, ["md_full"]),
        ("faults", 101.0, 105.0, []),  # no fallback: nothing to explain
    ]
    got = soak_parts.fallback_causes(reqs, faults, window_s=20.0)
    assert got == {"fault:kill_md": {"md_lost": 1, "md_unavailable": 1},
                   "fault:stall": {"kv_timeout": 2, "relay_finish": 1},
                   "no_fault:faults": {"prefill_full": 1, "md_full": 1}, "overload": {"relay_full": 1, "md_full": 1},
                   "pool_fill": {"md_full": 1}}
    assert sum(sum(c.values()) for c in got.values()) == 10  # every fallback explained once


def test_rss_figures() -> None:
    text = ("Name:\tray::ServeReplica\nVmPeak:\t 900000 kB\nVmRSS:\t  524288 kB\nRssAnon:\t 262144 kB\n"
            "RssShmem:\t  131072 kB\nThreads:\t40\n")
    assert soak_parts.parse_rss_mb(text) == (512.0, 128.0)
    assert soak_parts.parse_rss_mb("Name:\tx\nVmRSS:\t 2048 kB\n") == (2.0, 0.0)
    assert soak_parts.parse_rss_mb("Name:\tkthreadd\n") is None
    assert soak_parts.rss_growth_mb({"a": [500.0, 620.5, 560.0], "b": [700.0, 650.0], "c": []}) == {"a": 120.5, "b": 0.0}
    ends = {"faults": 25.0, "capacity": 12.0, "overload": 40.0}
    assert soak_parts.growth_by_phase([10.0, 20.0, 30.0, 41.0], [500.0, 520.0, 610.0, 900.0], ends) == {
        "capacity": 0.0, "faults": 20.0, "overload": 110.0}


def test_workload_mix_and_plans() -> None:
    w = soak_parts.Workload(3)
    reqs = [w.next() for _ in range(400)]
    assert all(200 <= len(p) <= 2080 and 32 <= n < 160 for p, n, _ in reqs)
    forced = Counter((pdd or {}).get("pipeline") for _, _, pdd in reqs)
    assert 40 < forced["P-RLD-MD"] < 120 and 15 < forced["P-RLD"] < 70
    again = soak_parts.Workload(3)
    assert [p for p, _, _ in reqs[:20]] == [again.next()[0] for _ in range(20)]  # one seed, one sequence
    plans = [soak_parts.disconnect_plan(random.Random(i)) for i in range(200)]
    after = [p["disconnect_after"] for p in plans if "disconnect_after" in p]
    early = [p["header_timeout_s"] for p in plans if "header_timeout_s" in p]
    assert after and early and all(1 <= k <= 6 for k in after) and all(0.2 <= t <= 1.5 for t in early)


def test_a_mismatch_says_where_and_on_which_path() -> None:
    from collections import Counter

    s = soak_parts.StreamResult(ids=[1, 2, 9, 4], finish="length",
                          info={"pipeline": "P-RLD-MD", "fallbacks": ["md_lost"], "fallback": "md_lost: x"})
    r = soak_parts.Rec("fill", "normal", [1], 5, None, [1, 2, 3, 4, 5], s, "", 0, Counter(), 0.0, 1.0)
    m = soak_parts.mismatch(r)
    assert m["first_difference"] == 2 and m["got"] == [1, 2, 9, 4] and m["want"] == [1, 2, 3, 4, 5]
    assert m["pipeline"] == "P-RLD-MD" and m["fallbacks"] == ["md_lost"] and m["last_fallback"] == "md_lost: x"
    assert (m["tokens"], m["reference_tokens"]) == (4, 5)
    short = soak_parts.Rec("fill", "normal", [1], 5, None, [1, 2, 3], soak_parts.StreamResult(ids=[1, 2]), "", 0, Counter(), 0, 1)
    assert soak_parts.mismatch(short)["first_difference"] == 2  # a prefix: the difference is where it ends


def test_the_top2_gap_is_the_reference_models_margin(model_dir) -> None:
    import torch

    from pdd_serve.engine.engine import Engine

    e = Engine.from_pretrained(model_dir)
    tokens = [5, 17, 33, 2, 90, 41, 7]
    gap = soak_parts.top2_gap(e, tokens)
    seen = {}
    forward = e.model.forward

    def capture(*a, **k):
        seen["l"] = forward(*a, **k)
        return seen["l"]

    e.model.forward = capture
    e.generate(tokens, 1)
    del e.model.forward
    top = torch.topk(seen["l"].reshape(-1, seen["l"].shape[-1])[-1].float(), 2).values
    assert gap == pytest.approx(float(top[0] - top[1]), abs=1e-4) and gap >= 0
    assert e.pool.num_free == e.pool.num_blocks - (e.cache.num_blocks if e.cache else 0)  # nothing held


def test_what_a_replica_still_holds_is_named_with_how_its_client_ended() -> None:
    from types import SimpleNamespace

    def rec(rid: str, **kw) -> soak_parts.Rec:  # noqa: ANN003
        return soak_parts.Rec("overload", "disconnect", [1], 4, None, None, soak_parts.StreamResult(id=rid, **kw), "", 0,
                        Counter(), 0.0, 1.0)

    results = [rec("cmpl-aa", disconnected="mid_stream", info={"pipeline": "P-RLD-MD", "fallbacks": ["md_lost"]}),
               rec("cmpl-bb", finish="length", ids=[1, 2])]
    every = {"Relay#x": SimpleNamespace(running=1, extra={"live": ["cmpl-aa-1f2e3d"]}),
             "MainDecode#y": SimpleNamespace(running=1, extra={"held": ["cmpl-zz-000000"]}),
             "Prefill#z": SimpleNamespace(running=2, extra={}),
             "MainDecode#w": SimpleNamespace(running=0, extra={"held": []})}
    got = soak_parts.held_requests(every, results)
    assert got[0] == {"replica": "Relay#x", "request": "cmpl-aa-1f2e3d", "phase": "overload", "role": "disconnect",
                      "pipeline": "P-RLD-MD", "fallbacks": ["md_lost"], "ended": "client disconnected mid_stream"}
    assert got[1]["replica"] == "MainDecode#y" and got[1]["ended"].startswith("no client record")
    assert got[2] == {"replica": "Prefill#z", "request": None, "running": 2, "ended": "unknown"}
    assert len(got) == 3
