"""The engine against transformers (the oracle) and against itself across every code path."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdd_serve.engine.engine import Engine
from pdd_serve.engine.kv import KVError
from pdd_serve.engine.model import CheckpointError
from pdd_serve.engine.sampling import MIN_TEMPERATURE, RequestError, SamplingParams, sample
from tests.helpers import make_prompt


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, pad_token_id=hf.config.eos_token_id)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("which", ["model_dir", "qwen_dir"])
def test_greedy_matches_transformers_with_and_without_prefix_hit(which, request):
    path = request.getfixturevalue(which)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    eng = Engine.from_pretrained(path, block_size=16)
    for n, seed in [(1, 0), (7, 1), (16, 2), (33, 3), (130, 4)]:
        prompt = make_prompt(n, seed)
        ref = _hf_greedy(hf, prompt, 24)
        assert eng.generate(prompt, 24) == ref, f"cold, prompt length {n}"
        # the same prompt again is served from the prefix cache (all but the last block)
        hits_before = eng.cache.stats.hit_tokens
        assert eng.generate(prompt, 24) == ref, f"prefix hit, prompt length {n}"
        assert n < 17 or eng.cache.stats.hit_tokens > hits_before
    # a longer prompt sharing a cached prefix computes only its suffix and still matches
    base = make_prompt(130, 4)
    longer = base + make_prompt(20, 9)
    assert eng.generate(longer, 16) == _hf_greedy(hf, longer, 16)


def test_extend_then_decode_equals_plain_decode(model_dir):
    eng = Engine.from_pretrained(model_dir, block_size=16)
    prompt = make_prompt(40, 5)
    ref = eng.generate(prompt, 40, use_cache=False)
    for k in (1, 5, 16, 23):
        seq = eng.add("x", prompt, SamplingParams(40))
        eng.prefill(seq, use_cache=False)
        # the first output token came from prefill; hand the next k-1 reference tokens over at once
        assert seq.output_ids == ref[:1]
        nxt = eng.extend(seq, ref[1:k])
        assert nxt == ref[k]
        while not seq.finished:
            eng.decode_step([seq])
        assert seq.output_ids == ref
        eng.release(seq)


def test_chunked_prefill_and_catchup_batches_equal_generate(model_dir):
    eng = Engine.from_pretrained(model_dir, block_size=16)
    prompt = make_prompt(150, 12)
    ref = eng.generate(prompt, 30, use_cache=False)
    seen: list[int] = []
    s = eng.add("c", prompt, SamplingParams(30))
    eng.prefill(s, use_cache=False, chunk_tokens=40, on_chunk=lambda q: seen.append(q.num_computed))
    assert seen == [40, 80, 120, 150]
    # catch-up handoff: KV-only batches of committed tokens, then a final sampling extend
    assert eng.extend(s, ref[1:9], sample=False) is None
    assert eng.extend(s, ref[9:15], sample=False) is None
    assert eng.extend(s, ref[15:20]) == ref[20]
    while not s.finished:
        eng.decode_step([s])
    assert s.output_ids == ref


def test_batched_decode_equals_each_alone(model_dir):
    eng = Engine.from_pretrained(model_dir, block_size=16, enable_prefix_cache=False)
    prompts = [make_prompt(n, 10 + n) for n in (3, 17, 31, 64, 100, 5)]
    params = [SamplingParams(m, ignore_eos=True) for m in (12, 30, 7, 25, 18, 40)]
    alone = [eng.generate_batch([p], sp)[0] for p, sp in zip(prompts, params)]
    together = eng.generate_batch(prompts, params)
    assert together == alone
    assert [len(o) for o in together] == [12, 30, 7, 25, 18, 40]
    assert eng.pool.num_free == eng.pool.num_blocks


def test_requests_join_and_leave_between_steps(model_dir):
    eng = Engine.from_pretrained(model_dir, block_size=8, enable_prefix_cache=False)
    pa, pb = make_prompt(20, 1), make_prompt(9, 2)
    ref_a, ref_b = eng.generate(pa, 20), eng.generate(pb, 10)
    a = eng.add("a", pa, SamplingParams(20))
    eng.prefill(a)
    for _ in range(5):
        eng.decode_step([a])
    b = eng.add("b", pb, SamplingParams(10))
    eng.prefill(b)
    while not (a.finished and b.finished):
        eng.decode_step([s for s in (a, b) if not s.finished])
    assert a.output_ids == ref_a and b.output_ids == ref_b


def test_kv_moves_between_engines_and_handoff_by_token_ids(model_dir):
    """P computes the prompt, a relay decodes a few tokens from the imported KV, MD gets only the
    prompt KV plus the relay's token ids, extends, and finishes: the output equals generate."""
    p, rld, md = (Engine.from_pretrained(model_dir, block_size=16) for _ in range(3))
    prompt = make_prompt(75, 7)
    ref = p.generate(prompt, 30, use_cache=False)
    sp = SamplingParams(30)

    s_p = p.add("r", prompt, sp)
    first = p.prefill(s_p)
    kv = p.export_kv(s_p)
    assert kv.num_tokens == 75 and kv.num_blocks == 5

    s_r = rld.add("r", prompt, sp)
    rld.import_kv(s_r, kv)
    rld.append_tokens(s_r, [first])
    for _ in range(6):
        rld.decode_step([s_r])
    committed = s_r.output_ids
    rld.release(s_r)

    s_md = md.add("r", prompt, sp)
    md.import_kv(s_md, kv)
    md.extend(s_md, committed)
    while not s_md.finished:
        md.decode_step([s_md])
    assert s_md.output_ids == ref


