"""Issue 38: Prefill's admission estimate, and the 503s it answers with.

A fresh graph shed a quarter of a 4-client chat workload. Prefill admitted a prompt if the prompt
tokens queued ahead, divided by a tokens/s rate over its last prefills, ended within 0.75 of the
Router's 30 s budget; after a 4-token warm-up request (35 ms of engine time, nearly all of it
per-call cost) that rate was 115 tokens/s, so three cold 1.2K-token prompts looked like 32 s of
work. They took about 1.5 s. The cost is now a fixed part plus a per-token part, fitted over a
calibration of two sizes (taken before the first prefill) and the replica's recent prefills;
every 503 names what refused it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdd_serve.engine.sampling import SamplingParams
from pdd_serve.policy import PREFILL_ADMIT_SHARE, PrefillCost, fit_prefill_cost, prefill_admits
from pdd_serve.serve.messages import (
    GenRequest,
    PrefillBusy,
    PrefillPoolFull,
    PrefillRequest,
    PrefillSendFull,
    RelaySaturated,
)
from pdd_serve.serve.request_state import Overloaded, RequestState, is_overloaded, refusal
from tests.helpers import until
from tests.serve.replicas import long_request, serve_once

pytestmark = pytest.mark.usefixtures("no_cluster")  # Prefill replicas are built here, without Ray
ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- the policy


CALIBRATION = [(16, 0.006), (256, 0.066)]  # 6 ms at 16 tokens, 66 ms at 256: 2 ms + 0.25 ms/token


def test_the_fit_splits_a_prefill_into_a_fixed_and_a_per_token_part():
    line = PrefillCost(0.006, 0.00025)
    fit = fit_prefill_cost([(n, line.seconds(1, n)) for n in (16, 256, 1200, 300)])
    assert fit.fixed_s == pytest.approx(0.006) and fit.per_token_s == pytest.approx(0.00025)
    assert fit_prefill_cost([]) is None and fit_prefill_cost([(4, 0.035), (4, 0.03)]) is None  # one size: no split
    prior = fit_prefill_cost([], CALIBRATION)
    assert prior.fixed_s == pytest.approx(0.002) and prior.per_token_s == pytest.approx(0.00025)
    assert fit_prefill_cost([(100, 0.05), (200, 0.04)]) == PrefillCost(0.045, 0.0)  # bigger was not slower
    assert fit_prefill_cost([(100, 0.0), (200, 0.1)]) == PrefillCost(0.0, 0.05 / 150)  # no fixed part: the rate
    with pytest.raises(ValueError, match="per_token_s"):
        PrefillCost(0.0, -1.0)


def test_prefills_of_one_size_set_the_fixed_part_and_keep_the_calibrated_per_token_part():
    """The graph under load: chat follow-ups (about 170 tokens to compute each) take 0.4 s, mostly
    per-prefill cost; a cold 1.2K prompt then took about 0.7 s. The fit keeps the calibration's
    0.25 ms/token and puts the rest in the fixed part; a line through the calibration and those
    samples (the calibration as two more samples) put 1.4 ms on every token."""
    follow_ups = [(170 + i % 3 * 8, 0.4 + 0.01 * (i % 2)) for i in range(32)]
    cost = fit_prefill_cost(follow_ups, CALIBRATION)
    assert cost.per_token_s == pytest.approx(0.00025, rel=0.05) and 0.35 < cost.fixed_s < 0.37
    assert 0.6 < cost.seconds(1, 1220) < 0.7
    assert fit_prefill_cost([*follow_ups, *CALIBRATION]).seconds(1, 1220) > 1.5  # the pooled line
    # samples over a wider range of sizes than the calibration's: their own per-token part
    wide = [(n, 0.3 + 0.0005 * n) for n in (170, 1220) * 8]
    assert fit_prefill_cost(wide, CALIBRATION).per_token_s == pytest.approx(0.0005, rel=0.02)


def test_a_short_warm_up_no_longer_makes_long_prompts_look_slow():
    """Issue 38's figures (this machine, graphs/pdd.yaml, fresh): a 4-token warm-up prefill took
    35 ms of engine time. The old rate model put three queued 1.2K prompts and a fourth at 42 s;
    the fit puts them at about 1.3 s."""
    cost = fit_prefill_cost([(4, 0.035)], CALIBRATION)
    assert cost.seconds(4, 4 * 1220) < 1.5 and prefill_admits(3, 3 * 1220, 1220, cost, 30.0)
    assert 4 * 1220 / (4 / 0.035) > PREFILL_ADMIT_SHARE * 30.0  # what the rate model said: refuse


def test_prefill_admits_by_its_queue_against_the_budget():
    cost = PrefillCost(0.5, 0.01)
    assert prefill_admits(0, 0, 10_000, cost, 1.0)  # an idle replica takes any prompt, however long
    assert prefill_admits(5, 5_000, 100, None, 1.0)  # nothing fitted yet: no estimate to refuse on
    assert prefill_admits(5, 5_000, 100, cost, None)  # no budget: nobody gives up on it
    # 2 prefills ahead (100 tokens) + this one (100): 3 x 0.5 s + 200 x 0.01 s = 3.5 s
    assert prefill_admits(2, 100, 100, cost, 3.5 / PREFILL_ADMIT_SHARE)
    assert not prefill_admits(2, 100, 100, cost, 3.4 / PREFILL_ADMIT_SHARE)


# ---------------------------------------------------------------- a Prefill replica, in process


def _cold(rid: str, n: int, rng: random.Random) -> GenRequest:
    return GenRequest(rid, tuple(rng.randrange(3, 500) for _ in range(n)), SamplingParams(4, ignore_eos=True))


def test_a_fresh_prefill_after_a_short_warm_up_admits_four_concurrent_cold_1200_token_prompts() -> None:
    """graphs/pdd.yaml's Prefill (its model, its 30 s budget), fresh: a 4-token warm-up request
    whose forward pays a fresh replica's per-call cost (30 ms more, as measured in the graph),
    then four cold 1.2K-token prompts at once. All four are admitted and prefilled."""
    from pdd_serve.config import load_graph_yaml
    from pdd_serve.serve.prefill import Prefill

    graph = load_graph_yaml(ROOT / "graphs/pdd.yaml")
    # a smaller KV pool than the graph's 256 MiB: four 1.2K prompts need 10 MB of it
    small = dataclasses.replace(graph, model=dataclasses.replace(graph.model, kv_cache_bytes=32 << 20))
    budget = small.policy.kv_wait_timeout_s
    prefill = Prefill.func_or_class(small)
    rng = random.Random(38)

    async def main() -> list:
        assert prefill.cost is None  # nothing measured yet: the calibration runs before the first prefill
        prefill.engine.on_forward = lambda work: time.sleep(0.03) if work.new_tokens == 4 else None
        await prefill.prefill(PrefillRequest(_cold("warm", 4, rng), False, None, budget_s=budget))
        prefill.engine.on_forward = None
        n, warm_s = prefill._done[-1]
        assert n == 4 and 4 * 1220 * warm_s / n > PREFILL_ADMIT_SHARE * budget  # a rate would refuse
        return await asyncio.gather(*(prefill.prefill(PrefillRequest(_cold(f"cold-{i}", 1220, rng), False, None,
                                                                     budget_s=budget)) for i in range(4)))

    try:
        results = asyncio.run(main())
    finally:
        prefill.worker._exec.shutdown(wait=True)
    assert len(results) == 4 and prefill.shed == 0 and prefill.queued == prefill.queued_tokens == 0
    assert [n for n, _ in list(prefill._done)[-4:]] == [1220] * 4  # each computed whole: cold


def test_admission_refuses_once_the_queue_is_past_the_budget(cfg) -> None:  # noqa: F811 - the fixture
    """Two prompts queued behind a busy engine thread: a third is refused at once when their
    fitted time and its own would end past 0.75 of its budget, with the estimate in its words;
    the refusal holds nothing, and once the queue drains the same request is taken."""
    from pdd_serve.serve.prefill import Prefill

    prefill = Prefill.func_or_class(cfg)
    serve_once(prefill)
    gate = threading.Event()

    async def main() -> None:
        cost = prefill.cost  # the calibration's two sizes and the first prefill's
        busy = asyncio.ensure_future(prefill.worker.call(gate.wait, 10))  # the engine thread is held
        ahead = [asyncio.ensure_future(prefill.prefill(PrefillRequest(long_request(f"ahead-{i}"), False, None,
                                                                      budget_s=60))) for i in range(2)]
        await until(lambda: prefill.queued == 2)
        assert prefill.queued_tokens == 800  # cold: every token to compute
        past = cost.seconds(3, 1200) / PREFILL_ADMIT_SHARE  # just what the queue and this one need
        with pytest.raises(PrefillBusy) as e:
            await prefill.prefill(PrefillRequest(long_request("shed"), False, None, budget_s=0.9 * past))
        words = str(e.value)
        assert "2 prefills queued ahead, 800 prompt tokens" in words and f"{0.9 * past:.3g}s budget" in words
        assert f"{cost.per_token_s * 1e3:.3g} ms/token" in words
        assert is_overloaded(e.value) and refusal(e.value)[0] == "prefill_queue"
        assert prefill.queued == 2 and prefill.shed == 1
        gate.set()
        await busy
        await asyncio.gather(*ahead)
        assert prefill.queued == prefill.queued_tokens == 0  # now idle: the same request is taken
        await prefill.prefill(PrefillRequest(long_request("shed"), False, None, budget_s=60))

    free = prefill.engine.pool.num_free
    try:
        asyncio.run(main())
    finally:
        gate.set()
        prefill.worker._exec.shutdown(wait=True)
    assert prefill.shed == 1 and prefill.stats().extra["prefills_shed"] == 1
    assert prefill.stats().extra["prefill_cost"]["per_token_s"] > 0
    assert prefill.prefilling == 0 and prefill.engine.pool.num_free + prefill.engine.cache.num_blocks >= free


# ---------------------------------------------------------------- every 503 explains itself


class _Wrapped(RuntimeError):  # how Ray hands back a replica's exception
    def __init__(self, cause: BaseException) -> None:
        super().__init__("Traceback ... /home/secret/path.py")
        self.cause = cause


def _overloaded(cause: BaseException) -> Overloaded:
    try:
        raise Overloaded("Prefill could not take the prompt within its budget over 3 attempts") from cause
    except Overloaded as e:
        return e


BUSY = PrefillBusy("Prefill's queue is past the budget: 3 prefills queued ahead, 3660 prompt tokens to compute, "
                   "~1.3s at 6 ms + 0.25 ms/token; r's 1220 tokens would end at ~1.6s, past 0.75 of its 1s budget")


@pytest.mark.parametrize("e, reason, words", [
    (_overloaded(_Wrapped(BUSY)), "prefill_queue", str(BUSY)),
    (_overloaded(_Wrapped(PrefillSendFull("16 MB on the line"))), "prefill_send_buffer", "16 MB on the line"),
    (_overloaded(_Wrapped(PrefillPoolFull("the KV pool is full"))), "prefill_kv_pool", "the KV pool is full"),
    (_overloaded(TimeoutError("prefill did not answer within 30s")), "prefill_timeout", "within 30s"),
    (Overloaded("every main decode replica's KV pool is full"), "decode_kv_pool", "every main decode"),
    (_Wrapped(RelaySaturated("the relay is at 8")), "relay", "the relay is at 8"),
    # no MD could take a migrated request, because the prefill its KV needed was refused
    (_overloaded(_overloaded(_Wrapped(BUSY))), "prefill_queue", str(BUSY)),
])
def test_every_503_names_what_refused_it_in_its_body_its_log_line_and_its_counter(e, reason, words, caplog):
    from pdd_serve.serve.router import Router, client_error

    err = client_error(e, "cmpl-1")
    assert err.status == 503 and f"({reason})" in err.message and "secret" not in err.message
    counted: list[dict] = []
    router = SimpleNamespace(metrics=SimpleNamespace(rejected=SimpleNamespace(
        inc=lambda tags: counted.append(tags))))
    st = RequestState(GenRequest("cmpl-1-abc", (1, 2, 3), SamplingParams(4)))
    with caplog.at_level(logging.WARNING, logger="pdd_serve"):
        assert Router.func_or_class._refused(router, e, st).body() == err.body()
    assert counted == [{"reason": reason}]
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"request cmpl-1-abc refused (503, {reason}): ") and words in line
