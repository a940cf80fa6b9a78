"""The OpenAI-compatible protocol layer, what comes in: request parsing, auth, the errors a client
sees. What goes out (detokenization, response and stream shapes) is openai_output.py.

Pure functions over bytes, dicts and a tokenizer, so the Router deployment stays thin and every
edge case is unit-testable without Ray or an HTTP server. Any client mistake surfaces as an
`APIError` carrying the HTTP status and an OpenAI-style error body; nothing else escapes parsing.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdd_serve.config import PIPELINES, ServerConfig

logger = logging.getLogger("pdd_serve")

KINDS = ("completion", "chat")
CHAT_ROLES = ("system", "user", "assistant", "tool")
# "developer" is the newer OpenAI name for a system message; clients built on recent SDKs send it.
ROLE_ALIASES = {"developer": "system"}
OVERRIDE_HANDOFF_MODES = ("one-shot", "catch-up")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default
SEED_RANGE = (-(2**63), 2**64 - 1)  # what an int64/uint64 seed may hold; bigger is a client bug


class APIError(Exception):
    """A request failure with its HTTP status and the fields of an OpenAI error body."""

    def __init__(self, status: int, type: str, message: str, param: str | None = None,
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Extra response headers: Retry-After (whole seconds, rounded up) for 429/503."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.type!r}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, "invalid_request_error", message, param=param, code=code)


@dataclass(frozen=True)
class CompletionRequest:
    kind: str  # completion | chat
    model: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables (the engine's convention; -1 from vLLM-style clients maps here)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    pdd_override: dict[str, str] | None = None  # validated {pipeline?, handoff_mode?}
    user: str | None = None
    return_token_ids: bool = False  # vLLM's extension: choices carry the output token ids
    reveal_cache_hits: bool = False  # the `pdd` object may carry cache-hit facts (pdd_facts)


# ---------------------------------------------------------------- parsing


def _reject_constant(name: str) -> float:
    # JSON has no NaN/Infinity; Python's json accepts them by default, which would let a NaN
    # temperature slip past range checks written as comparisons.
    raise ValueError(f"invalid JSON constant {name}")


def _load_object(raw: bytes, cfg: ServerConfig) -> dict[str, Any]:
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if len(raw) > cfg.max_body_bytes:
        raise APIError(413, "invalid_request_error",
                       f"Request body is {len(raw)} bytes; the limit is {cfg.max_body_bytes} bytes.",
                       code="request_too_large")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _bad(f"Request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise _bad(f"Request body must be a JSON object, got {_json_type(body)}.", code="invalid_json")
    return body


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _text(v: str, param: str) -> str:
    # JSON "\ud800" escapes decode to lone surrogates, which the Rust tokenizer can't take and a
    # UTF-8 response encoder can't echo back.
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(f"'{param}' contains an unpaired UTF-16 surrogate.", param=param) from None
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not 1


def _is_number(v: Any) -> bool:
    # Finite only (JSON 1e999 parses to inf); math.isfinite would overflow on a 400-digit int.
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _opt_int(body: Mapping[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise _bad(f"'{name}' must be an integer, got {_json_type(v)}.", param=name)
    return v


def _opt_number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float,
                lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise _bad(f"'{name}' must be a finite number, got {_json_type(v)}.", param=name)
    if (v <= lo if lo_open else v < lo) or v > hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise _bad(f"'{name}' must be in {interval}, got {v}.", param=name)
    return float(v)


def _opt_bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{name}' must be a boolean, got {_json_type(v)}.", param=name)
    return v


def _is_neutral(v: Any, neutral: Any) -> bool:
    if v is None:
        return True
    if isinstance(neutral, bool) or isinstance(v, bool):  # True == 1 in Python; JSON keeps them apart
        return v is neutral
    if _is_number(neutral):
        return _is_number(v) and v == neutral
    return v == neutral


def _check_unsupported(body: Mapping[str, Any], kind: str) -> None:
    # Ignoring these would silently return something the client didn't ask for; their neutral
    # values (which some SDKs always send) are accepted.
    neutral: dict[str, tuple[Any, ...]] = {"logprobs": (False,), "presence_penalty": (0,),
                                           "frequency_penalty": (0,), "logit_bias": ({},)}
    if kind == "completion":
        neutral.update(echo=(False,), best_of=(1,), suffix=("",))
    else:
        neutral.update(top_logprobs=(0,), tools=([],), tool_choice=("none",), functions=([],),
                       function_call=("none",))
    for name, ok in neutral.items():
        v = body.get(name)
        if not any(_is_neutral(v, o) for o in ok):
            raise _bad(f"'{name}' is not supported by this server (got {json.dumps(v)[:80]}); "
                       f"omit it or send {json.dumps(ok[0])}.", param=name, code="unsupported_parameter")


def _check_model(body: Mapping[str, Any], cfg: ServerConfig) -> str:
    model = body.get("model")
    if model is None:
        raise _bad(f"'model' is required (this server serves '{cfg.model_name}').", param="model")
    if not isinstance(model, str):
        raise _bad(f"'model' must be a string, got {_json_type(model)}.", param="model")
    if model != cfg.model_name:
        raise APIError(404, "not_found_error",
                       f"The model {json.dumps(model[:200])} does not exist; this server serves '{cfg.model_name}'.",
                       param="model", code="model_not_found")
    return model


def _check_n(body: Mapping[str, Any]) -> None:
    n = body.get("n")
    if n is not None and not (_is_int(n) and n == 1):
        raise _bad(f"Only n=1 is supported, got {json.dumps(n)[:40]}; send one request per choice.", param="n")


def _token_ids(v: list[Any], vocab: int, param: str) -> tuple[int, ...]:
    for t in v:
        if not _is_int(t):
            raise _bad(f"'{param}' token ids must be integers, got {_json_type(t)}.", param=param)
        if not 0 <= t < vocab:
            raise _bad(f"Token id {t} in '{param}' is outside the vocabulary [0, {vocab}).", param=param,
                       code="invalid_token_id")
    return tuple(v)


def _is_id_list(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


def _completion_prompt(body: Mapping[str, Any], tokenizer: Any) -> tuple[int, ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("'prompt' is required.", param="prompt")
    # OpenAI accepts a batch (list of strings / of id lists); one element is just a prompt.
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise _bad(f"Batched prompts are not supported (got {len(prompt)}); send one prompt per request.",
                       param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("'prompt' must not be empty.", param="prompt")
        return tuple(_encode(tokenizer, _text(prompt, "prompt")))
    if not isinstance(prompt, list):
        raise _bad(f"'prompt' must be a string or a list of token ids, got {_json_type(prompt)}.", param="prompt")
    if not prompt:
        raise _bad("'prompt' must not be empty.", param="prompt")
    if not _is_id_list(prompt):
        raise _bad("'prompt' must be a string, a list of token ids, or a one-element list of either.",
                   param="prompt")
    return _token_ids(prompt, len(tokenizer), "prompt")


def _encode(tokenizer: Any, text: str) -> list[int]:
    # add_special_tokens: plain-text prompts get BOS like the model saw in training (vLLM does too).
    return list(tokenizer.encode(text, add_special_tokens=True))


def _message_content(msg: Mapping[str, Any], i: int) -> str:
    param = f"messages[{i}].content"
    content = msg.get("content")
    if isinstance(content, str):
        return _text(content, param)
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"'{param}[{j}]' must be {{\"type\": \"text\", \"text\": <string>}}; "
                           "only text content parts are supported.", param=param)
            texts.append(_text(part["text"], param))
        return "\n".join(texts)  # vLLM joins text parts the same way
    raise _bad(f"'{param}' must be a string or a list of text parts, got {_json_type(content)}.", param=param)


def _chat_prompt(body: Mapping[str, Any], tokenizer: Any) -> tuple[int, ...]:
    messages = body.get("messages")
    if messages is None:
        raise _bad("'messages' is required.", param="messages")
    if not isinstance(messages, list):
        raise _bad(f"'messages' must be an array, got {_json_type(messages)}.", param="messages")
    if not messages:
        raise _bad("'messages' must not be empty.", param="messages")
    rendered = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _bad(f"'messages[{i}]' must be an object, got {_json_type(msg)}.", param=f"messages[{i}]")
        role = msg.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in CHAT_ROLES:
            raise _bad(f"'messages[{i}].role' must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)[:40]}.",
                       param=f"messages[{i}].role")
        rendered.append({"role": role, "content": _message_content(msg, i)})
    from jinja2 import TemplateError  # a transformers dependency; lazy like the tokenizer itself

    try:
        ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True)
    except TemplateError as e:  # the template's raise_exception(): e.g. a role this model has no turn for
        raise _bad(f"The model's chat template rejected 'messages': {e}", param="messages") from None
    if isinstance(ids, Mapping):  # transformers >= 5 returns a BatchEncoding here
        ids = ids["input_ids"]
    return tuple(int(t) for t in ids)


def _stop(body: Mapping[str, Any], cfg: ServerConfig) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("'stop' must be a string or an array of strings.", param="stop")
    if len(stop) > cfg.max_stop:
        raise _bad(f"'stop' may hold at most {cfg.max_stop} sequences, got {len(stop)}.", param="stop")
    if any(not _text(s, "stop") for s in stop):
        raise _bad("'stop' sequences must not be empty.", param="stop")
    return tuple(dict.fromkeys(stop))  # dedupe, keep order


def _stop_token_ids(body: Mapping[str, Any], vocab: int) -> tuple[int, ...]:
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    if not isinstance(v, list):
        raise _bad(f"'stop_token_ids' must be an array of integers, got {_json_type(v)}.", param="stop_token_ids")
    return tuple(dict.fromkeys(_token_ids(v, vocab, "stop_token_ids")))


def _top_k(body: Mapping[str, Any]) -> int:
    k = _opt_int(body, "top_k")
    if k is None or k == -1:
        return 0
    if k < 0:
        raise _bad(f"'top_k' must be >= 0 (0 or -1 disables it), got {k}.", param="top_k")
    return k


def _seed(body: Mapping[str, Any]) -> int | None:
    seed = _opt_int(body, "seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise _bad("'seed' must fit in 64 bits.", param="seed")
    return seed


def _include_usage(body: Mapping[str, Any]) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise _bad(f"'stream_options' must be an object, got {_json_type(opts)}.", param="stream_options")
    v = opts.get("include_usage")
    if v is not None and not isinstance(v, bool):
        raise _bad("'stream_options.include_usage' must be a boolean.", param="stream_options.include_usage")
    return bool(v)


def _pdd_override(body: Mapping[str, Any], allow_overrides: bool) -> dict[str, str] | None:
    v = body.get("pdd")
    if v is None:
        return None
    if not allow_overrides:
        # Checked before the values: the permission, not the spelling, is what the client must fix.
        raise APIError(403, "permission_error",
                       "Per-request 'pdd' overrides are disabled on this deployment; the graph must set "
                       "`policy.allow_overrides: true` to honour them.", param="pdd", code="overrides_disabled")
    if not isinstance(v, dict):
        raise _bad(f"'pdd' must be an object, got {_json_type(v)}.", param="pdd")
    allowed = {"pipeline": PIPELINES, "handoff_mode": OVERRIDE_HANDOFF_MODES}
    out: dict[str, str] = {}
    for key, val in v.items():
        if key not in allowed:
            raise _bad(f"Unknown 'pdd' key {json.dumps(key[:40])}; valid: {', '.join(allowed)}.", param="pdd")
        if val is None:
            continue
        if val not in allowed[key]:
            raise _bad(f"'pdd.{key}' must be one of {', '.join(allowed[key])}, got {json.dumps(val)[:40]}.",
                       param=f"pdd.{key}")
        out[key] = val
    return out or None


def _max_tokens(body: Mapping[str, Any], kind: str, cfg: ServerConfig, prompt_len: int,
                max_model_len: int) -> tuple[int, str]:
    """(max_tokens, the field it came from); the chat default fills the remaining context."""
    if kind == "chat":
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    else:
        name = "max_tokens"
    v = _opt_int(body, name)
    if v is None:
        if kind == "completion":
            return DEFAULT_COMPLETION_MAX_TOKENS, name
        return min(max_model_len - prompt_len, cfg.max_tokens_limit), name
    if v <= 0:
        raise _bad(f"'{name}' must be >= 1, got {v}.", param=name)
    if v > cfg.max_tokens_limit:
        raise _bad(f"'{name}' is {v}; this server allows at most {cfg.max_tokens_limit}.", param=name)
    return v, name


def parse_request(raw: bytes, kind: str, cfg: ServerConfig, tokenizer: Any, max_model_len: int,
                  allow_overrides: bool, headers: Mapping[str, str] | None = None) -> CompletionRequest:
    """Validate one /v1/completions (kind "completion") or /v1/chat/completions ("chat") body.
    `headers` tell who asks (an admin key may see cache-hit facts)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")  # a caller bug, not a client's
    body = _load_object(raw, cfg)
    model = _check_model(body, cfg)
    _check_unsupported(body, kind)
    _check_n(body)
    override = _pdd_override(body, allow_overrides)
    prompt_param = "messages" if kind == "chat" else "prompt"
    # Cheap field checks run before tokenization so junk bodies cost no tokenizer time.
    temperature = _opt_number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _opt_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _top_k(body)
    seed = _seed(body)
    stop = _stop(body, cfg)
    vocab = len(tokenizer)
    stop_token_ids = _stop_token_ids(body, vocab)
    stream = _opt_bool(body, "stream")
    include_usage = _include_usage(body)
    ignore_eos = _opt_bool(body, "ignore_eos")
    return_token_ids = _opt_bool(body, "return_token_ids")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad(f"'user' must be a string, got {_json_type(user)}.", param="user")
    if user is not None:
        _text(user, "user")
    for name in ("max_tokens", "max_completion_tokens"):
        _opt_int(body, name)  # type errors before the (slower) prompt work

    ids = _chat_prompt(body, tokenizer) if kind == "chat" else _completion_prompt(body, tokenizer)
    if not ids:
        raise _bad(f"'{prompt_param}' produced no tokens.", param=prompt_param)
    n = len(ids)
    if cfg.max_prompt_tokens is not None and n > cfg.max_prompt_tokens:
        raise _bad(f"The prompt is {n} tokens; this server accepts at most {cfg.max_prompt_tokens}.",
                   param=prompt_param, code="prompt_too_long")
    max_tokens, mt_name = _max_tokens(body, kind, cfg, n, max_model_len)
    if max_tokens <= 0 or n + max_tokens > max_model_len:
        what = "messages" if kind == "chat" else "prompt"
        raise _bad(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                   f"{n + max(max_tokens, 1)} tokens ({n} in the {what}, {max(max_tokens, 1)} in the completion). "
                   f"Please reduce the length of the {what} or completion.",
                   param=prompt_param if max_tokens <= 0 else mt_name, code="context_length_exceeded")
    return CompletionRequest(
        kind=kind, model=model, prompt_token_ids=ids, max_tokens=max_tokens, temperature=temperature,
        top_p=top_p, top_k=top_k, seed=seed, stop=stop, stop_token_ids=stop_token_ids, stream=stream,
        include_usage=include_usage, ignore_eos=ignore_eos, pdd_override=override, user=user,
        return_token_ids=return_token_ids,
        reveal_cache_hits=cfg.expose_cache_hits or is_admin(headers or {}, cfg),
    )


