"""Package layout: dependencies point one way (evaluations uses pdd_serve, never the reverse), the
`pdd` CLI finds the evaluation commands through its entry-point group, and the engine's public
API is importable from `pdd_serve.engine`. One home per concept (issue 39): no private name used
across modules, no import circles, no module over 700 lines, one chip catalog and its one loader,
and no arithmetic on `time_scale` outside the clock (tests/layout_checks.py); each check also fails
on a tree with its violation planted."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pdd_serve
from pdd_serve import cli
from tests import layout_checks
from tests.layout_checks import (
    CATALOG,
    FIRST_PARTY,
    MAX_MODULE_LINES,
    ROOT,
    THIRD_PARTY_PRIVATE,
    first_party,
    import_circles,
    is_chip_catalog,
    long_modules,
    private_imports,
    private_references,
    second_catalogs,
    time_scale_arithmetic,
    unresolved_imports,
    where,
)

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
    assert sorted(eng.__all__) == sorted(eng.EXPORTS)
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


@pytest.mark.parametrize("module", ["metrics", "policy", "emulation", "config", "engine", "transport"])
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
    files = [*sorted((PKG / "serve").glob("*.py")), PKG / "engine" / "worker.py"]
    found = {f.name: sorted(_engine_uses(f) - members) for f in files}
    assert sum(len(_engine_uses(f)) for f in files) > 15  # the scan sees the engine calls
    assert not any(found.values()), {k: v for k, v in found.items() if v}


# ================================================================ one home per concept (issue 39)
# The checks are tests/layout_checks.py's functions of a tree's root: here on the repository, and
# at the end on a synthetic tree with each violation planted.


def test_the_walk_sees_every_first_party_module():
    mods = first_party(ROOT)
    assert {m.split(".")[0] for m in mods} == set(FIRST_PARTY) and len(mods) > 150, len(mods)


def test_no_private_name_is_imported_across_modules():
    found = private_imports(ROOT)
    assert not found, "private names used across modules (make them public, or move the piece):\n" + \
        "\n".join(found)


def test_every_third_party_private_name_allowed_is_still_used():
    """The allowlist stays short: an entry nothing uses any more goes."""
    used = {p for _, _, dotted in private_references(ROOT) for p in THIRD_PARTY_PRIVATE
            if dotted == p or dotted.startswith(p + ".")}
    assert used == set(THIRD_PARTY_PRIVATE), sorted(set(THIRD_PARTY_PRIVATE) - used)


def test_tests_share_helpers_through_helper_modules_not_other_tests():
    """A test module imported by another runs its fixtures and tests twice over; shared pieces live
    in helper modules (tests/helpers.py, tests/serve/inprocess.py, tests/serve/replicas.py, ...)."""
    mods = first_party(ROOT)
    found = [f"{where(m, node, ROOT)}: {t}" for m in mods.values() for node in ast.walk(m.tree)
             for t in ([m.absolute(node)] if isinstance(node, ast.ImportFrom) else
                       [a.name for a in node.names] if isinstance(node, ast.Import) else [])
             if t.startswith("tests.") and t.rpartition(".")[2].startswith("test_")]
    assert not found, found


def test_no_import_circles():
    circles = import_circles(ROOT)
    assert not circles, "modules that import each other (deferred imports included):\n" + \
        "\n".join(" <-> ".join(c) for c in circles)


def test_every_first_party_import_resolves():
    found = unresolved_imports(ROOT)
    assert not found, "\n".join(found)


def test_no_module_is_over_700_lines():
    assert not long_modules(ROOT), long_modules(ROOT)


def test_one_chip_catalog_and_one_loader():
    assert (ROOT / CATALOG).exists() and is_chip_catalog(ROOT / CATALOG)
    found = second_catalogs(ROOT)
    assert not found, "\n".join(found)


def test_only_the_clock_does_arithmetic_with_time_scale():
    found = time_scale_arithmetic(ROOT)
    assert not found, "ask the clock (pdd_serve/emulation/clock.py) instead:\n" + "\n".join(found)


def _plant(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


CLEAN_TREE = {
    "pdd_serve/__init__.py": "",
    "pdd_serve/emulation/__init__.py": "",
    "pdd_serve/emulation/clock.py": "def real(s, time_scale):\n    return s * time_scale\n",
    "pdd_serve/emulation/costmodel.py": ("import yaml\nCATALOG_PATH = 'costmodel.yaml'\n\n\n"
                                         "def load_catalog(path=CATALOG_PATH):\n"
                                         "    return yaml.safe_load(open(path))['chips']\n"),
    "pdd_serve/emulation/costmodel.yaml": "chips:\n  h100: {peak_tflops: 989}\n",
    "pdd_serve/a.py": "def spawn():\n    pass\n\n\ndef _helper():\n    pass\n",
    "pdd_serve/b.py": ("from pdd_serve.a import spawn\nfrom pdd_serve.serve import run\n"
                       "from ray.serve.context import _get_serve_request_context\n"),
    "pdd_serve/serve/__init__.py": "",
    "pdd_serve/serve/run.py": "def go(clock, s):\n    return clock.real(s)\n",
    "evaluations/__init__.py": "",
    "evaluations/e.py": "def f():\n    from pdd_serve import b\n    relay = object()\n    return relay._x\n",
    "tests/__init__.py": "",
    "tests/helpers.py": "def until():\n    pass\n",
    "tests/test_x.py": ("from tests.helpers import until\n\n\ndef test_x(tmp_path):\n"
                        "    (tmp_path / 'chips.yaml').write_text('chips: {}')\n"),
}

VIOLATIONS = {
    "private_imports": [
        {"pdd_serve/c.py": "from pdd_serve.a import (\n    spawn,\n    _helper,\n)\n"},  # multi-line
        {"pdd_serve/c.py": "from pdd_serve import a as A\n\n\ndef f():\n    return A._helper()\n"},  # module._name
        {"pdd_serve/c.py": "import pdd_serve.a\n\npdd_serve.a._helper()\n"},
        {"tests/test_y.py": "def test_y():\n    from .helpers import _hidden\n"},  # relative
        {"pdd_serve/c.py": "from ray._private.worker import global_worker\n"},  # third-party, not allowed
    ],
    "import_circles": [
        {"pdd_serve/a.py": "def spawn():\n    from pdd_serve import b  # deferred: still a circle\n"},
    ],
    "long_modules": [{"evaluations/big.py": "x = 1\n" * (MAX_MODULE_LINES + 1)}],
    "unresolved_imports": [
        {"pdd_serve/c.py": "def f():\n    from pdd_serve.emulation import vllm_connector  # moved away\n"},
        {"pdd_serve/c.py": "from pdd_serve.a import (\n    spawn,\n    spawned,\n)\n"},
    ],
    "second_catalogs": [
        {"evaluations/chips.yaml": "chips:\n  cpu: {price_per_hour: 0.05}\n"},
        {"evaluations/cost.py": "from pathlib import Path\nDEFAULT = Path(__file__).with_name('chips.yaml')\n"},
        {"evaluations/cost.py": "class Catalog:\n    pass\n"},
        {"evaluations/sim/config.py": "CHIPS = 'evaluations/sim/chips.yml'\n"},
    ],
    "time_scale_arithmetic": [
        {"pdd_serve/serve/run.py": "def go(cfg, s):\n    return s * cfg.time_scale\n"},
        {"evaluations/e.py": "def f(s, time_scale):\n    s /= time_scale\n    return s\n"},
    ],
}


@pytest.mark.parametrize("check, plant", [(c, p) for c, ps in VIOLATIONS.items() for p in ps],
                         ids=[f"{c}-{i}" for c, ps in VIOLATIONS.items() for i in range(len(ps))])
def test_each_check_fails_on_its_violation_planted_in_a_tree(tmp_path, check: str, plant: dict[str, str]):
    fn = getattr(layout_checks, check)
    clean = _plant(tmp_path / "clean", CLEAN_TREE)
    assert not fn(clean), fn(clean)  # the clean tree passes every check...
    bad = _plant(tmp_path / "bad", {**CLEAN_TREE, **plant})
    assert fn(bad), f"{check} missed {plant}"  # ...and each planted violation fails its own
