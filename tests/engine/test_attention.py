"""Decode attention grouped by context length: exact, and each row reads only about its own context."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdd_serve.engine import model as model_mod
from pdd_serve.engine.engine import Engine
from pdd_serve.engine.model import AttnContext
from pdd_serve.engine.sampling import SamplingParams
from tests.helpers import make_prompt


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=hf.config.eos_token_id)
    return out[0, len(prompt):].tolist()


def _decode_ctx(lengths: list[int], block_size: int, nb: int) -> AttnContext:
    """What Engine.decode_step builds for sequences with these context lengths (tables padded to nb)."""
    pos = torch.tensor(lengths) - 1
    tables = torch.arange(len(lengths) * nb).view(len(lengths), nb)
    return AttnContext(slot_blocks=tables[torch.arange(len(lengths)), pos // block_size], slot_offsets=pos % block_size,
                       gather_tables=tables, mask=(torch.arange(nb * block_size)[None, :] <= pos[:, None])[:, None, None, :])


def test_groups_cover_every_row_once_and_cut_only_unseen_keys():
    bs, lengths = 16, [5, 400, 17, 130, 33, 260, 16, 1]
    ctx = _decode_ctx(lengths, bs, nb=25)
    groups = ctx.groups(bs)
    rows = torch.cat([g.rows for g in groups]).tolist()
    assert sorted(rows) == list(range(len(lengths)))
    assert len(groups) > 1
    for g in groups:
        need = [-(-lengths[r] // bs) for r in g.rows.tolist()]
        assert g.tables.shape == (len(need), max(need))  # cut to the group's longest row, not the batch's
        assert max(need) <= model_mod.GROUP_GROWTH * min(need)  # a row pays at most GROUP_GROWTH x its blocks
        assert torch.equal(g.tables, ctx.gather_tables[g.rows, : max(need)])
        assert torch.equal(g.mask, ctx.mask[g.rows, ..., : max(need) * bs])
        # every key a row attends to is kept: the cut columns were masked for all its queries
        assert not ctx.mask[g.rows, ..., max(need) * bs :].any()
    assert ctx.groups(bs) is groups  # computed once per forward, shared by the layers


def test_uniform_batch_is_one_group_without_copies():
    ctx = _decode_ctx([100, 110, 97, 128], 16, nb=8)
    (g,) = ctx.groups(16)
    assert g.rows is None and g.tables is ctx.gather_tables and g.mask is ctx.mask


@pytest.mark.parametrize("which", ["model_dir", "qwen_dir"])
def test_mixed_length_batch_matches_transformers(which, request):
    """Short and long requests decoded in one batch (several length groups) give exactly the tokens
    transformers' greedy generate gives each of them alone."""
    path = request.getfixturevalue(which)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    eng = Engine.from_pretrained(path, block_size=16, enable_prefix_cache=False)
    lengths = [3, 300, 17, 129, 40, 250, 9, 64]
    prompts = [make_prompt(n, 50 + i) for i, n in enumerate(lengths)]
    sp = SamplingParams(20, ignore_eos=True)
    seqs = [eng.add(f"m{i}", p, sp) for i, p in enumerate(prompts)]
    for s in seqs:
        eng.prefill(s, use_cache=False)
    while not all(s.finished for s in seqs):
        eng.decode_step([s for s in seqs if not s.finished])
    assert [s.output_ids for s in seqs] == [_hf_greedy(hf, p, 20) for p in prompts]
    for s in seqs:
        eng.release(s)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_grouping_changes_no_token(model_dir, monkeypatch):
    """The same mixed batch with one dense group (every row padded to the longest) and with groups."""
    eng = Engine.from_pretrained(model_dir, block_size=8, enable_prefix_cache=False)
    prompts = [make_prompt(n, 7 + n) for n in (2, 90, 31, 200, 5, 150)]
    params = [SamplingParams(m, ignore_eos=True) for m in (25, 12, 30, 8, 18, 22)]
    grouped = eng.generate_batch(prompts, params)
    monkeypatch.setattr(model_mod, "GROUP_GROWTH", float("inf"))
    assert eng.generate_batch(prompts, params) == grouped
