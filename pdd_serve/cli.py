"""The `pdd` console script.

Each subcommand is one `Command(name, help, add_arguments, run)`; `run` returns the exit code.
The serving commands are in COMMANDS below. Other packages add theirs through the entry-point group
`pdd_serve.commands` (each entry point names a list of Commands; this project's `evaluations`
registers `demo`, `compare`, `sweep`, `runs`, `simulate` and `plan` in pyproject.toml), so
pdd_serve imports nothing from them. Heavy imports (torch, transformers, ray) happen inside `run`,
so `pdd --help` stays instant.
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
    from pdd_serve.checkpoints import ARCHS, DEFAULT_INIT_STD, ModelSpec

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

    from pdd_serve.checkpoints import SPEC_FILE, ModelSpec, make_model

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
    from pdd_serve.checkpoints import default_model_path

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

    from pdd_serve.checkpoints import resolve_model
    from pdd_serve.engine.engine import Engine

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


COMMANDS: list[Command] = [
    Command("engine-demo", "run the engine alone: generate twice from one prompt (second time from the prefix cache)",
            _add_engine_demo, _run_engine_demo),
    Command("make-model", "build a small random-weight HF checkpoint with a real tokenizer",
            _add_make_model, _run_make_model, _MAKE_MODEL_DESCRIPTION),
    Command("model-path", "print the default model's path (building it on first use)",
            _add_model_path, _run_model_path,
            "Print the path of the embedded default model (llama, 4 layers, hidden 256, seed 0),\n"
            "building it into the cache on first use."),
]

ENTRY_POINT_GROUP = "pdd_serve.commands"


def plugin_commands() -> list[Command]:
    """The Commands other installed packages register under ENTRY_POINT_GROUP, in entry-point name
    order (each entry point loads a list of Commands). One that fails to load is reported on stderr
    and skipped, so a broken plugin costs its own commands, not the whole CLI."""
    from importlib.metadata import entry_points

    out: list[Command] = []
    seen: set[tuple[str, str]] = set()
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (ep.name, ep.value)):
        if (ep.name, ep.value) in seen:  # one distribution found twice on sys.path
            continue
        seen.add((ep.name, ep.value))
        try:
            out.extend(Command(*c) for c in ep.load())
        except Exception as e:
            print(f"pdd: skipping the commands of entry point {ep.name} = {ep.value}: {type(e).__name__}: {e}",
                  file=sys.stderr)
    return out


def all_commands() -> list[Command]:
    """COMMANDS then the plugins' commands; a name already taken keeps its first definition."""
    out: dict[str, Command] = {}
    for cmd in [*COMMANDS, *plugin_commands()]:
        out.setdefault(cmd.name, cmd)
    return list(out.values())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pdd", description="PDD: cross-datacenter prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for cmd in all_commands():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description or cmd.help,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    from pdd_serve.cluster.cli import add_cluster_parser  # light: no ray import at parse time

    add_cluster_parser(sub)
    return parser


# optional dependencies -> the extra that installs them (serving nodes need none of them)
OPTIONAL_MODULES = {"mlflow": "eval", "matplotlib": "eval", "vllm": "vllm"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = None
    try:
        args = parser.parse_args(argv)
        args._argv = list(sys.argv[1:] if argv is None else argv)  # what reruns it (reports print it)
        if not hasattr(args, "_run"):
            parser.print_help(sys.stderr)
            return 2
        return args._run(args)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        extra = OPTIONAL_MODULES.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"pdd {getattr(args, 'command', '')}: needs {e.name}, an optional dependency: "
              f"pip install -e '.[{extra}]'",
              file=sys.stderr)
        return 2
    except SystemExit as e:  # --help and friends
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
