"""The OpenAI-compatible protocol layer, what goes out: detokenization with stop strings, the
`pdd` facts a response may reveal, and the response and stream (SSE) shapes. What comes in
(parsing, auth, errors) is openai_api.py.

Pure functions over token ids, dicts and a tokenizer, unit-testable without Ray or an HTTP server.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdd_serve.serve.openai_api import CompletionRequest

SSE_DONE = b"data: [DONE]\n\n"


# ---------------------------------------------------------------- what a response may reveal

# The `pdd` facts that tell what a cache holds: with them any client could probe, block by block,
# whether another tenant's prompt prefix is cached. wan_bytes is one of them: it is the KV that
# MD lacked. Routing facts (pipeline, handoff, timings) stay.
CACHE_HIT_FIELDS = ("prefix_hit_p", "prefix_hit_md", "wan_bytes")


def pdd_facts(info: Mapping[str, Any], creq: CompletionRequest) -> dict[str, Any]:
    """The response's `pdd` object: cache-hit fields only for a request that may see them
    (`creq.reveal_cache_hits`: the graph's `server.expose_cache_hits`, or an admin key)."""
    if creq.reveal_cache_hits:
        return dict(info)
    return {k: v for k, v in info.items() if k not in CACHE_HIT_FIELDS}


# ---------------------------------------------------------------- detokenization


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, applying string stop sequences.

    Each push decodes a small window (prefix_offset..end) and emits only what the window adds past
    prefix_offset..read_offset, as vLLM/TGI do: byte-level BPE tokens can hold part of a UTF-8
    character, so text is released only once the window no longer ends in U+FFFD, and the prompt
    tail gives SentencePiece-style tokenizers the context their leading-space rules need.
    """

    _CONTEXT = 5  # prompt tokens decoded as context for the first generated token

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids)
        self._read = len(self._ids)
        self._prefix = max(0, self._read - self._CONTEXT)
        self._stop = tuple(s for s in stop if s)
        self._text = ""  # decoded text, truncated before a stop string once one is found
        self._emitted = 0  # chars of _text already returned
        self.stopped = False

    @property
    def text(self) -> str:
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that is now safe to send (maybe "")."""
        if self.stopped:
            return ""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release(final=False)

    def flush(self) -> str:
        """End of generation: release held-back text, incomplete trailing bytes included (as U+FFFD)."""
        if not self.stopped and self._read < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix:self._read])
            new_text = self._decode(self._ids[self._prefix:])
            self._text += new_text[len(prefix_text):]
            self._prefix = self._read = len(self._ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if not self.stopped and self._stop:
            # A new match can only end in text not yet emitted; earliest start wins.
            start = max(0, self._emitted - max(map(len, self._stop)) + 1)
            hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self._text = self._text[:min(hits)]
                self.stopped = True
        end = len(self._text)
        if not self.stopped and not final:
            end -= self._pending_stop_prefix()
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta

    def _pending_stop_prefix(self) -> int:
        """Length of the longest text suffix that could still grow into a stop string."""
        best = 0
        tail = self._text[self._emitted:]
        for s in self._stop:
            # Candidates start where s[0] occurs; the earliest such start is the longest overlap.
            p = tail.find(s[0], max(0, len(tail) - len(s) + 1))
            while p != -1 and len(tail) - p > best:
                if s.startswith(tail[p:]):
                    best = len(tail) - p
                    break
                p = tail.find(s[0], p + 1)
        return best


# ---------------------------------------------------------------- responses


def new_request_id(kind: str) -> str:
    """An OpenAI-looking id: cmpl-<hex> for completions, chatcmpl-<hex> for chat."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _with_extra(obj: dict[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    if extra:
        obj.update(extra)
    return obj


def completion_response(request_id: str, created: int, model: str, kind: str, text: str,
                        finish_reason: str | None, prompt_tokens: int, completion_tokens: int,
                        extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return _with_extra({"id": request_id, "object": obj, "created": created, "model": model,
                        "choices": [choice], "usage": _usage(prompt_tokens, completion_tokens)}, extra)


def completion_chunk(request_id: str, created: int, model: str, kind: str, delta_text: str | None,
                     finish_reason: str | None, extra: Mapping[str, Any] | None = None, first: bool = False,
                     include_usage: bool = False) -> dict[str, Any]:
    """One streamed chunk; delta_text None sends no content (chat) / "" (completion).

    include_usage adds `"usage": null`, which OpenAI puts on every chunk when the client asked for
    stream_options.include_usage (the totals arrive in usage_chunk).
    """
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if delta_text is not None:
            delta["content"] = delta_text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}
    if include_usage:
        out["usage"] = None
    return _with_extra(out, extra)


def usage_chunk(request_id: str, created: int, model: str, kind: str, prompt_tokens: int,
                completion_tokens: int, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The last chunk before [DONE] when stream_options.include_usage: empty choices, totals."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return _with_extra({"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
                        "usage": _usage(prompt_tokens, completion_tokens)}, extra)


def sse(obj: Any) -> bytes:
    # json.dumps escapes newlines inside strings, so one event is always one `data:` line.
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def models_response(model_name: str, created: int) -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "pdd_serve"}]}
