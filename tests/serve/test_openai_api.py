"""The OpenAI protocol layer: parsing/validation, auth, incremental detokenization, response shapes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdd_serve.config import ServerConfig
from pdd_serve.serve.openai_api import (
    APIError,
    CompletionRequest,
    check_api_key,
    internal_error,
    parse_request,
)
from pdd_serve.serve.openai_output import (
    SSE_DONE,
    IncrementalDetokenizer,
    completion_chunk,
    completion_response,
    models_response,
    new_request_id,
    pdd_facts,
    sse,
    usage_chunk,
)

MODEL = "pdd-small"
MAX_LEN = 256  # the fixture model's max_position_embeddings
CFG = ServerConfig(model_name=MODEL, max_tokens_limit=200, max_stop=4)
UNICODE_TEXTS = [
    "héllo 😀 wörld — ñ 中文 naïve café 🎉🎉 done",
    "Ünïcödé ✓ ∑ x² ≤ ∞; ¿qué? «ok» 日本語のテキスト 👩‍👩‍👧 flags 🇫🇷",
    "plain ascii, with\nnewlines\tand tabs",
]


@pytest.fixture(scope="session")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from pdd_serve.checkpoints import make_model

    path = make_model(tmp_path_factory.mktemp("ckpt") / "tiny", arch="llama", layers=1, hidden=32, heads=2,
                      kv_heads=1, intermediate=64, vocab=512, max_pos=MAX_LEN)
    return AutoTokenizer.from_pretrained(Path(path))


def body(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, **fields}).encode()


def parse(tok: Any, raw: bytes | dict, kind: str = "completion", cfg: ServerConfig = CFG,
          allow_overrides: bool = False, max_model_len: int = MAX_LEN) -> CompletionRequest:
    if isinstance(raw, dict):
        raw = body(**raw)
    return parse_request(raw, kind, cfg, tok, max_model_len, allow_overrides)


def parse_err(tok: Any, raw: bytes | dict, kind: str = "completion", **kw: Any) -> APIError:
    with pytest.raises(APIError) as ei:
        parse(tok, raw, kind, **kw)
    e = ei.value
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    json.dumps(e.body(), ensure_ascii=False).encode("utf-8")  # a server can always send it
    return e


# ---------------------------------------------------------------- bad inputs

P = {"prompt": "hi"}
M = {"messages": [{"role": "user", "content": "hi"}]}

BAD_COMPLETIONS = [
    # (fields, param)
    ({}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [""]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [["a"]]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": [True, 3]}, "prompt"),
    ({"prompt": [512]}, "prompt"),  # vocab is 512
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "a\ud800b"}, "prompt"),  # lone surrogate from a JSON escape
    ({**P, "max_tokens": "16"}, "max_tokens"),
    ({**P, "max_tokens": 16.5}, "max_tokens"),
    ({**P, "max_tokens": True}, "max_tokens"),
    ({**P, "max_tokens": 0}, "max_tokens"),
    ({**P, "max_tokens": -3}, "max_tokens"),
    ({**P, "max_tokens": 201}, "max_tokens"),  # over CFG.max_tokens_limit
    ({**P, "temperature": -0.1}, "temperature"),
    ({**P, "temperature": 2.01}, "temperature"),
    ({**P, "temperature": "1"}, "temperature"),
    ({**P, "temperature": True}, "temperature"),
    ({**P, "temperature": 10**400}, "temperature"),
    ({**P, "top_p": 0}, "top_p"),
    ({**P, "top_p": 1.01}, "top_p"),
    ({**P, "top_p": [1]}, "top_p"),
    ({**P, "top_k": -2}, "top_k"),
    ({**P, "top_k": 2.5}, "top_k"),
    ({**P, "n": 2}, "n"),
    ({**P, "n": 0}, "n"),
    ({**P, "n": "1"}, "n"),
    ({**P, "stop": 5}, "stop"),
    ({**P, "stop": [1]}, "stop"),
    ({**P, "stop": ["a", None]}, "stop"),
    ({**P, "stop": [""]}, "stop"),
    ({**P, "stop": ["a", "b", "c", "d", "e"]}, "stop"),  # over CFG.max_stop
    ({**P, "stop": "\udfff"}, "stop"),
    ({**P, "stop_token_ids": 3}, "stop_token_ids"),
    ({**P, "stop_token_ids": [1.0]}, "stop_token_ids"),
    ({**P, "stop_token_ids": [9999]}, "stop_token_ids"),
    ({**P, "stream": "yes"}, "stream"),
    ({**P, "stream": 1}, "stream"),
    ({**P, "stream_options": True}, "stream_options"),
    ({**P, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({**P, "seed": "1"}, "seed"),
    ({**P, "seed": 1.5}, "seed"),
    ({**P, "seed": 2**70}, "seed"),
    ({**P, "ignore_eos": "no"}, "ignore_eos"),
    ({**P, "user": 5}, "user"),
    ({**P, "logprobs": 1}, "logprobs"),
    ({**P, "logprobs": 0}, "logprobs"),
    ({**P, "echo": True}, "echo"),
    ({**P, "best_of": 2}, "best_of"),
    ({**P, "suffix": "end"}, "suffix"),
    ({**P, "presence_penalty": 0.5}, "presence_penalty"),
    ({**P, "logit_bias": {"5": 10}}, "logit_bias"),
    ({"model": 5, **P}, "model"),
    ({"model": None, **P}, "model"),
]

BAD_CHATS = [
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [1]}, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "\ud83d"}]}, "messages[0].content"),
    # The tiny model's template has no tool turn: its raise_exception() becomes a 400, not a 500.
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),
    ({**M, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**M, "max_completion_tokens": 500}, "max_completion_tokens"),
    ({**M, "max_tokens": "5"}, "max_tokens"),
    ({**M, "logprobs": True}, "logprobs"),
    ({**M, "top_logprobs": 3}, "top_logprobs"),
    ({**M, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({**M, "frequency_penalty": 1}, "frequency_penalty"),
    ({**M, "n": 3}, "n"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_COMPLETIONS)
def test_bad_completion_fields(tok: Any, fields: dict, param: str) -> None:
    raw = json.dumps(fields if "model" in fields else {"model": MODEL, **fields}).encode()
    e = parse_err(tok, raw)
    assert (e.status, e.type, e.param) == (400, "invalid_request_error", param), e


@pytest.mark.parametrize(("fields", "param"), BAD_CHATS)
def test_bad_chat_fields(tok: Any, fields: dict, param: str) -> None:
    e = parse_err(tok, fields, "chat")
    assert (e.status, e.type, e.param) == (400, "invalid_request_error", param), e


def test_unsupported_fields_say_so(tok: Any) -> None:
    for field, value in (("logprobs", 2), ("echo", True), ("best_of", 3), ("suffix", "x")):
        e = parse_err(tok, {**P, field: value})
        assert "not supported" in e.message and e.code == "unsupported_parameter"


@pytest.mark.parametrize("raw", [b"{", b"", b"\xff\xfe", b"[1, 2]", b"null", b'"text"', b"42",
                                 b'{"model": "pdd-small", "prompt": "hi", "temperature": NaN}',
                                 b'{"model": "pdd-small", "prompt": "hi", "temperature": Infinity}',
                                 b"[" * 100_000, b'{"a": ' * 50_000])
def test_malformed_json_is_400(tok: Any, raw: bytes) -> None:
    e = parse_err(tok, raw)
    assert e.status == 400 and e.param is None


def test_overflowing_float_is_400(tok: Any) -> None:
    e = parse_err(tok, b'{"model": "pdd-small", "prompt": "hi", "temperature": 1e999}')
    assert (e.status, e.param) == (400, "temperature")


def test_body_too_large_is_413(tok: Any) -> None:
    cfg = dataclasses.replace(CFG, max_body_bytes=64)
    e = parse_err(tok, body(prompt="x" * 100), cfg=cfg)
    assert e.status == 413 and "64" in e.message
    assert parse(tok, body(prompt="x"), cfg=cfg).prompt_token_ids  # at the limit is fine


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_unknown_model_is_404(tok: Any, kind: str) -> None:
    e = parse_err(tok, json.dumps({"model": "gpt-9", **P, **M}).encode(), kind)
    assert (e.status, e.type, e.code, e.param) == (404, "not_found_error", "model_not_found", "model")
    assert "gpt-9" in e.message and MODEL in e.message


def test_missing_model_is_400(tok: Any) -> None:
    e = parse_err(tok, json.dumps(P).encode())
    assert (e.status, e.param) == (400, "model") and MODEL in e.message


def test_prompt_over_max_prompt_tokens(tok: Any) -> None:
    cfg = dataclasses.replace(CFG, max_prompt_tokens=8)
    assert len(parse(tok, {"prompt": list(range(8))}, cfg=cfg).prompt_token_ids) == 8
    e = parse_err(tok, {"prompt": list(range(9))}, cfg=cfg)
    assert (e.status, e.param) == (400, "prompt") and "8" in e.message
    e = parse_err(tok, {"messages": [{"role": "user", "content": "a long chat message"}]}, "chat", cfg=cfg)
    assert (e.status, e.param) == (400, "messages")


def test_context_length_exceeded(tok: Any) -> None:
    e = parse_err(tok, {"prompt": [5] * 200, "max_tokens": 57})
    assert (e.status, e.code) == (400, "context_length_exceeded")
    assert "maximum context length is 256 tokens" in e.message
    assert "257 tokens (200 in the prompt, 57 in the completion)" in e.message
    assert parse(tok, {"prompt": [5] * 200, "max_tokens": 56}).max_tokens == 56  # exactly full is fine
    # The completions default (16) counts too.
    e = parse_err(tok, {"prompt": [5] * 250})
    assert "maximum context length is 256" in e.message and "16 in the completion" in e.message


def test_chat_default_max_tokens_fills_remaining_context(tok: Any) -> None:
    req = parse(tok, M, "chat")
    assert req.max_tokens == min(MAX_LEN - len(req.prompt_token_ids), CFG.max_tokens_limit)
    short = parse(tok, M, "chat", max_model_len=len(req.prompt_token_ids) + 7)
    assert short.max_tokens == 7
    e = parse_err(tok, M, "chat", max_model_len=len(req.prompt_token_ids))  # no room for one token
    assert (e.status, e.param, e.code) == (400, "messages", "context_length_exceeded")
    assert f"maximum context length is {len(req.prompt_token_ids)} tokens" in e.message


def test_pdd_override_needs_permission(tok: Any) -> None:
    e = parse_err(tok, {**P, "pdd": {"pipeline": "P-MD"}})
    assert (e.status, e.type, e.param) == (403, "permission_error", "pdd")
    assert "policy.allow_overrides: true" in e.message
    e = parse_err(tok, {**P, "pdd": {"pipeline": "nope"}})  # permission first, spelling second
    assert e.status == 403


@pytest.mark.parametrize(("pdd", "param"), [
    ("P-MD", "pdd"), ({"pipeline": "P-XX"}, "pdd.pipeline"), ({"handoff_mode": "auto"}, "pdd.handoff_mode"),
    ({"handoff_mode": 1}, "pdd.handoff_mode"), ({"pipeline": "P-MD", "route": "x"}, "pdd"),
])
def test_pdd_override_bad_values(tok: Any, pdd: Any, param: str) -> None:
    e = parse_err(tok, {**P, "pdd": pdd}, allow_overrides=True)
    assert (e.status, e.param) == (400, param)


@pytest.mark.parametrize("pdd", [{"pipeline": "P-MD"}, {"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"},
                                 {"pipeline": "P-RLD"}, {"handoff_mode": "one-shot"}])
def test_pdd_override_good_values(tok: Any, pdd: dict) -> None:
    assert parse(tok, {**P, "pdd": pdd}, allow_overrides=True).pdd_override == pdd
    assert parse(tok, {**P, "pdd": None}, allow_overrides=False).pdd_override is None
    assert parse(tok, {**P, "pdd": {}}, allow_overrides=True).pdd_override is None


def test_unknown_kind_is_a_caller_bug(tok: Any) -> None:
    with pytest.raises(ValueError):
        parse(tok, P, "embeddings")


# ---------------------------------------------------------------- good inputs


def test_good_text_completion(tok: Any) -> None:
    req = parse(tok, {"prompt": "Hello wörld", "max_tokens": 32, "temperature": 0, "top_p": 0.9, "top_k": 40,
                      "seed": 7, "stop": "\n\n", "stop_token_ids": [1, 2], "stream": True,
                      "stream_options": {"include_usage": True}, "ignore_eos": True, "user": "u1", "n": 1,
                      "logprobs": None, "echo": False, "best_of": 1, "suffix": None, "frequency_penalty": 0,
                      "presence_penalty": 0.0, "logit_bias": {}, "unknown_extension": {"ignored": True}})
    assert req.kind == "completion" and req.model == MODEL
    assert req.prompt_token_ids[0] == tok.bos_token_id  # plain text gets BOS, like vLLM
    assert tok.decode(req.prompt_token_ids, skip_special_tokens=True) == "Hello wörld"
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed) == (32, 0.0, 0.9, 40, 7)
    assert (req.stop, req.stop_token_ids, req.stream, req.include_usage) == (("\n\n",), (1, 2), True, True)
    assert (req.ignore_eos, req.user, req.pdd_override) == (True, "u1", None)
    assert isinstance(req.temperature, float)


def test_completion_defaults(tok: Any) -> None:
    req = parse(tok, P)
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed) == (16, 1.0, 1.0, 0, None)
    assert (req.stop, req.stop_token_ids, req.stream, req.include_usage, req.ignore_eos) == ((), (), False,
                                                                                             False, False)
    assert parse(tok, {**P, "top_k": -1}).top_k == 0  # vLLM's "disabled"
    assert parse(tok, {**P, "stop": ["a", "b", "a"]}).stop == ("a", "b")


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]])
def test_token_id_prompt_is_used_verbatim(tok: Any, prompt: list) -> None:
    assert parse(tok, {"prompt": prompt}).prompt_token_ids == (5, 6, 7)


def test_one_element_string_batch(tok: Any) -> None:
    assert parse(tok, {"prompt": ["hi there"]}).prompt_token_ids == parse(tok, {"prompt": "hi there"}).prompt_token_ids


def test_good_chat(tok: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": "Hello!", "name": "bot"},
                {"role": "user", "content": "Ça va? 😀"}]
    req = parse(tok, {"messages": messages, "max_completion_tokens": 12, "max_tokens": 99, "stream": True},
                "chat")
    expected = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Ça va? 😀"}],
        add_generation_prompt=True, tokenize=False)
    assert tok.decode(req.prompt_token_ids) == expected
    assert expected.endswith("<|assistant|>\n")
    assert req.kind == "chat" and req.max_tokens == 12 and req.stream  # max_completion_tokens wins
    assert parse(tok, {**M, "max_tokens": 9}, "chat").max_tokens == 9


def test_developer_role_is_system(tok: Any) -> None:
    dev = parse(tok, {"messages": [{"role": "developer", "content": "x"}]}, "chat")
    sys_ = parse(tok, {"messages": [{"role": "system", "content": "x"}]}, "chat")
    assert dev.prompt_token_ids == sys_.prompt_token_ids


# ---------------------------------------------------------------- API keys


def test_api_key() -> None:
    open_cfg = ServerConfig()
    check_api_key({}, open_cfg)  # no keys configured: anyone may call
    cfg = ServerConfig(api_keys=("sk-one", "sk-two"))
    check_api_key({"Authorization": "Bearer sk-two"}, cfg)
    check_api_key({"authorization": "bearer  sk-one "}, cfg)  # names and scheme are case-insensitive
    for headers in ({}, {"Authorization": "Bearer sk-three"}, {"Authorization": "sk-one"},
                    {"Authorization": "Basic sk-one"}, {"Authorization": "Bearer "}, {"Authorization": "Bearer sk-on"},
                    {"Authorization": "Bearer sk-ünï"}, {"X-Api-Key": "sk-one"}):
        with pytest.raises(APIError) as ei:
            check_api_key(headers, cfg)
        e = ei.value
        assert (e.status, e.type) == (401, "authentication_error")
        assert "Authorization: Bearer" in e.message


def test_api_keys_file_and_admin_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# one a line\nsk-file-1\n\n  sk-file-2  \n")
    cfg = ServerConfig(api_keys_file=str(keys), admin_api_keys=("sk-admin",))
    for k in ("sk-file-1", "sk-file-2", "sk-admin"):  # an admin key is an API key too
        check_api_key({"Authorization": f"Bearer {k}"}, cfg)
    with pytest.raises(APIError) as ei:
        check_api_key({"Authorization": "Bearer # one a line"}, cfg)
    assert ei.value.status == 401
    keys.write_text("sk-rotated\n")  # read again when the file changes: rotation needs no redeploy
    check_api_key({"Authorization": "Bearer sk-rotated"}, cfg)
    keys.unlink()  # a graph that names a key file never serves without it
    with pytest.raises(APIError) as ei:
        check_api_key({"Authorization": "Bearer sk-rotated"}, cfg)
    assert ei.value.status == 503 and str(keys) not in ei.value.message


def test_cache_hit_facts_only_for_admins_or_when_the_graph_exposes_them(tok: Any) -> None:
    """Hit rates (and wan_bytes, the KV MD lacked) let any client probe another tenant's cached
    prefix; routing facts and timings stay."""
    info = {"pipeline": "P-MD", "handoff_mode": "none", "eager_tokens": 0, "md_tokens": 5, "ttft_s": 0.2,
            "kv_ready_s": 0.1, "fallbacks": [], "prefix_hit_p": 0.5, "prefix_hit_md": 0.9375, "wan_bytes": 4096}
    admin = ServerConfig(model_name=MODEL, max_tokens_limit=200, admin_api_keys=("sk-admin",))
    shown = {"pipeline", "handoff_mode", "eager_tokens", "md_tokens", "ttft_s", "kv_ready_s", "fallbacks"}
    for cfg, headers, full in [
        (CFG, {}, False),  # the default: hidden
        (admin, {}, False),
        (admin, {"Authorization": "Bearer sk-other"}, False),
        (admin, {"Authorization": "Bearer sk-admin"}, True),
        (dataclasses.replace(CFG, expose_cache_hits=True), {}, True),
    ]:
        creq = parse_request(body(prompt="hi"), "completion", cfg, tok, MAX_LEN, False, headers=headers)
        out = pdd_facts(info, creq)
        assert set(out) == (set(info) if full else shown), (cfg, headers)
        assert all(out[k] == info[k] for k in out)


def test_internal_errors_are_generic_with_a_request_id() -> None:
    from ray.exceptions import RayTaskError

    from pdd_serve.engine.sampling import RequestError

    secret = "connect to grpc://10.1.2.3:41000 failed: token=abc /home/pdd/.pdd/launch/tls/md.key"
    for e in (RuntimeError(secret), RayTaskError("prefill", f"Traceback ... {secret}", OSError(secret))):
        err = internal_error(e, "cmpl-123-abcdef")
        assert (err.status, err.type) == (500, "server_error")
        text = json.dumps(err.body())
        assert "cmpl-123-abcdef" in text and "10.1.2.3" not in text and "token" not in text
        assert "RuntimeError" not in text and "OSError" not in text
    # a request the client can fix says why, even when it comes wrapped from a replica
    bad = RequestError("prompt (500 tokens) + max_tokens (40) exceeds the model's context of 512 tokens")
    for e in (bad, RayTaskError("prefill", "Traceback (most recent call last): ...", bad).as_instanceof_cause()):
        err = internal_error(e, "cmpl-1")
        assert (err.status, err.message) == (400, str(bad))


# ---------------------------------------------------------------- detokenizer


def stream(tok: Any, ids: list[int], stop: tuple[str, ...] = (), prompt: list[int] | None = None
           ) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, prompt if prompt is not None else tok.encode("Q: "), stop)
    deltas = [d.push(i) for i in ids]
    deltas.append(d.flush())
    return deltas, d


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_detokenizer_utf8_round_trip(tok: Any, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas, d = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text == d.text
    assert all("\ufffd" not in x for x in deltas)  # never a partial character
    assert any(x == "" for x in deltas)  # multi-byte chars really did span tokens here
    for prompt in ([], [tok.bos_token_id], tok.encode("ünïcode prompt 😀")):  # prompt context doesn't leak
        assert "".join(stream(tok, ids, prompt=prompt)[0]) == text


def test_detokenizer_skips_special_tokens(tok: Any) -> None:
    ids = tok.encode("abc", add_special_tokens=False) + [tok.eos_token_id]
    deltas, d = stream(tok, ids)
    assert "".join(deltas) == "abc" and deltas[-2] == ""


def test_detokenizer_flush_releases_incomplete_bytes(tok: Any) -> None:
    ids = tok.encode("ok 😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) and deltas[-1].endswith("\ufffd")


@given(st.text(min_size=1, max_size=40))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_detokenizer_round_trip_property(tok: Any, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert "".join(stream(tok, ids)[0]) == tok.decode(ids)


def test_stop_string_across_token_boundaries(tok: Any) -> None:
    text = "The answer: wörld 😀 peace. More text after."
    ids = tok.encode(text, add_special_tokens=False)
    for stop in ("wörld", "😀 pe", "ld 😀", ". M", "answer"):
        assert len(tok.encode(stop, add_special_tokens=False)) > 1
        d = IncrementalDetokenizer(tok, [], (stop,))
        out, pushed = [], 0
        for i in ids:
            out.append(d.push(i))
            pushed += 1
            if d.stopped:
                break
        assert d.stopped and "".join(out) == text[:text.index(stop)] == d.text, stop
        # Detected at the very token that completed the stop string, not later.
        assert stop in tok.decode(ids[:pushed]) and stop not in tok.decode(ids[:pushed - 1])
        assert d.push(ids[-1]) == "" and d.flush() == ""  # nothing after the stop


def test_stop_string_held_back_then_released(tok: Any) -> None:
    text = "one two three four"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], ("two threes", "our!"))
    deltas = [d.push(i) for i in ids]
    emitted = "".join(deltas)
    assert not d.stopped and emitted == "one two three f"  # "our" might still become "our!"
    assert emitted + d.flush() == text


def test_earliest_stop_wins(tok: Any) -> None:
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    deltas, d = stream(tok, ids, stop=("gamma", "beta", "ha be"))
    assert "".join(deltas) == "alp" and d.stopped


@given(st.text(min_size=1, max_size=30), st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_stop_string_property(tok: Any, text: str, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(text) - 1))
    j = data.draw(st.integers(i + 1, len(text)))
    stop = text[i:j]
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)  # NFC may have changed the text
    deltas, d = stream(tok, ids, stop=(stop, "\x00never"))
    if stop in full:
        assert d.stopped and "".join(deltas) == full[:full.index(stop)]
    else:
        assert "".join(deltas) == full


# ---------------------------------------------------------------- responses


def test_completion_response_shapes() -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    extra = {"pdd": {"pipeline": "P-RLD-MD", "handoff_tokens": 12}}
    raw = completion_response("cmpl-1", 1700000000, MODEL, "completion", "hi ✓", "length", 5, 3, extra)
    c = Completion.model_validate(raw)
    assert (c.object, c.choices[0].text, c.choices[0].finish_reason) == ("text_completion", "hi ✓", "length")
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (5, 3, 8)
    assert raw["pdd"] == extra["pdd"]
    raw = completion_response("chatcmpl-1", 1700000000, MODEL, "chat", "hello", "stop", 5, 1, None)
    cc = ChatCompletion.model_validate(raw)
    assert cc.object == "chat.completion" and cc.choices[0].message.role == "assistant"
    assert cc.choices[0].message.content == "hello" and cc.usage.total_tokens == 6 and "pdd" not in raw


def _completion_chunk_model() -> Any:
    from openai.types import Completion, CompletionChoice

    class Choice(CompletionChoice):
        finish_reason: Literal["stop", "length", "content_filter"] | None = None

    class Chunk(Completion):
        choices: list[Choice]

    return Chunk


_CompletionChunk = _completion_chunk_model()


def test_chunk_shapes() -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletionChunk

    first = ChatCompletionChunk.model_validate(
        completion_chunk("chatcmpl-1", 1, MODEL, "chat", "He", None, first=True, include_usage=True))
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == "He"
    assert first.usage is None
    mid = completion_chunk("chatcmpl-1", 1, MODEL, "chat", "llo", None)
    assert "role" not in mid["choices"][0]["delta"] and "usage" not in mid
    last = ChatCompletionChunk.model_validate(
        completion_chunk("chatcmpl-1", 1, MODEL, "chat", None, "stop", extra={"pdd": {"pipeline": "P-MD"}}))
    assert last.choices[0].finish_reason == "stop" and last.choices[0].delta.content is None
    assert last.model_extra == {"pdd": {"pipeline": "P-MD"}}
    usage = ChatCompletionChunk.model_validate(usage_chunk("chatcmpl-1", 1, MODEL, "chat", 7, 2))
    assert usage.choices == [] and usage.usage.total_tokens == 9

    # The SDK types finish_reason as non-null, but the wire (OpenAI's and vLLM's) sends null on every
    # legacy-completion chunk but the last, and the SDK's streaming path doesn't validate; so mid-stream
    # chunks check against the official model with only that one field relaxed.
    text = _CompletionChunk.model_validate(completion_chunk("cmpl-1", 1, MODEL, "completion", "tok", None))
    assert text.object == "text_completion" and text.choices[0].text == "tok"
    assert text.choices[0].finish_reason is None
    end = Completion.model_validate(completion_chunk("cmpl-1", 1, MODEL, "completion", None, "length"))
    assert end.choices[0].text == "" and end.choices[0].finish_reason == "length"
    u = Completion.model_validate(usage_chunk("cmpl-1", 1, MODEL, "completion", 4, 4, {"pdd": {}}))
    assert u.choices == [] and u.usage.total_tokens == 8


def test_models_response_shape() -> None:
    from openai.types import Model

    raw = models_response(MODEL, 1700000000)
    assert raw["object"] == "list"
    m = Model.model_validate(raw["data"][0])
    assert (m.id, m.object, m.created) == (MODEL, "model", 1700000000)


def test_sse_framing() -> None:
    obj = {"text": "line1\nline2\r\n\u2028 😀", "n": 1}
    frame = sse(obj)
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    payload = frame[len(b"data: "):-2]
    assert b"\n" not in payload and b"\r" not in payload  # one event, one line
    assert json.loads(payload) == obj
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_api_error_body_and_headers() -> None:
    e = APIError(503, "overloaded_error", "busy", code="overloaded", retry_after=0.2)
    assert e.body() == {"error": {"message": "busy", "type": "overloaded_error", "param": None, "code": "overloaded"}}
    assert e.headers() == {"Retry-After": "1"} and str(e) == "busy"
    assert APIError(500, "server_error", "boom").headers() == {}


def test_request_ids() -> None:
    assert new_request_id("chat").startswith("chatcmpl-") and new_request_id("completion").startswith("cmpl-")
    assert new_request_id("chat") != new_request_id("chat")


# ---------------------------------------------------------------- fuzz

_strings = st.one_of(st.text(max_size=12), st.sampled_from(["\ud800", "a\udfffb", MODEL, "user", "text", "P-MD",
                                                             "one-shot", "role", "content"]))
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 600), st.integers(), st.floats(), _strings)
_json = st.recursive(_scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                   st.dictionaries(_strings, c, max_size=4)), max_leaves=12)


_message = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "x"]),
    "content": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2))})
# Mostly valid values, so fuzzing reaches the deep checks (tokenization, context length), not just the first.
_valid_fields = st.fixed_dictionaries({
    "model": st.sampled_from([MODEL, MODEL, MODEL, "other"]),
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-1, 512), max_size=70),
                        st.lists(st.text(max_size=9), max_size=2)),
    "messages": st.lists(_message, max_size=3),
}, optional={
    "max_tokens": st.integers(-1, 130), "max_completion_tokens": st.integers(-1, 130),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-2, 9), "n": st.just(1),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5)), "stop_token_ids": st.lists(st.integers(-1, 520),
                                                                                             max_size=3),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "seed": st.integers(), "ignore_eos": st.booleans(), "user": st.text(max_size=5),
    "pdd": st.fixed_dictionaries({}, optional={"pipeline": st.sampled_from(["P-MD", "P-RLD-MD", "P-RLD", "x", None]),
                                               "handoff_mode": st.sampled_from(["one-shot", "catch-up", "auto"])}),
    "logprobs": st.sampled_from([None, False]), "echo": st.sampled_from([None, False]), "best_of": st.just(1),
    "suffix": st.sampled_from([None, ""]), "frequency_penalty": st.just(0), "tools": st.just([]),
})
_fields = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stop",
           "stop_token_ids", "stream", "stream_options", "seed", "ignore_eos", "user", "pdd", "logprobs", "echo"]
# ...with at most one field replaced by arbitrary JSON.
_plausible = st.builds(lambda d, junk: {**d, **dict([junk] if junk else [])}, _valid_fields,
                       st.none() | st.tuples(st.sampled_from(_fields), _json))
_bodies = st.one_of(
    st.binary(max_size=300),
    _json.map(lambda v: json.dumps(v).encode()),
    _plausible.map(lambda v: json.dumps(v).encode()),
    _plausible.map(lambda v: json.dumps(v).encode()),
    _plausible.map(lambda v: json.dumps(v).encode()),
    _plausible.map(lambda v: json.dumps(v).encode()[: len(json.dumps(v)) // 2]),  # truncated JSON
    st.integers(1000, 3000).map(lambda n: body(prompt="x" * n)),  # around max_body_bytes
)


@given(raw=_bodies, kind=st.sampled_from(["completion", "chat"]), allow=st.booleans())
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
def test_parse_request_fuzz(tok: Any, raw: bytes, kind: str, allow: bool) -> None:
    cfg = ServerConfig(model_name=MODEL, max_body_bytes=2000, max_prompt_tokens=60, max_tokens_limit=100, max_stop=4)
    try:
        req = parse_request(raw, kind, cfg, tok, 128, allow)
    except APIError as e:
        assert e.status in {400, 403, 404, 413}, e
        json.dumps(e.body(), ensure_ascii=False).encode("utf-8")
        return
    assert isinstance(req, CompletionRequest) and req.kind == kind and req.model == MODEL
    assert 1 <= len(req.prompt_token_ids) <= 60 and all(0 <= t < len(tok) for t in req.prompt_token_ids)
    assert 1 <= req.max_tokens <= 100 and len(req.prompt_token_ids) + req.max_tokens <= 128
    assert 0 <= req.temperature <= 2 and 0 < req.top_p <= 1 and req.top_k >= 0
    assert len(req.stop) <= 4 and all(req.stop)
    assert allow or req.pdd_override is None
