"""Llama-family forward pass (Llama, Qwen2) over a paged KV pool, from a local HF checkpoint.

Numerics follow transformers' implementation (fp32 RMSNorm, rotate-half RoPE from the
checkpoint's rope_theta/rope_scaling, SDPA attention with GQA) so that greedy output is
token-identical to `transformers` generate on the same weights.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdd_serve.engine.kv import BlockPool

SUPPORTED_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "llama"}


class CheckpointError(ValueError):
    """A checkpoint directory that can't be served: missing files or an unsupported model."""


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    qkv_bias: bool
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def num_params(self) -> int:
        """Weights in the module (embedding and LM head counted apart, as the module holds them)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = h * (2 * q + 2 * kv) + 3 * h * self.intermediate_size + 2 * h + (q + 2 * kv) * self.qkv_bias
        return 2 * self.vocab_size * h + self.num_layers * layer + h

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ModelArgs:
        path = Path(path)
        cfg_file = path / "config.json"
        if not path.is_dir():
            raise CheckpointError(f"checkpoint directory {path} does not exist")
        if not cfg_file.is_file():
            raise CheckpointError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
        cfg = json.loads(cfg_file.read_text())
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
        if arch is None:
            raise CheckpointError(f"{path}: unsupported architecture {archs or cfg.get('model_type')}; "
                                  f"pdd_serve serves {sorted(SUPPORTED_ARCHS)}")
        if cfg.get("use_sliding_window"):
            raise CheckpointError(f"{path}: sliding-window attention is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        heads = cfg["num_attention_heads"]
        rope_params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
            rope_scaling=scaling,
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies as transformers computes them (default, linear and llama3 scaling)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = args.rope_scaling
    kind = (sc or {}).get("rope_type", (sc or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / sc["factor"]
    if kind == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old_ctx = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        out = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < old_ctx / hi) * ~(wavelen > old_ctx / lo)
        return torch.where(medium, smoothed, out)
    raise CheckpointError(f"unsupported rope_scaling type {kind!r}")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# Batch-invariant numerics (float32 models, `model.batch_invariant`, on by default). A greedy
# token must not depend on what it was computed beside. In float32 it did: CPU GEMMs pick their
# kernel by the number of rows (a vector kernel for one row, blocked ones for more, other blockings
# past ~16), and vectorised silu/exp/cos take a scalar tail path depending on where a row sits in
# the tensor, so one sequence's logits moved by 0.6-1.1e-5 between a decode batch of one and of two
# (measured), and a greedy choice whose top-2 margin was below that flipped: the soak saw 1 stream
# in ~400 differ from one engine's generate after a recompute under load. Every op whose float32
# result depends on the kernel (matmuls, attention, norms, silu, RoPE's cos/sin) runs in float64
# and rounds to float32 once: float64's error (~1e-16) is far below a float32 rounding step, so a
# prefill chunk, a decode batch of any size and a migration's recompute give the same bits. Exact
# IEEE ops (add, mul) stay float32. Costs ~2x on a CPU prefill of this small model.


def _linear(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`m(x)`, or in float64 (x already float64) with the weights' float64 copies (`make_exact`)."""
    w64 = m.__dict__.get("w64")
    return m(x) if w64 is None else F.linear(x, w64, m.__dict__.get("b64"))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.exact = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:  # batch-invariant: the row's reduction in float64, rounded once
            return F.rms_norm(x.double(), self.weight.shape, self.weight.double(), self.eps).to(x.dtype)
        if x.dtype == torch.float32:  # one fused kernel, bit-identical to the steps below in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype  # half precision: normalise in fp32, round, then scale (transformers' order)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# Decode batches are split into groups whose contexts are within this factor of each other, and
# each group attends over its own longest context only: a short request batched with long ones
# pays for at most GROUP_GROWTH x its own tokens, not the batch's longest. Measured on the default
# model (8 x 128 + 8 x 1024 tokens, `evaluations/bench/engine.py`): one dense group paid for the
# padding; one group per sequence paid Python per group per layer; 2x groups were the best of both.
GROUP_GROWTH = 2.0