def test_md_imports_only_blocks_its_drc_lacks(model_dir):
    p, md = Engine.from_pretrained(model_dir), Engine.from_pretrained(model_dir)
    turn1 = make_prompt(50, 3)
    md.generate(turn1, 4)  # MD's DRC now holds turn 1's full blocks
    turn2 = turn1 + make_prompt(40, 4)
    ref = p.generate(turn2, 12, use_cache=False)
    s_p = p.add("t2", turn2, SamplingParams(12))
    first = p.prefill(s_p)
    s_md = md.add("t2", turn2, SamplingParams(12))
    hit = md.match_prefix(s_md)
    assert hit == 48
    md.import_kv(s_md, p.export_kv(s_p, start_block=hit // 16))
    md.extend(s_md, [first])
    while not s_md.finished:
        md.decode_step([s_md])
    assert s_md.output_ids == ref


def test_import_rejects_kv_of_other_tokens(model_dir):
    a, b = Engine.from_pretrained(model_dir), Engine.from_pretrained(model_dir)
    s = a.add("x", make_prompt(32, 1), SamplingParams(4))
    a.prefill(s)
    other = b.add("y", make_prompt(32, 2), SamplingParams(4))
    with pytest.raises(KVError, match="do not belong"):
        b.import_kv(other, a.export_kv(s))
    kv = a.export_kv(s)
    kv.data[0, 0, 0, 0, 0, 0] += 1.0
    mine = b.add("x", make_prompt(32, 1), SamplingParams(4))
    with pytest.raises(KVError, match="checksum"):
        b.import_kv(mine, kv)
    assert mine.num_computed == 0


def test_seeded_sampling_is_reproducible_and_survives_a_handoff(model_dir):
    eng = Engine.from_pretrained(model_dir)
    prompt = make_prompt(20, 8)
    kw = dict(temperature=1.3, top_p=0.9, top_k=50)
    a = eng.generate(prompt, 30, seed=123, **kw)
    assert eng.generate(prompt, 30, seed=123, **kw) == a
    assert eng.generate(prompt, 30, seed=124, **kw) != a
    # sampling depends only on (seed, output index): decoding 10 tokens, then extending over them
    # in another engine, continues the same sample
    other = Engine.from_pretrained(model_dir)
    sp = SamplingParams(30, seed=123, **kw)
    s = other.add("x", prompt, sp)
    other.prefill(s, use_cache=False)
    other.extend(s, a[1:10])
    while not s.finished:
        other.decode_step([s])
    assert s.output_ids == a


def test_stop_tokens_and_max_tokens(model_dir):
    eng = Engine.from_pretrained(model_dir)
    prompt = make_prompt(10, 11)
    out = eng.generate(prompt, 20)
    stop = out[5]
    cut = eng.generate(prompt, 20, stop_token_ids=[stop])
    assert cut == out[: out.index(stop) + 1]
    assert len(eng.generate(prompt, 3)) == 3


@pytest.mark.parametrize("bad, match", [
    (dict(prompt=[]), "empty"),
    (dict(prompt=[5, 512]), "outside the vocabulary"),
    (dict(prompt=[5, -1]), "outside the vocabulary"),
    (dict(max_tokens=600), "context"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
])
def test_bad_requests_raise_typed_errors(model_dir, bad, match):
    eng = Engine.from_pretrained(model_dir)
    kw = dict(prompt=[5, 6, 7], max_tokens=4, temperature=0.0, top_p=1.0) | bad
    with pytest.raises(RequestError, match=match):
        eng.generate(kw.pop("prompt"), **kw)
    assert eng.pool.num_free + (eng.cache.num_blocks if eng.cache else 0) == eng.pool.num_blocks


def test_bad_checkpoints_raise_clear_errors(model_dir, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        Engine.from_pretrained(empty)
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    shutil.copy(model_dir / "config.json", noweights / "config.json")
    with pytest.raises(CheckpointError, match="safetensors"):
        Engine.from_pretrained(noweights)
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(model_dir, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (gpt2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        Engine.from_pretrained(gpt2)


def test_sampling_is_total_over_accepted_temperatures(model_dir):
    """1e-40 used to give NaN probabilities and a multinomial crash (retried as a prefill fault).
    Below MIN_TEMPERATURE sampling is greedy; above it, float64 keeps softmax finite."""
    eng = Engine.from_pretrained(model_dir)
    prompt = make_prompt(20, 11)
    greedy = eng.generate(prompt, 16)
    for t in (1e-40, 5e-324, 1e-6, 1e-4):  # 1e-4 samples, but from a distribution that is one-hot
        assert eng.generate(prompt, 16, temperature=t, seed=3) == greedy, t
        assert eng.generate(prompt, 16, temperature=t, top_p=0.5, top_k=7) == greedy, t
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 512, generator=g) * 40  # wide logits: float32 softmax at T=1e-4 overflowed
    for t in (1e-30, MIN_TEMPERATURE, 1e-3, 0.7, 2.0):
        for p in (SamplingParams(temperature=t), SamplingParams(temperature=t, top_p=0.3, top_k=5, seed=1)):
            toks = sample(logits, [p] * 3, [0, 1, 2])
            assert all(0 <= x < 512 for x in toks)
            if t <= 1e-3:
                assert toks == logits.argmax(-1).tolist()


def test_a_sampling_fault_is_a_request_error_not_a_retryable_one():
    bad = torch.zeros(1, 8)
    bad[0, 3] = float("nan")
    with pytest.raises(RequestError, match="non-finite logits"):
        sample(bad, [SamplingParams(temperature=0.8, seed=1)], [0])
    bad[0, 3] = float("inf")
    with pytest.raises(RequestError, match="non-finite logits"):
        sample(bad, [SamplingParams(temperature=0.8, seed=1)], [0])
    masked = torch.zeros(1, 8)
    masked[0, :5] = float("-inf")  # masked-out tokens are fine: only the rest can be drawn
    assert sample(masked, [SamplingParams(temperature=0.8, seed=1)], [0])[0] >= 5
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature="0.5")  # type: ignore[arg-type]


# ---------------------------------------------------------------- batch invariance (the master invariant's numerics)


def _logits_of(engine: Engine) -> list[torch.Tensor]:
    """Record every forward's logits (the engine's model, wrapped on the instance)."""
    seen: list[torch.Tensor] = []
    forward = engine.model.forward

    def capture(*a, **k):
        out = forward(*a, **k)
        seen.append(out.detach().clone())
        return out

    engine.model.forward = capture
    return seen


def test_a_tokens_logits_do_not_depend_on_its_batch_or_its_prefill_chunks(model_dir) -> None:
    """float32 kernels differ by batch size (a vector kernel for one row, blocked ones for more) and
    vectorised silu/exp take a tail path by position: a sequence's logits moved ~1e-5 between a
    decode batch of one and of two, enough to flip a near-tie greedy choice (the soak saw it). With
    batch_invariant (the default) they are the same bits alone, beside a longer sequence, beside
    many, and the KV a chunked prefill, a whole prefill and decode steps write is the same bits."""
    torch.manual_seed(0)
    e = Engine.from_pretrained(model_dir)
    assert e.model.exact
    logits = _logits_of(e)
    prompt = torch.randint(3, 500, (150,)).tolist()
    longer = torch.randint(3, 500, (300,)).tolist()

    def last_logits(batch_with: list[list[int]]) -> torch.Tensor:
        seqs = [e.add(f"s{i}", p, SamplingParams(4, ignore_eos=True)) for i, p in enumerate([prompt] + batch_with)]
        for s in seqs:
            e.prefill(s, use_cache=False)
        logits.clear()
        e.decode_step(seqs)
        out = logits[-1][0].clone()
        for s in seqs:
            e.release(s, cache=False)
        return out

    alone = last_logits([])
    assert torch.equal(alone, last_logits([longer]))  # another attention group, a 2-row GEMM
    assert torch.equal(alone, last_logits([longer, prompt[:40], longer[:200]] * 6))  # 19 rows: another blocking

    # the KV of prompt + 20 decoded tokens: decode steps vs one prefill (a migration's recompute) vs chunks
    def kv_after(prefill_tokens: list[int], chunk: int | None, decode: int) -> torch.Tensor:
        s = e.add("kv", prefill_tokens, SamplingParams(decode + 1, ignore_eos=True))
        e.prefill(s, use_cache=False, chunk_tokens=chunk)
        for _ in range(decode):
            e.decode_step([s])
        kv = e.export_kv(s, 0, len(s.token_ids) // e.block_size)
        toks = list(s.token_ids)
        e.release(s, cache=False)
        return kv, toks

    kv_dec, toks = kv_after(prompt, None, 20)
    n = len(toks) // e.block_size * e.block_size
    kv_one, _ = kv_after(toks[:n], None, 0)
    kv_chunks, _ = kv_after(toks[:n], 48, 0)
    for other in (kv_one, kv_chunks):
        assert other.data.shape == kv_dec.data.shape and (other.data == kv_dec.data).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_major_kv_round_trips_through_blocks(dtype):
    """How an engine with its own cache layout (vLLM) exports: token-major KV cut into PDD's blocks
    (a partial last block zero-padded) and back, bit for bit, in the layout our pool exports."""
    from pdd_serve.engine.kv import KVLayout, blocks_to_tokens, tokens_to_blocks

    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    kv = torch.randn(10, 3, 2, 2, 8).to(layout.torch_dtype)
    blocks = tokens_to_blocks(layout, kv, [11, 12, 0], start_block=0, num_tokens=10)
    assert blocks.num_blocks == 3 and blocks.num_tokens == 10
    back = blocks_to_tokens(blocks)
    assert torch.equal(back, kv)
    # block b, layer l, K/V i, slot t is token b*4+t's [l, i]: our pool's block_shape order
    data = torch.from_numpy(blocks.data)
    if dtype == "bfloat16":
        data = data.view(torch.bfloat16)
    assert torch.equal(data[1, 2, 1, 3], kv[7, 2, 1])
    assert not data[2, :, :, 2:].any()  # the partial block's empty slots
    assert torch.equal(blocks_to_tokens(blocks.slice(1, 3)), kv[4:])
    with pytest.raises(KVError):
        tokens_to_blocks(layout, kv, [11, 12], start_block=0, num_tokens=10)  # 10 tokens in 2 blocks of 4


def test_a_failed_engine_fails_its_replica_health_check(model_dir):
    from pdd_serve.serve.common import check_engine

    eng = Engine.from_pretrained(model_dir)
    check_engine(eng)  # healthy: no error
    eng.failed = "RuntimeError: boom"
    with pytest.raises(RuntimeError, match="engine failed: RuntimeError: boom"):
        check_engine(eng)
