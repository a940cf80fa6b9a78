"""Small real Hugging Face checkpoints that the project builds itself (no downloads needed).

A checkpoint is a normal HF directory (config.json, model.safetensors, tokenizer files) that
`AutoModelForCausalLM` / `AutoTokenizer` load offline. Weights are random but fixed by a seed, so
every machine builds bit-identical models; the tokenizer is a real byte-level BPE trained on a
corpus shipped with the package, so text round-trips and chat templates work like a real model's.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay lazy so `pdd --help` and spec validation are instant
    from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2 in every vocab

ARCHS = ("llama", "qwen2")
MIN_VOCAB = 300  # 256 byte tokens + the specials + a few merges
# Weight init std. At HF's 0.02 a random model's logits are nearly flat and greedy decoding falls
# into loops (~5 distinct tokens in 64), which would hide off-by-one bugs in handoff tests; 0.1
# gives ~4x the top1-top2 gap and no loops, and bf16 still agrees with fp32 on ~95% of argmaxes.
DEFAULT_INIT_STD = 0.1
# Bump when the bytes a spec produces change (corpus, tokenizer recipe, init), so caches rebuild.
FORMAT_VERSION = 1
SPEC_FILE = "pdd_model.json"
PRETOKENIZE_REGEX = (  # = transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Turns end with eos, so a generating model stops at the end of its own turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """Everything that determines a checkpoint's bytes; validated on construction."""

    arch: str = "llama"
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 688
    vocab: int = 2048
    max_pos: int = 4096
    seed: int = 0
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    init_std: float = DEFAULT_INIT_STD

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; expected one of {', '.join(ARCHS)}")
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "max_pos"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = hidden / heads = {self.head_dim} must be even (RoPE rotates pairs)")
        if not isinstance(self.vocab, int) or self.vocab < MIN_VOCAB:
            raise ValueError(f"vocab must be an integer >= {MIN_VOCAB} (256 bytes + specials), got {self.vocab!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.init_std > 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V of one token across all layers (fp32 by default, as the checkpoint is)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def slug(self) -> str:
        """Directory name that encodes the whole spec, e.g. llama-L4-H256-A8-KV2-I688-V2048-..."""
        tie = "-tied" if self.tie_embeddings else ""
        return (
            f"{self.arch}-L{self.layers}-H{self.hidden}-A{self.heads}-KV{self.kv_heads}-I{self.intermediate}"
            f"-V{self.vocab}-P{self.max_pos}-rope{self.rope_theta:g}-std{self.init_std:g}{tie}"
            f"-s{self.seed}-v{FORMAT_VERSION}"
        )


def corpus_text() -> str:
    """The shipped tokenizer corpus (stdlib docstrings + a PDD summary, see docs/pdd.md), fixed forever."""
    # next to this file, not `importlib.resources.files("pdd_serve")`: a Ray worker started in a
    # directory holding a checkout named pdd_serve (a launched node's ~/pdd_serve) resolves that
    # name to the checkout's root, a namespace package without assets/
    return (Path(__file__).with_name("assets") / "corpus.txt").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=8)
def trained_tokenizer_json(vocab_size: int) -> str:
    # Cached as JSON, not as an object, so callers can't mutate each other's tokenizer.
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    # Qwen2's recipe (NFC, GPT-4-style split with single digits, then bytes), exactly: transformers
    # loads any qwen2-typed checkpoint through Qwen2Tokenizer, which rebuilds these stages and would
    # silently re-tokenize differently if ours differed.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator([corpus_text()], trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"vocab {vocab_size} is larger than the shipped corpus supports "
            f"(at most {tok.get_vocab_size()} tokens)"
        )
    bos_id = tok.token_to_id(BOS_TOKEN)
    # Llama convention: plain encode() prepends bos; the chat template adds it itself.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok.to_str()


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the shipped corpus; deterministic for a given vocab_size."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be an integer >= {MIN_VOCAB}, got {vocab_size!r}")
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(trained_tokenizer_json(vocab_size)),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # Saved as an explicit null: otherwise Qwen2Tokenizer adds its default "<|endoftext|>" unk
        # on load, growing the vocab past the model's embedding. Byte-level BPE never needs unk.
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # exact round trip of the decoded text
    )


