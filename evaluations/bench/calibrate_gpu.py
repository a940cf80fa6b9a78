"""Check the cost model against a real GPU: time prefill and decode steps of a model shape from the
catalog (random weights, bf16) and print measured vs roofline, with the efficiency each implies.

    python -m evaluations.bench.calibrate_gpu --model llama-3-8b --chip h200

Needs CUDA and `transformers`. Prefill is transformers' Llama (SDPA attention), one request per
forward. Decode is measured two ways: transformers' eager step over its dynamic KV cache (no CUDA
graphs: launch-bound, and the cache grows by concatenation), and a bare decode step that does what a
serving engine's does (every layer's GEMMs and SDPA attention over a preallocated KV of the given
context, plus the LM head) captured in one CUDA graph, as vLLM runs decode. The roofline is judged
against the second; the first shows what an engine without graphs pays. Ends with one JSON line.
Timings: CUDA events around each step, after warm-up, median of repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from pdd_serve.emulation import costmodel


def _llama(shape: costmodel.ModelShape, max_pos: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                      max_position_embeddings=max_pos, attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return model.eval()


def _graph_decode(shape: costmodel.ModelShape, batch: int, ctx: int, vocab: int = 128256):
    """One decode step of `batch` sequences at `ctx` tokens of context, as one CUDA graph."""
    import torch
    import torch.nn.functional as F

    L, h, H, KV, d, inter = shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
    bf = dict(device="cuda", dtype=torch.bfloat16)
    w = [(torch.randn(h, (H + 2 * KV) * d, **bf) * 0.02, torch.randn(H * d, h, **bf) * 0.02,
          torch.randn(h, 2 * inter, **bf) * 0.02, torch.randn(inter, h, **bf) * 0.02) for _ in range(L)]
    lm = torch.randn(h, vocab, **bf) * 0.02
    k = torch.randn(L, batch, KV, ctx, d, **bf)
    v = torch.randn(L, batch, KV, ctx, d, **bf)
    x = torch.randn(batch, h, **bf)

    def step() -> torch.Tensor:
        y = x
        for li, (wqkv, wo, w13, w2) in enumerate(w):
            q = (y @ wqkv)[:, : H * d].view(batch, H, 1, d)
            o = F.scaled_dot_product_attention(q, k[li], v[li], enable_gqa=True)
            y = y + o.reshape(batch, H * d) @ wo
            g = y @ w13
            y = y + (F.silu(g[:, :inter]) * g[:, inter:]) @ w2
        return (y @ lm).argmax(-1)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g, (w, lm, k, v, x)


def _time(fn, repeats: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3-8b", help="a model shape of pdd_serve/emulation/costmodel.yaml")
    ap.add_argument("--chip", default="h200", help="the catalog chip this GPU is")
    ap.add_argument("--prefill", default="512,2048,8192", help="prefill lengths (tokens, one request)")
    ap.add_argument("--decode", default="1,8,32,128", help="decode batch sizes")
    ap.add_argument("--ctx", type=int, default=2048, help="context per sequence for the decode steps")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None,
                    help="run only this many of the shape's layers (a 70B shape's layers on one GPU); the roofline "
                         "is computed for the same truncated shape")
    ap.add_argument("--skip-eager-decode", action="store_true", help="only the CUDA-graph decode step")
    args = ap.parse_args(argv)
    import torch
    from transformers import DynamicCache

    cat = costmodel.load_catalog()
    shape, chip = cat.model(args.model), cat.chip(args.chip)
    if args.layers:  # per-layer GEMM shapes unchanged; parameters scaled past the embeddings
        import dataclasses

        emb = 2 * 128256 * shape.hidden
        per_layer = (shape.params - emb) / shape.layers
        shape = dataclasses.replace(shape, name=f"{shape.name}[{args.layers} layers]", layers=args.layers,
                                    params_b=(per_layer * args.layers + emb) / 1e9, kv_bytes_per_token=0, attn_dim=0)
    model = _llama(shape, 16384)
    print(f"# {torch.cuda.get_device_name()} | {shape.name} random weights bf16 | roofline chip {chip.name} "
          f"(mfu {chip.mfu}, mbu {chip.mbu}, overhead {chip.forward_overhead_ms} ms)")
    rows = []
    print(f"{'kind':12} {'x':>6} {'measured_ms':>12} {'roofline_ms':>12} {'ratio':>6} {'bound':>8} {'implied':>10}")
    with torch.inference_mode():
        for n in [int(x) for x in args.prefill.split(",")]:
            ids = torch.randint(0, 32000, (1, n), device="cuda")
            t = _time(lambda ids=ids: model(ids, use_cache=False), args.repeats)
            pred = costmodel.prefill_time(chip, shape, 1, [(n, 0)])
            flops = costmodel.forward_flops(shape, n, costmodel.causal_keys(n, 0))
            nbytes = costmodel.forward_bytes(shape, n, n)
            bound = "compute" if flops / chip.flops > nbytes / chip.bw else "memory"
            implied = flops / (t * chip.peak_tflops * 1e12) if bound == "compute" else nbytes / (t * chip.mem_bw_gb_s * 1e9)
            rows.append({"kind": "prefill", "x": n, "measured_s": t, "roofline_s": pred, "bound": bound, "implied": implied})
        for b in [int(x) for x in args.decode.split(",")]:
            graph, keep = _graph_decode(shape, b, args.ctx)
            t = _time(graph.replay, args.repeats * 4)
            del graph, keep
            torch.cuda.empty_cache()
            pred = costmodel.decode_step_time(chip, shape, 1, b, b * args.ctx)
            nbytes = costmodel.forward_bytes(shape, b, b * args.ctx)
            rows.append({"kind": "decode", "x": b, "measured_s": t, "roofline_s": pred, "bound": "memory",
                         "implied": nbytes / (t * chip.mem_bw_gb_s * 1e9)})
        for b in [] if args.skip_eager_decode else [int(x) for x in args.decode.split(",")]:
            ids = torch.randint(0, 32000, (b, args.ctx), device="cuda")
            cache = DynamicCache()
            model(ids, past_key_values=cache, use_cache=True)
            nxt = torch.randint(0, 32000, (b, 1), device="cuda")
            base = cache.get_seq_length()

            def step(cache=cache, nxt=nxt, base=base) -> None:
                model(nxt, past_key_values=cache, use_cache=True)
                cache.crop(-1)  # every timed step sees the same context

            t = _time(step, args.repeats * 4)
            pred = costmodel.decode_step_time(chip, shape, 1, b, b * args.ctx)
            nbytes = costmodel.forward_bytes(shape, b, b * args.ctx)
            rows.append({"kind": "decode-eager", "x": b, "measured_s": t, "roofline_s": pred, "bound": "memory",
                         "implied": nbytes / (t * chip.mem_bw_gb_s * 1e9)})
            del cache
            torch.cuda.empty_cache()
    for r in rows:
        r["ratio"] = r["measured_s"] / r["roofline_s"]
        print(f"{r['kind']:12} {r['x']:>6} {r['measured_s'] * 1e3:>12.2f} {r['roofline_s'] * 1e3:>12.2f} "
              f"{r['ratio']:>6.2f} {r['bound']:>8} {'MFU' if r['bound'] == 'compute' else 'MBU'} {r['implied']:.2f}")
    errs = [abs(r["ratio"] - 1) for r in rows if r["kind"] != "decode-eager"]
    print(json.dumps({"device": torch.cuda.get_device_name(), "model": shape.name, "chip": chip.name,
                      "rows": rows, "max_rel_err": max(errs), "median_rel_err": statistics.median(errs)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