@dataclass(frozen=True)
class AttnGroup:
    """Rows of the batch that attend together: `rows` [b] (None = every row, in order),
    `tables` [b, nb] block tables cut to the group's longest context, `mask` [b, 1, Tq, nb*bs]."""

    rows: torch.Tensor | None
    tables: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class AttnContext:
    """Where a forward pass reads and writes KV.

    `slot_blocks`/`slot_offsets` [N]: pool position of each new token's KV.
    `gather_tables` [B, nb]: each sequence's block table (padded with any valid id);
    `mask` [B, 1, Tq, nb*block_size] boolean (True = attend). Queries are [B, Tq].
    """

    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    gather_tables: torch.Tensor
    mask: torch.Tensor | None
    _groups: list[AttnGroup] | None = None

    def groups(self, block_size: int) -> list[AttnGroup]:
        """The batch split by context length (computed once per forward, shared by every layer).

        A row's context is read off its mask: up to the last key any of its queries may see.
        Only key columns no query of the row may see are cut, so every group's attention equals
        the dense one's.
        """
        if self._groups is not None:
            return self._groups
        b, nb = self.gather_tables.shape
        if b == 1 or self.mask is None:
            self._groups = [AttnGroup(None, self.gather_tables, self.mask)]
            return self._groups
        seen = self.mask.any(dim=2)[:, 0]  # [B, K]: a key any query of the row attends
        last = seen.shape[1] - seen.flip(-1).int().argmax(-1)  # one past the last seen key
        need = ((last + block_size - 1) // block_size).clamp(min=1).tolist()
        order = sorted(range(b), key=need.__getitem__)
        groups, start = [], 0
        while start < b:
            cap = need[order[start]] * GROUP_GROWTH
            end = start + 1
            while end < b and need[order[end]] <= cap:
                end += 1
            rows = order[start:end]
            n = need[rows[-1]]
            if len(rows) == b and n == nb:  # one group over everything: no copies
                groups.append(AttnGroup(None, self.gather_tables, self.mask))
            else:
                idx = torch.tensor(rows, dtype=torch.long, device=self.gather_tables.device)
                groups.append(AttnGroup(idx, self.gather_tables[idx, :n], self.mask[idx, ..., : n * block_size]))
            start = end
        self._groups = groups
        return groups


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.nh, self.nkv, self.hd = args.num_heads, args.num_kv_heads, d
        self.q_proj = nn.Linear(h, self.nh * d, bias=args.qkv_bias)
        self.k_proj = nn.Linear(h, self.nkv * d, bias=args.qkv_bias)
        self.v_proj = nn.Linear(h, self.nkv * d, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.nh * d, h, bias=False)
        self.exact = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_kv: tuple[torch.Tensor, torch.Tensor],
                ctx: AttnContext) -> torch.Tensor:
        b, t, _ = x.shape
        dtype = x.dtype
        if self.exact:  # batch-invariant: projections, RoPE and attention in float64 (cos/sin are)
            x = x.double()
        q = _linear(self.q_proj, x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = _linear(self.k_proj, x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = _linear(self.v_proj, x).view(b, t, self.nkv, self.hd)
        q = q * cos + rotate_half(q) * sin
        k = (k * cos + rotate_half(k) * sin).transpose(1, 2)
        # write the new tokens' KV into the pool, then attend over each sequence's whole context
        k_pool, v_pool = layer_kv
        k_pool[ctx.slot_blocks, ctx.slot_offsets] = k.reshape(-1, self.nkv, self.hd).to(k_pool.dtype)
        v_pool[ctx.slot_blocks, ctx.slot_offsets] = v.reshape(-1, self.nkv, self.hd).to(v_pool.dtype)
        bs = k_pool.shape[1]
        groups = ctx.groups(bs)
        out = None if groups[0].rows is None else q.new_empty(q.shape)
        for g in groups:  # each group reads only its own rows' context (see AttnContext.groups)
            gb, nb = g.tables.shape
            flat = g.tables.reshape(-1)  # index_select: ~3x faster than advanced indexing on CPU
            keys = k_pool.index_select(0, flat).view(gb, nb * bs, self.nkv, self.hd).transpose(1, 2).to(q.dtype)
            vals = v_pool.index_select(0, flat).view(gb, nb * bs, self.nkv, self.hd).transpose(1, 2).to(q.dtype)
            qg = q if g.rows is None else q[g.rows]
            if t == 1 and self.nkv != self.nh:
                # decode: the query heads sharing a KV head become that head's query rows, so SDPA
                # runs nkv heads of nh/nkv queries, not nh heads of one (1.3-2x faster on CPU here)
                o = F.scaled_dot_product_attention(qg.reshape(gb, self.nkv, self.nh // self.nkv, self.hd), keys, vals,
                                                   attn_mask=g.mask).view(gb, self.nh, 1, self.hd)
            else:
                o = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=g.mask, enable_gqa=self.nkv != self.nh)
            if g.rows is None:
                out = o
            else:
                out[g.rows] = o
        return _linear(self.o_proj, out.transpose(1, 2).reshape(b, t, self.nh * self.hd)).to(dtype)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.exact = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:  # batch-invariant: the whole MLP in float64 (silu's tail path included)
            xd = x.double()
            return _linear(self.down_proj, F.silu(_linear(self.gate_proj, xd)) * _linear(self.up_proj, xd)).to(x.dtype)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, layer_kv, ctx):  # noqa: ANN001 - hot path, types as in Attention
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer_kv, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Parameter names match the HF checkpoint (`model.layers.N.self_attn.q_proj.weight`, ...)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.model.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    @property
    def exact(self) -> bool:
        return self.model.norm.exact

    def make_exact(self, on: bool = True) -> None:
        """Batch-invariant numerics (see `_linear`'s block comment): float64 copies of every
        projection's weights, and the float64 paths on. Only for float32 models."""
        on = on and self.model.embed_tokens.weight.dtype == torch.float32
        for m in self.modules():
            if isinstance(m, nn.Linear):
                for name, p in (("w64", m.weight), ("b64", m.bias)):
                    if on and p is not None:
                        m.__dict__[name] = p.detach().double()
                    else:
                        m.__dict__.pop(name, None)
            elif isinstance(m, (RMSNorm, Attention, MLP)):
                m.exact = on

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.exact:  # batch-invariant: cos/sin in float64, kept so (the attention runs in it)
            freqs = positions.double()[..., None] * self.inv_freq.double()
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos()[:, None], emb.sin()[:, None]
        freqs = positions.float()[..., None] * self.inv_freq.float()  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, hd]

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, pool: BlockPool,
                ctx: AttnContext) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, pool.layer_kv(i), ctx)
        return x

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, pool: BlockPool, ctx: AttnContext,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids/positions [B, T] -> logits [B, V] of the positions in `logits_index` ([B], default last).
        Writes the new tokens' KV into the pool as a side effect."""
        x = self._hidden(input_ids, positions, pool, ctx)
        x = x[:, -1] if logits_index is None else x[torch.arange(x.shape[0], device=x.device), logits_index]
        h = self.model.norm(x)
        return (_linear(self.lm_head, h.double()) if self.exact else self.lm_head(h)).float()

    @torch.inference_mode()
    def fill_kv(self, input_ids: torch.Tensor, positions: torch.Tensor, pool: BlockPool, ctx: AttnContext) -> None:
        """Only write the tokens' KV (a prefill chunk, a catch-up handoff batch): no logits."""
        self._hidden(input_ids, positions, pool, ctx)