# ---------------------------------------------------------------- auth


def check_api_key(headers: Mapping[str, str], cfg: ServerConfig) -> None:
    """Require `Authorization: Bearer <key>` with one of the API keys (cfg.api_keys, the lines of
    cfg.api_keys_file, or an admin key) when any are configured."""
    keys = _api_keys(cfg)
    if not keys:
        return
    if not _bearer_matches(headers, keys + cfg.admin_api_keys):
        raise APIError(401, "authentication_error",
                       "Missing or invalid API key. Pass it as the header `Authorization: Bearer <key>` "
                       "(OpenAI SDKs: api_key=<key> or $OPENAI_API_KEY).", code="invalid_api_key")


def is_admin(headers: Mapping[str, str], cfg: ServerConfig) -> bool:
    return bool(cfg.admin_api_keys) and _bearer_matches(headers, cfg.admin_api_keys)


def _bearer_matches(headers: Mapping[str, str], keys: Sequence[str]) -> bool:
    # Plain dicts are case-sensitive; HTTP header names are not.
    value = next((v for k, v in headers.items() if k.lower() == "authorization"), None)
    scheme, _, token = (value or "").strip().partition(" ")
    given = token.strip().encode("utf-8", "surrogatepass")
    ok = False
    for key in keys:  # no early exit: timing must not reveal which key (or prefix) matched
        ok |= hmac.compare_digest(given, key.encode("utf-8", "surrogatepass"))
    return scheme.lower() == "bearer" and ok


