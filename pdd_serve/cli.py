"""The `pdd` console script.

Each subcommand is one `Command(name, help, add_arguments, run)` in COMMANDS; to add one, write
its two functions and append it there. `run` returns the exit code. Heavy imports (torch,
transformers, ray) happen inside `run`, so `pdd --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple, NoReturn


class UsageError(Exception):
    """Bad arguments: reported as one line on stderr, exit code 2."""


class Command(NamedTuple):
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str = ""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block and calls sys.exit; we want one line and a return code.
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


# ---- make-model ---------------------------------------------------------------------------

_MAKE_MODEL_DESCRIPTION = """\
Build a small Hugging Face checkpoint in OUT_DIR: config.json, model.safetensors (fp32) and
tokenizer files, loadable offline with transformers' AutoModelForCausalLM / AutoTokenizer.

Why: tests and benchmarks need real checkpoints but this project downloads nothing. The weights
are random, fixed by --seed, so every machine builds bit-identical models (and greedy outputs
can be compared across sites and engines); the tokenizer is a real byte-level BPE trained on a
corpus shipped with pdd_serve, so text round-trips and chat templates work. Shapes follow the
Llama / Qwen2 families (grouped-query attention, RoPE), so the KV per token is realistic in
structure if not in size.
"""


def _add_make_model(p: argparse.ArgumentParser) -> None:
    from pdd_serve.models import ARCHS, DEFAULT_INIT_STD, ModelSpec

    d = ModelSpec()
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (replaced atomically if it holds a checkpoint)")
    p.add_argument("--arch", choices=ARCHS, default=d.arch, help="model family (default: %(default)s)")
    p.add_argument("--layers", type=int, default=d.layers, help="decoder layers (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden size (default: %(default)s)")
    p.add_argument("--heads", type=int, default=d.heads, help="attention heads (default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help="KV heads, GQA (default: %(default)s)")
    p.add_argument("--intermediate", type=int, default=d.intermediate, help="MLP size (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=d.vocab, help="tokenizer and embedding size (default: %(default)s)")
    p.add_argument("--max-pos", type=int, default=d.max_pos, help="max positions (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="weight seed (default: %(default)s)")
    p.add_argument("--rope-theta", type=float, default=d.rope_theta, help="RoPE base (default: %(default)s)")
    p.add_argument("--tie-embeddings", action="store_true", help="share input and output embeddings")
    p.add_argument("--init-std", type=float, default=DEFAULT_INIT_STD,
                   help="weight init std; larger gives less flat logits (default: %(default)s)")


def _run_make_model(args: argparse.Namespace) -> int:
    import json

    from transformers.utils import logging as hf_logging

    from pdd_serve.models import SPEC_FILE, ModelSpec, make_model

    hf_logging.disable_progress_bar()  # our own summary below says what was written
    fields = {k: getattr(args, k) for k in ModelSpec.__dataclass_fields__}
    try:
        ModelSpec(**fields)  # validate before the slow imports
        out = make_model(args.out_dir, **fields)
    except (ValueError, FileExistsError) as e:
        raise UsageError(f"pdd make-model: error: {e}") from e
    info = json.loads((out / SPEC_FILE).read_text())
    print(f"wrote {out}")
    print(f"  parameters: {info['num_parameters']:,}")
    print(f"  KV bytes per token (fp32): {info['kv_bytes_per_token_fp32']:,}")
    return 0


# ---- model-path ---------------------------------------------------------------------------


def _add_model_path(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", default=None,
                   help="cache root (default: $PDD_CACHE_DIR, else ~/.cache/pdd_serve)")


def _run_model_path(args: argparse.Namespace) -> int:
    from pdd_serve.models import default_model_path

    print(default_model_path(args.cache_dir))
    return 0


# ---- engine-demo ---------------------------------------------------------------------------


def _add_engine_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="checkpoint dir, or 'default' (embedded small Llama)")
    p.add_argument("--prompt", default="The prefill cluster computes the prompt's KV cache", help="prompt text")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens to generate (default: %(default)s)")


def _run_engine_demo(args: argparse.Namespace) -> int:
    import time

    from transformers import AutoTokenizer

    from pdd_serve.engine.engine import Engine
    from pdd_serve.models import resolve_model

    if args.max_tokens <= 0:
        raise UsageError("pdd engine-demo: error: --max-tokens must be > 0")
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    eng = Engine.from_pretrained(path)
    ids = tok.encode(args.prompt)
    for turn in (1, 2):
        t = time.perf_counter()
        out = eng.generate(ids, args.max_tokens)
        dt = time.perf_counter() - t
        print(f"turn {turn}: {len(ids)} prompt tokens, prefix-cache hit rate so far "
              f"{eng.cache.stats.hit_rate:.2f}, {len(out)} tokens in {dt * 1e3:.0f} ms: {tok.decode(out)!r}")
    return 0


# ---- demo ----------------------------------------------------------------------------------

_DEMO_DESCRIPTION = """\
The main job: start a local two-site Ray cluster (raylets labelled pdd.site=a and pdd.site=b on
this machine), deploy a graph YAML with `serve run --non-blocking`, drive a short agentic workload
(multi-turn sessions sharing a system prompt, a few cold long documents, one anomalous request)
through the OpenAI-compatible API, print what PDD did per pipeline, and tear everything down.
"""


def _add_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graph", default="graphs/pdd.yaml", help="Serve config to deploy (default: %(default)s)")
    p.add_argument("--sessions", type=int, default=4, help="agentic sessions (default: %(default)s)")
    p.add_argument("--turns", type=int, default=3, help="turns per session (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="leave the cluster serving afterwards (pdd cluster down stops it)")


def _run_demo(args: argparse.Namespace) -> int:
    from pdd_serve.cluster import ClusterError
    from pdd_serve.demo import DemoError, run_demo

    if args.sessions <= 0 or args.turns <= 0:
        raise UsageError("pdd demo: error: --sessions and --turns must be > 0")
    try:
        return run_demo(args.graph, keep=args.keep, sessions=args.sessions, turns=args.turns)
    except (DemoError, ClusterError) as e:
        print(f"pdd demo: {e}", file=sys.stderr)
        return 1


COMMANDS: list[Command] = [
    Command("demo", "the main job: local two-site cluster + graphs/pdd.yaml + an agentic workload",
            _add_demo, _run_demo, _DEMO_DESCRIPTION),
    Command("engine-demo", "run the engine alone: generate twice from one prompt (second time from the prefix cache)",
            _add_engine_demo, _run_engine_demo),
    Command("make-model", "build a small random-weight HF checkpoint with a real tokenizer",
            _add_make_model, _run_make_model, _MAKE_MODEL_DESCRIPTION),
    Command("model-path", "print the default model's path (building it on first use)",
            _add_model_path, _run_model_path,
            "Print the path of the embedded default model (llama, 4 layers, hidden 256, seed 0),\n"
            "building it into the cache on first use."),
]
COMMANDS += __import__("evaluations.cli", fromlist=["EVAL_COMMANDS"]).EVAL_COMMANDS  # compare, sweep, runs
COMMANDS += __import__("evaluations.sim.cli", fromlist=["SIM_COMMANDS"]).SIM_COMMANDS  # simulate, plan


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pdd", description="PDD: cross-datacenter prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description or cmd.help,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    from pdd_serve.cluster import add_cluster_parser  # light: no ray import at parse time

    add_cluster_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not hasattr(args, "_run"):
            parser.print_help(sys.stderr)
            return 2
        return args._run(args)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except SystemExit as e:  # --help and friends
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