META_INIT_PARAMS = 200_000_000  # above this, building on the meta device beats initializing for real


def load_model(path: str | Path, device: str, dtype: torch.dtype, batch_invariant: bool = True) -> LlamaModel:
    """Build the module from config.json and load model*.safetensors (sharded or single).
    `batch_invariant`: float64 where float32 kernels differ by batch (float32 models only)."""
    from safetensors.torch import load_file

    path = Path(path)
    args = ModelArgs.from_checkpoint(path)
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no model*.safetensors weights (pytorch .bin checkpoints are not supported)")
    # On the meta device no memory is spent initializing weights the checkpoint overwrites, but its
    # first use costs ~2 s (torch's Python decompositions of the init ops): a small model is built
    # for real in a fraction of that, which every replica's start (and scale-up) pays
    with torch.device("meta") if args.num_params > META_INIT_PARAMS else contextlib.nullcontext():
        model = LlamaModel(args)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f), device="cpu"))
    if args.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = {k for k in model.state_dict()}
    missing = expected - set(state)
    if missing:
        raise CheckpointError(f"{path}: weights missing from the checkpoint: {sorted(missing)[:5]}...")
    state = {k: v.to(dtype) for k, v in state.items() if k in expected}
    model.load_state_dict(state, assign=True)
    model.inv_freq = rope_inv_freq(args)
    model = model.to(device).eval()
    model.make_exact(batch_invariant)
    return model