def _api_keys(cfg: ServerConfig) -> tuple[str, ...]:
    if cfg.api_keys_file is None:
        return cfg.api_keys
    try:  # stat per request, read on change: keys rotate without a redeploy
        st = os.stat(cfg.api_keys_file)
        return cfg.api_keys + _read_keys(cfg.api_keys_file, st.st_mtime_ns, st.st_size)
    except OSError as e:  # fail closed: a graph that names a key file never serves without it
        logger.error("server.api_keys_file %s can't be read: %s", cfg.api_keys_file, e)
        raise APIError(503, "server_error", "The server's API keys are unavailable; try again later.",
                       retry_after=5.0) from None


@functools.lru_cache(maxsize=4)
def _read_keys(path: str, mtime_ns: int, size: int) -> tuple[str, ...]:
    with open(path, encoding="utf-8") as f:
        keys = tuple(line.strip() for line in f if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise OSError(f"{path} holds no key")
    return keys


# ---------------------------------------------------------------- errors a client sees


def check_metrics_access(headers: Mapping[str, str], server: Any) -> None:
    """Who may read `/metrics` (raises APIError). With no API key configured (the
    config allows that only on loopback or with `server.allow_insecure`) it is open, as vLLM's is.
    With keys: an admin key (`server.admin_api_keys`); any API key only when the graph sets
    `server.expose_cache_hits`, because the counters (`pdd_wan_bytes_total`, prompt tokens,
    fallbacks) let a tenant who reads them around its own request tell whether its prefix was
    cached: the fact the responses hide from non-admin callers."""
    check_api_key(headers, server)  # 401 without a valid key, when keys are configured
    if not _api_keys(server) or server.expose_cache_hits or is_admin(headers, server):
        return
    raise APIError(403, "permission_error", "/metrics needs one of server.admin_api_keys (its counters reveal "
                       "cache hits); or set server.expose_cache_hits: true to let every API key read it",
                       code="admin_key_required")


def internal_error(e: BaseException, request_id: str) -> APIError:
    """What a client sees of a failure: a request it may fix (a RequestError, whose message is
    written for clients) as a 400; anything else as a generic 500 naming the request id, with the
    detail in the server log only (the caller logs it; exception text can carry paths, addresses,
    peers' messages)."""
    from pdd_serve.engine.sampling import RequestError

    cause = getattr(e, "cause", None) or e  # Ray wraps a replica's exception (its str is a traceback)
    if isinstance(cause, RequestError):
        return APIError(400, "invalid_request_error", str(cause))
    return APIError(500, "server_error", f"The server failed to generate a response (request id {request_id}); "
                    "retry, and quote the id if it persists.", code="internal_error")
