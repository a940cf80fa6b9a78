"""Sampling parameters and the token math that turns logits into the next token."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the Router uses the parameters and errors, never the math: it imports no torch
    import torch


class RequestError(ValueError):
    """A request the engine refuses: bad prompt, parameters out of range, too long for the model.
    Deterministic: the same request fails the same way anywhere, so it is never retried."""


def check_prompt_ids(prompt_token_ids: list[int], vocab: int) -> None:
    """A prompt both engine backends refuse before they hold any state for it."""
    if not prompt_token_ids:
        raise RequestError("the prompt is empty: send at least one token")
    bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")


# Below this temperature sampling is greedy, as in vLLM (_SAMPLING_EPS): logits / T overflows
# long before T reaches 0 (1e-40 gave inf, NaN probabilities and a multinomial crash), and the
# distribution it tends to is the argmax anyway. Above it, float64 keeps softmax exact.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0 (below {MIN_TEMPERATURE:g}: greedy), "
                               f"got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def step_seed(seed: int, step: int) -> int:
    """The RNG seed for output token `step` of a seeded request.

    Deriving it from (seed, step) instead of carrying a generator's state is what lets a
    request move between Relay and Main decode and keep sampling the same tokens."""
    return (seed * 1_000_003 + step * 7_919 + 0x9E3779B9) % (2**63 - 1)


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """Next token per row of `logits` [B, V]; `steps[i]` is the output index being sampled."""
    greedy = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, p in enumerate(params):
        out.append(greedy[i] if p.greedy else _sample_row(logits[i], p, steps[i]))
    return out


def _sample_row(logits: torch.Tensor, p: SamplingParams, step: int) -> int:
    import torch  # only where sampling runs (cached after the first call)

    logits = logits.double() / p.temperature  # float64 over T >= MIN_TEMPERATURE: finite, exact softmax
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # subtracts the max: the top token's weight is exactly 1
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < p.top_p  # always keeps the top token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    if not torch.isfinite(probs).all() or not probs.sum() > 0:  # NaN/+inf logits: the model's fault on
        # this input, not the host's; it would fail the same way on any replica, so no retry
        raise RequestError("the model produced non-finite logits for this request (check the checkpoint "
                           "and dtype)")
    gen = None
    if p.seed is not None:
        gen = torch.Generator(device="cpu").manual_seed(step_seed(p.seed, step))
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
