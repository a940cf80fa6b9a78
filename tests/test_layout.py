"""Package layout: dependencies point one way (evaluations uses pdd_serve, never the reverse), the
`pdd` CLI finds the evaluation commands through its entry-point group, and the engine's public
API is importable from `pdd_serve.engine`."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pdd_serve
from pdd_serve import cli

PKG = Path(pdd_serve.__file__).resolve().parent
# a module path as a string: "evaluations", "evaluations.loadgen", "evaluations.cli:EVAL_COMMANDS"
_EVAL_MODULE = re.compile(r"^\s*evaluations(\.[A-Za-z_]\w*)*(:[\w.]+)?\s*$")
_IMPORT_CALLS = {"__import__", "import_module", "find_spec", "load_module", "run_module", "EntryPoint"}


def _evaluations_imports(path: Path) -> list[str]:
    """Every way `path` could import evaluations: import statements, and any call (or any string
    at all) naming an evaluations module -- __import__("evaluations.cli"), importlib.import_module,
    an entry-point value."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(PKG.parent)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names
                      if a.name == "evaluations" or a.name.startswith("evaluations.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "evaluations" or node.module.startswith("evaluations.")):
            found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            args = [*node.args, *(k.value for k in node.keywords)]
            if name in _IMPORT_CALLS and any(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                             and a.value.strip().startswith("evaluations") for a in args):
                found.append(f"{where}: {name}(...evaluations...)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _EVAL_MODULE.match(node.value):
            found.append(f"{where}: string {node.value!r}")
    return found


def test_pdd_serve_imports_nothing_from_evaluations():
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 20, files  # the walk really sees the package
    found = [hit for f in files for hit in _evaluations_imports(f)]
    assert not found, "pdd_serve must not import evaluations:\n" + "\n".join(found)


def test_the_checker_catches_every_form(tmp_path, monkeypatch):
    bad = tmp_path / "pdd_serve" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("import evaluations.cli\n"
                   "from evaluations import loadgen\n"
                   "import importlib\n"
                   "importlib.import_module('evaluations.workloads')\n"
                   "m = __import__('evaluations.sim.cli', fromlist=['SIM_COMMANDS'])\n"
                   "EP = 'evaluations.cli:EVAL_COMMANDS'\n"
                   "from .evaluations import x  # relative: pdd_serve's own, allowed\n"
                   "'''see evaluations/bench/mac.py and the evaluations README'''\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", bad.parent)
    hits = _evaluations_imports(bad)
    assert {int(h.split(":")[1]) for h in hits} == {1, 2, 4, 5, 6}, hits


def test_engine_public_api():
    from pdd_serve.engine import Engine, RequestError, SamplingParams
    from pdd_serve.engine.engine import Engine as Engine2
    from pdd_serve.engine.sampling import SamplingParams as SP2

    assert Engine is Engine2 and SamplingParams is SP2 and issubclass(RequestError, ValueError)
    import pdd_serve.engine as eng

    for name in eng.__all__:
        assert getattr(eng, name) is not None
    assert sorted(eng.__all__) == sorted(eng._EXPORTS)
    with pytest.raises(AttributeError):
        eng.NoSuchThing  # noqa: B018


_ALL = ("demo", "engine-demo", "make-model", "model-path", "compare", "sweep", "runs", "simulate", "plan", "cluster")


def test_cli_finds_the_evaluation_commands_through_entry_points():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group=cli.ENTRY_POINT_GROUP)}
    assert eps.get("evaluations") == "evaluations.cli:EVAL_COMMANDS", \
        f"entry points not registered ({eps}): run `pip install -e .` again"
    assert eps.get("sim") == "evaluations.sim.cli:SIM_COMMANDS"
    names = [c.name for c in cli.all_commands()]
    assert len(names) == len(set(names))
    assert set(_ALL) - {"cluster"} <= set(names)


