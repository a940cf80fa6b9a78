from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdd_serve import checkpoints
from pdd_serve.checkpoints import ModelSpec, make_model, train_tokenizer
from pdd_serve.cli import main

TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, max_pos=256)
TEXT = "Prefill is compute-bound; decode is bandwidth-bound.\n\n  12345 tokens, naïve café 漢字 🙂\tend"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is PDD?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, arch=arch, **TINY) for arch in checkpoints.ARCHS}


@pytest.mark.parametrize("arch", checkpoints.ARCHS)
def test_our_loader_counts_and_loads_every_weight(tiny: dict[str, Path], arch: str) -> None:
    """`num_params` (which picks meta or real construction) is the module's count, and a small model
    built for real loads the checkpoint's values, not its random init."""
    from safetensors.torch import load_file

    from pdd_serve.engine.model import ModelArgs, load_model

    model = load_model(tiny[arch], "cpu", torch.float32, batch_invariant=False)
    assert ModelArgs.from_checkpoint(tiny[arch]).num_params == sum(p.numel() for p in model.parameters())
    state = load_file(str(tiny[arch] / "model.safetensors"))
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])


@pytest.mark.parametrize("arch", checkpoints.ARCHS)
def test_checkpoint_loads_with_transformers(tiny: dict[str, Path], arch: str) -> None:
    path = tiny[arch]
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert cfg.model_type == arch
    assert cfg.vocab_size == len(tok) == 512  # Qwen2Tokenizer must not add its own unk token
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads) == (2, 64, 2)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert model.dtype == torch.float32
    ids = tok(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()
    info = json.loads((path / checkpoints.SPEC_FILE).read_text())
    assert info["spec"] == asdict(ModelSpec(arch=arch, **TINY))
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_tokenizer_round_trip_same_for_every_arch(tiny: dict[str, Path]) -> None:
    ref = train_tokenizer(512)
    ids = ref(TEXT).input_ids
    assert ids[0] == ref.bos_token_id  # Llama convention: encode() prepends bos
    assert ref.decode(ids, skip_special_tokens=True) == TEXT
    assert ref.decode(ref.encode(TEXT, add_special_tokens=False)) == TEXT
    for path in tiny.values():  # qwen2 loads via Qwen2Tokenizer, which must tokenize identically
        assert AutoTokenizer.from_pretrained(path)(TEXT).input_ids == ids


def test_tokenizer_is_deterministic() -> None:
    first = checkpoints.trained_tokenizer_json(512)
    checkpoints.trained_tokenizer_json.cache_clear()
    assert checkpoints.trained_tokenizer_json(512) == first
    assert len(train_tokenizer(300)) == 300


def test_chat_template(tiny: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|system|>\nBe brief.<|end_of_text|>"
        "<|user|>\nWhat is PDD?<|end_of_text|><|assistant|>\n"
    )
    assert not tok.apply_chat_template(CHAT, tokenize=False).endswith("<|assistant|>\n")
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert ids == tok(text, add_special_tokens=False).input_ids
    assert ids.count(tok.bos_token_id) == 1 and ids.count(tok.eos_token_id) == 2


def test_same_seed_is_bitwise_identical(tmp_path: Path, tiny: dict[str, Path]) -> None:
    again = make_model(tmp_path / "again", **TINY)
    other = make_model(tmp_path / "other", **{**TINY, "seed": 1})
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny["llama"] / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(hidden=60, heads=8), "divisible by heads"),
        (dict(heads=4, kv_heads=3), "divisible by kv_heads"),
        (dict(hidden=24, heads=8, kv_heads=2), "must be even"),
        (dict(layers=0), "layers must be a positive"),
        (dict(arch="gpt2"), "unknown arch"),
        (dict(vocab=299), "vocab must be"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_spec_raises(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelSpec(**{**TINY, **bad})


def test_vocab_beyond_corpus_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shipped corpus supports"):
        make_model(tmp_path / "m", **{**TINY, "vocab": 1_000_000})
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_overwrite_rules(tmp_path: Path) -> None:
    out = make_model(tmp_path / "m", **TINY)
    assert make_model(out, **{**TINY, "seed": 3}) == out  # a checkpoint is replaced
    assert json.loads((out / checkpoints.SPEC_FILE).read_text())["spec"]["seed"] == 3
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        make_model(tmp_path / "precious", **TINY)


def test_default_model_path_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = checkpoints.default_model_path(tmp_path)
    assert path.parent == tmp_path / "models" and path.name == ModelSpec().slug()
    assert checkpoints.is_checkpoint(path)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setenv("PDD_CACHE_DIR", str(tmp_path))
    assert checkpoints.resolve_model("default") == checkpoints.resolve_model("") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert checkpoints.resolve_model(str(path)) == path
    with pytest.raises(FileNotFoundError):
        checkpoints.resolve_model(str(tmp_path / "missing"))


def test_cli_make_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    argv = ["make-model", str(out), "--arch", "qwen2", "--layers", "2", "--hidden", "64", "--heads", "4",
            "--kv-heads", "2", "--intermediate", "128", "--vocab", "512", "--seed", "7"]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert str(out) in stdout and "parameters" in stdout and "KV bytes per token (fp32): 512" in stdout
    assert checkpoints.is_checkpoint(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["make-model", "x", "--heads", "7"], "divisible by heads"),
        (["make-model", "x", "--layers", "two"], "invalid int value"),
        (["make-model", "x", "--arch", "gpt2"], "invalid choice"),
        (["make-model"], "required"),
        (["no-such-command"], "invalid choice"),
    ],
)
def test_cli_bad_args(argv: list[str], match: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-model", "--help"]) == 0
    assert "random" in capsys.readouterr().out