def _hf_config(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_pos,
        rope_parameters={"rope_type": "default", "rope_theta": float(spec.rope_theta)},
        tie_word_embeddings=spec.tie_embeddings,
        initializer_range=spec.init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    if spec.arch == "llama":
        return LlamaConfig(head_dim=spec.head_dim, **common)
    return Qwen2Config(**common)


def _write_checkpoint(spec: ModelSpec, dst: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = train_tokenizer(spec.vocab)
    tokenizer.model_max_length = spec.max_pos
    config = _hf_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(dst, safe_serialization=True)
    tokenizer.save_pretrained(dst)
    info = {
        "format_version": FORMAT_VERSION,
        "spec": asdict(spec),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "kv_bytes_per_token_fp32": spec.kv_bytes_per_token(4),
    }
    # Written last: its presence marks a complete checkpoint.
    (dst / SPEC_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def is_checkpoint(path: str | Path) -> bool:
    """True for a complete checkpoint written by make_model."""
    p = Path(path)
    return (p / SPEC_FILE).is_file() and (p / "model.safetensors").is_file() and (p / "config.json").is_file()


def make_model(
    out_dir: str | Path,
    arch: str = "llama",
    layers: int = 4,
    hidden: int = 256,
    heads: int = 8,
    kv_heads: int = 2,
    intermediate: int = 688,
    vocab: int = 2048,
    max_pos: int = 4096,
    seed: int = 0,
    rope_theta: float = 10000.0,
    tie_embeddings: bool = False,
    init_std: float = DEFAULT_INIT_STD,
) -> Path:
    """Write a random-weight HF checkpoint to out_dir (atomically) and return its path.

    An existing checkpoint written by make_model (or an empty dir) at out_dir is replaced;
    any other existing path raises FileExistsError rather than being clobbered.
    """
    spec = ModelSpec(arch, layers, hidden, heads, kv_heads, intermediate, vocab, max_pos, seed,
                     rope_theta, tie_embeddings, init_std)
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not (out.is_dir() and (is_checkpoint(out) or not any(out.iterdir()))):
        raise FileExistsError(f"{out} exists and is not a pdd checkpoint; refusing to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside out_dir (same filesystem) so the final rename is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_checkpoint(spec, tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace_dir(src: Path, dst: Path) -> None:
    # mkdtemp makes the dir 0700 and safetensors writes 0600; a shared cache must be readable.
    os.chmod(src, 0o755)
    for f in src.iterdir():
        os.chmod(f, 0o644)
    if dst.exists():
        # rename() can't replace a non-empty dir: move the old one aside first, then drop it.
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.rename(dst, old / "ckpt")
        os.rename(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(src, dst)


def cache_dir_default() -> Path:
    return Path(os.environ.get("PDD_CACHE_DIR") or Path.home() / ".cache" / "pdd_serve")


def default_model_path(cache_dir: str | Path | None = None) -> Path:
    """The embedded default model (llama, ModelSpec defaults, seed 0), built on first use.

    Lives at <cache>/models/<spec slug>; cache is $PDD_CACHE_DIR or ~/.cache/pdd_serve.
    Concurrent callers serialize on a file lock, so the model is built once.
    """
    spec = ModelSpec()
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_dir_default()
    path = (root / "models" / spec.slug()).absolute()
    if is_checkpoint(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not is_checkpoint(path):  # another process may have built it while we waited
                make_model(path, **asdict(spec))
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(lock, fcntl.LOCK_UN)
    return path


def resolve_model(path_or_default: str | Path) -> Path:
    """"default" or "" -> the embedded default model; anything else must be an existing path."""
    if str(path_or_default) in ("", "default"):
        return default_model_path()
    path = Path(path_or_default).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist (use 'default' for the embedded model)")
    return path