def test_pdd_help_lists_every_command_and_stays_light():
    code = ("import sys\n"
            "from pdd_serve.cli import main\n"
            "rc = main(['--help'])\n"
            "heavy = [m for m in ('torch', 'ray', 'mlflow', 'transformers', 'matplotlib') if m in sys.modules]\n"
            "print('RC', rc, 'HEAVY', heavy)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "RC 0 HEAVY []" in r.stdout, r.stdout + r.stderr
    listed = set(re.findall(r"^ {4}(\S+)", r.stdout, re.M))
    assert set(_ALL) <= listed, r.stdout
    assert "skipping" not in r.stderr, r.stderr


def test_the_router_imports_no_torch():
    """A Router replica loads no engine: it hashes prompts (`engine.blocks`) and routes, so its
    process stays small and starts fast (torch alone is ~1.6 s of import and ~200 MB per process)."""
    code = "import sys\nimport pdd_serve.serve.router\nprint('TORCH', 'torch' in sys.modules)\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "TORCH False" in r.stdout, r.stdout


def test_a_command_missing_an_optional_dependency_names_the_extra(monkeypatch, capsys):
    """Serving nodes install no MLflow: `pdd compare` there says which extra to install."""
    def run(_args):
        raise ModuleNotFoundError("No module named 'mlflow'", name="mlflow")

    monkeypatch.setattr(cli, "all_commands", lambda: [cli.Command("compare", "x", lambda p: None, run)])
    assert cli.main(["compare"]) == 2
    assert "pdd compare: needs mlflow, an optional dependency: pip install -e '.[eval]'" in capsys.readouterr().err

    def broken(_args):
        raise ModuleNotFoundError("No module named 'nonexistent'", name="nonexistent")

    monkeypatch.setattr(cli, "all_commands", lambda: [cli.Command("compare", "x", lambda p: None, broken)])
    with pytest.raises(ModuleNotFoundError):  # a bug, not an extra: the traceback stays
        cli.main(["compare"])


def test_a_broken_plugin_costs_only_its_own_commands(monkeypatch, capsys):
    from importlib.metadata import EntryPoint

    good = EntryPoint("zz-good", "pdd_serve.cli:COMMANDS", cli.ENTRY_POINT_GROUP)
    broken = EntryPoint("aa-broken", "no_such_module_pdd:COMMANDS", cli.ENTRY_POINT_GROUP)
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [good, broken, good])
    cmds = cli.plugin_commands()
    assert [c.name for c in cmds] == [c.name for c in cli.COMMANDS]  # once, though listed twice
    assert "aa-broken" in capsys.readouterr().err


def _pdd_imports(path: Path) -> set[str]:
    """The pdd_serve modules `path` imports (statements anywhere in it, deferred ones too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("pdd_serve")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("pdd_serve"):
            out |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
    return out


@pytest.mark.parametrize("module", ["metrics", "policy", "costmodel", "config", "engine", "transport"])
def test_the_lower_layers_do_not_import_the_serve_layer(module: str):
    """The Serve deployments use metrics, policy, the cost model, config, the engine and the
    transport; none of those reaches back up into pdd_serve.serve."""
    files = sorted((PKG / module).rglob("*.py")) if (PKG / module).is_dir() else [PKG / f"{module}.py"]
    up = {f"{f.relative_to(PKG.parent)}: {m}" for f in files for m in _pdd_imports(f)
          if m == "pdd_serve.serve" or m.startswith("pdd_serve.serve.")}
    assert not up, sorted(up)


def _engine_uses(path: Path) -> set[str]:
    """Names used on an engine in `path`: `self.engine.X`, `engine.X`, and `e.X` where a function
    did `e = self.engine`."""
    used: set[str] = set()

    def is_engine(node: ast.AST, aliases: set[str]) -> bool:
        if isinstance(node, ast.Attribute) and node.attr == "engine" and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            return True
        return isinstance(node, ast.Name) and (node.id == "engine" or node.id in aliases)

    tree = ast.parse(path.read_text())
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] or [tree]:
        aliases = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and is_engine(n.value, set())
                   for t in n.targets if isinstance(t, ast.Name)}
        used |= {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and is_engine(n.value, aliases)}
    return used


def test_the_serving_layer_speaks_only_the_engine_protocol():
    """The seam a second engine (vLLM) goes behind: Prefill, Relay, Main decode and the batcher
    use nothing of an engine that `EngineBackend` does not define."""
    from pdd_serve.engine.protocol import engine_members

    members = engine_members()
    files = [*sorted((PKG / "serve").glob("*.py")), PKG / "engine" / "scheduler.py"]
    found = {f.name: sorted(_engine_uses(f) - members) for f in files}
    assert sum(len(_engine_uses(f)) for f in files) > 15  # the scan sees the engine calls
    assert not any(found.values()), {k: v for k, v in found.items() if v}
