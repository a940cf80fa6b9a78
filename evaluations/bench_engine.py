"""Engine benchmark: our decode/prefill/extend vs transformers `generate`, side by side in one run.

    python evaluations/bench_engine.py [--model PATH] [--tokens 64] [--repeats 3]

Prints a table, then one JSON line. Ratios are medians over `--repeats` interleaved runs, so a
noisy neighbour slows both sides alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="checkpoint dir, or 'default' for the embedded model")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per decode measurement")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens for decode runs")
    ap.add_argument("--prefill-len", type=int, default=1024, help="prompt tokens for the prefill measurement")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions; medians are reported")
    args = ap.parse_args(argv)
    if args.tokens <= 0 or args.repeats <= 0 or args.prompt_len <= 0:
        ap.error("--tokens, --repeats and --prompt-len must be > 0")

    from transformers import AutoModelForCausalLM

    from pdd_serve.engine.engine import Engine
    from pdd_serve.engine.sampling import SamplingParams
    from pdd_serve.models import resolve_model

    path = resolve_model(args.model)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    eng = Engine.from_pretrained(path, enable_prefix_cache=False)
    vocab, n = eng.args.vocab_size, args.tokens
    g = torch.Generator().manual_seed(0)

    def prompt(length: int) -> list[int]:
        return torch.randint(3, vocab, (length,), generator=g).tolist()

    sp = SamplingParams(n, ignore_eos=True)
    p0 = prompt(args.prompt_len)
    batch = [prompt(args.prompt_len // 2 + 8 * i) for i in range(16)]
    long_prompt = prompt(min(args.prefill_len, eng.args.max_position_embeddings - 1))
    ids = torch.tensor([p0])

    def hf_single() -> None:
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)

    def ours_batch(b: int) -> None:
        eng.generate_batch(batch[:b], sp)

    def prefill() -> None:
        s = eng.add("p", long_prompt, SamplingParams(1))
        eng.prefill(s, use_cache=False)
        eng.release(s)

    def extend_vs_steps() -> tuple[float, float]:
        s = eng.add("e", p0, SamplingParams(2 * n + 2, ignore_eos=True))
        eng.prefill(s, use_cache=False)
        t_steps = _timed(lambda: [eng.decode_step([s]) for _ in range(n)])
        t_ext = _timed(lambda: eng.extend(s, list(s.output_ids[-n:])))
        eng.release(s)
        return t_ext, t_steps

    hf_single(), ours_batch(1), prefill()  # warm-up
    rows: dict[str, list[float]] = {k: [] for k in ("hf", "b1", "b4", "b16", "prefill", "ext", "steps")}
    for _ in range(args.repeats):
        rows["hf"].append(n / _timed(hf_single))
        for b in (1, 4, 16):
            rows[f"b{b}"].append(b * n / _timed(lambda b=b: ours_batch(b)))
        rows["prefill"].append(len(long_prompt) / _timed(prefill))
        e, s = extend_vs_steps()
        rows["ext"].append(e)
        rows["steps"].append(s)
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratio = {
        "single_vs_hf": med["b1"] / med["hf"],
        "batch16_vs_hf": med["b16"] / med["hf"],
        "extend64_vs_64_steps": statistics.median(e / s for e, s in zip(rows["ext"], rows["steps"])),
    }
    print(f"model: {path}  ({eng.args.num_layers} layers, hidden {eng.args.hidden_size}, "
          f"{eng.layout.bytes_per_token} B KV/token, torch threads {torch.get_num_threads()})")
    print(f"{'measurement':<38}{'median':>14}")
    table = [
        ("HF generate, single stream (tok/s)", med["hf"]),
        ("ours decode, batch 1 (tok/s)", med["b1"]),
        ("ours decode, batch 4 (tok/s)", med["b4"]),
        ("ours decode, batch 16 (tok/s)", med["b16"]),
        (f"ours prefill, {len(long_prompt)} tokens (tok/s)", med["prefill"]),
        (f"extend over {n} tokens (s)", med["ext"]),
        (f"{n} single decode steps (s)", med["steps"]),
    ]
    for name, v in table:
        print(f"{name:<38}{v:>14.3f}")
    out = {"model": str(path), "tokens": n, "repeats": args.repeats,
           "hf_tok_s": med["hf"], "b1_tok_s": med["b1"], "b4_tok_s": med["b4"], "b16_tok_s": med["b16"],
           "prefill_tok_s": med["prefill"], **ratio}
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
