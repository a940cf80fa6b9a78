"""The layout checks of tests/test_layout.py, as functions of a tree's root: the test runs them on
the repository, and on small synthetic trees with one violation planted each. They walk the AST of
every first-party module (pdd_serve, evaluations, tests):

- `private_imports`: a private name (leading underscore) one module takes from another;
- `import_circles`: modules that import each other, deferred imports included;
- `unresolved_imports`: a first-party import that names nothing (what a move left behind);
- `long_modules`: a module over 700 lines;
- `second_catalogs`: a chip catalog besides pdd_serve/emulation/costmodel.yaml, or a second loader;
- `time_scale_arithmetic`: arithmetic on `time_scale` outside the clock.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("pdd_serve", "evaluations", "tests")
MAX_MODULE_LINES = 700

# Private names of other projects we import because they offer no public way: each with its reason.
# A dotted prefix matches what is imported (`module.name`) or the module an import names.
THIRD_PARTY_PRIVATE = {
    "ray._private.internal_api": "the GCS node and actor tables without registering a driver (cluster "
                                 "probes, tests); ray.util.state needs the dashboard, which is off",
    "ray._private.state": "the soak lists the live replica actors' pids (their RSS) from the GCS actor "
                          "table; ray.util.state needs the dashboard",
    "ray._private.serialization": "the transport bench measures Ray's own serializer on KV, as Serve runs it",
    "ray._raylet": "re-read RAY_AUTH_* after the driver env changes; Ray caches them at import",
    "ray.autoscaler._private.util": "validate a cluster YAML with the checks `ray up` itself runs",
    "ray.serve._private.common": "DeploymentID and RequestMetadata: Serve's own keys (scale eval, bench)",
    "ray.serve.context._get_serve_request_context": "the Serve call's request context: pinning reads its "
                                                    "multiplexed id; a cross-site call clears its internal id",
    "ray.serve.context._serve_request_context": "the ContextVar behind it: each cross-site call runs with the "
                                                "parent's internal request id cleared (Ray 2.60 keys calls by it)",
    "os._exit": "an injected fault ends a replica at once, as a lost host would: no cleanup handler runs",
    "ray.serve.context._get_global_client": "the scale eval asks Serve's controller for replica states",
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class Module:
    """One first-party module: its dotted name, file and syntax tree."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path = name, path
        self.is_package = path.name == "__init__.py"
        self.text = path.read_text()
        self.tree = ast.parse(self.text, filename=str(path))

    def absolute(self, node: ast.ImportFrom) -> str:
        """The module a `from ... import` names, relative imports resolved."""
        if node.level == 0:
            return node.module or ""
        base = self.name.split(".")[: None if self.is_package else -1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join([*base, *([node.module] if node.module else [])])


@functools.lru_cache(maxsize=8)  # one parse per tree a session checks
def first_party(root: Path, packages: tuple[str, ...] = FIRST_PARTY) -> dict[str, Module]:
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = Module(".".join(parts), path)
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import statements under `if TYPE_CHECKING:` (they never run)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for s in node.body for n in ast.walk(s) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def where(mod: Module, node: ast.AST, root: Path) -> str:
    return f"{mod.path.relative_to(root)}:{getattr(node, 'lineno', '?')}"


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _scope_nodes(scope: ast.AST):
    """The nodes of one scope, not descending into the scopes nested in it (yielded themselves)."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, _SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def _module_names(scope: ast.AST, mod: Module, known: set[str]) -> dict[str, str | None]:
    """What each name bound in `scope` is: the dotted module an import bound it to, or None (an
    argument, an assignment, a def, a class, or an imported name that is not a module)."""
    names: dict[str, str | None] = {}
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = scope.args
        names |= {x.arg: None for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x}
    for node in _scope_nodes(scope):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            src = mod.absolute(node)
            for a in node.names:
                full = f"{src}.{a.name}"
                # a first-party submodule, or anything third-party (its private attributes count too)
                third_party = src.split(".")[0] not in FIRST_PARTY
                names[a.asname or a.name] = full if full in known or third_party else None
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.setdefault(node.id, None)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.setdefault(node.name, None)
        elif isinstance(node, ast.arg):
            names.setdefault(node.arg, None)
    return names


def _allowed(dotted: str) -> bool:
    return any(dotted == p or dotted.startswith(p + ".") for p in THIRD_PARTY_PRIVATE)


def _private_attributes(mod: Module, known: set[str]) -> list[tuple[ast.AST, str]]:
    """`m._x` where `m` is bound by an import (a module, or any third-party name), scope by scope."""
    found: list[tuple[ast.AST, str]] = []

    def visit(scope: ast.AST, env: list[dict[str, str | None]]) -> None:
        env = [_module_names(scope, mod, known), *env]

        def dotted(e: ast.AST) -> str | None:
            if isinstance(e, ast.Name):
                return next((s[e.id] for s in env if e.id in s), None)
            if isinstance(e, ast.Attribute):
                base = dotted(e.value)
                return f"{base}.{e.attr}" if base else None
            return None

        for node in _scope_nodes(scope):
            if isinstance(node, _SCOPES):
                visit(node, env)
            elif isinstance(node, ast.Attribute) and _is_private(node.attr):
                base = dotted(node.value)
                if base and base != mod.name:
                    found.append((node, f"{base}.{node.attr}"))

    visit(mod.tree, [])
    return found


def private_references(root: Path, packages: tuple[str, ...] = FIRST_PARTY) -> list[tuple[Module, ast.AST, str]]:
    """Every private name (leading underscore, not a dunder) one module takes from another, as
    (module, node, dotted name): `from m import _x` (multi-line ones too), a module path with a
    private part (`from tests._cluster import x`), and `m._x` on a name an import bound (scopes
    respected: a local `relay` replica is not the `relay` module a fixture imported)."""
    mods = first_party(root, packages)
    found = []
    for mod in mods.values():
        used: list[tuple[ast.AST, str]] = []
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import):
                used += [(node, a.name) for a in node.names if any(_is_private(p) for p in a.name.split("."))]
            elif isinstance(node, ast.ImportFrom):
                src = mod.absolute(node)
                private_src = any(_is_private(p) for p in src.split("."))
                used += [(node, f"{src}.{a.name}") for a in node.names
                         if private_src or (_is_private(a.name) and src != mod.name)]
        used += _private_attributes(mod, set(mods))
        found += [(mod, node, dotted) for node, dotted in used]
    return found


def private_imports(root: Path, packages: tuple[str, ...] = FIRST_PARTY) -> list[str]:
    """The private names used across modules that are not allowed: every first-party one, and the
    third-party ones missing from THIRD_PARTY_PRIVATE."""
    return sorted({f"{where(mod, node, root)}: {dotted}" for mod, node, dotted in private_references(root, packages)
                   if dotted.split(".")[0] in packages or not _allowed(dotted)})


def import_graph(root: Path, packages: tuple[str, ...] = FIRST_PARTY) -> dict[str, set[str]]:
    """module -> the first-party modules it imports. Every import statement counts, the ones inside
    functions too (a deferred import is still a dependency: it runs the first time the function
    does); only `if TYPE_CHECKING:` imports are left out, as they never run. `from a import b`
    points at the module a.b when there is one, else at a; parent packages are not implied."""
    mods = first_party(root, packages)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod in mods.values():
        skip = _type_checking_only(mod.tree)
        for node in ast.walk(mod.tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = mod.absolute(node)
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import a.b.c` of a name that is not a module
                    t = t.rpartition(".")[0]
                if t and t != mod.name:
                    graph[mod.name].add(t)
    return graph


def import_circles(root: Path, packages: tuple[str, ...] = FIRST_PARTY) -> list[list[str]]:
    """The strongly connected parts of the import graph with more than one module (Tarjan)."""
    graph = import_graph(root, packages)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                strongconnect(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(out)


def _top_level_names(mod: Module) -> set[str] | None:
    """The names a module defines at its top level (under `if`/`try` too); None when anything may
    come: a module `__getattr__` without an `__all__` to say what it serves."""
    names: set[str] = set()
    todo = list(mod.tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For)):
            todo += [*getattr(node, "body", []), *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]
    if "__getattr__" in names:  # lazy names (PEP 562): what `__all__` lists
        lazy = next((n.value for n in mod.tree.body if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)), None)
        if not isinstance(lazy, (ast.List, ast.Tuple)):
            return None
        names |= {e.value for e in lazy.elts if isinstance(e, ast.Constant)}
    return names


def unresolved_imports(root: Path, packages: tuple[str, ...] = FIRST_PARTY) -> list[str]:
    """First-party imports that name no module and no name of one: what a move left behind (a
    path only a GPU or an optional dependency would ever run)."""
    mods = first_party(root, packages)
    found = []
    for mod in mods.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import):
                found += [f"{where(mod, node, root)}: import {a.name}" for a in node.names
                          if a.name.split(".")[0] in packages and a.name not in mods]
            elif isinstance(node, ast.ImportFrom):
                src = mod.absolute(node)
                if src.split(".")[0] not in packages:
                    continue
                if src not in mods:
                    found.append(f"{where(mod, node, root)}: from {src} (no such module)")
                    continue
                names = _top_level_names(mods[src])
                found += [f"{where(mod, node, root)}: from {src} import {a.name}" for a in node.names
                          if names is not None and a.name != "*" and a.name not in names
                          and f"{src}.{a.name}" not in mods]
    return found


def long_modules(root: Path, packages: tuple[str, ...] = FIRST_PARTY, limit: int = MAX_MODULE_LINES) -> list[str]:
    return [f"{m.path.relative_to(root)}: {n} lines" for m in first_party(root, packages).values()
            if (n := len(m.text.splitlines())) > limit]


CATALOG = "pdd_serve/emulation/costmodel.yaml"
CATALOG_LOADER = "pdd_serve/emulation/costmodel.py"
CHIP_FIELDS = {"peak_tflops", "mem_bw_gb_s", "price_per_hour"}  # any one makes a mapping a chip entry
_CATALOG_FILE = re.compile(r"^\S*(costmodel|chips)\.ya?ml$")  # a path, not prose that mentions one
_LOADER_NAMES = {"Catalog", "load_catalog", "load_chips"}


def is_chip_catalog(path: Path) -> bool:
    """Whether a YAML file holds chip entries: a top-level `chips:` mapping of name -> a mapping
    with chip fields. (A scenario's `chips:` names chips per site; it holds no entries.)"""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError):
        return False
    chips = doc.get("chips") if isinstance(doc, dict) else None
    return isinstance(chips, dict) and any(isinstance(v, dict) and CHIP_FIELDS & set(v) for v in chips.values())


def second_catalogs(root: Path, packages: tuple[str, ...] = FIRST_PARTY) -> list[str]:
    """One chip catalog and one loader: CATALOG is the only YAML file in the tree with chip
    entries, and outside CATALOG_LOADER no module of pdd_serve or evaluations names a catalog file
    or defines a catalog loader. A user's own catalog comes in through that loader (tests write
    their own, so they may name a file)."""
    found = []
    skip = {".git", ".venv", "venv", "node_modules", "build", "dist"}
    for path in sorted(root.rglob("*.y*ml")):
        rel = path.relative_to(root)
        if skip.isdisjoint(rel.parts) and not any(p.endswith(".egg-info") for p in rel.parts) \
                and rel.as_posix() != CATALOG and is_chip_catalog(path):
            found.append(f"{rel}: a second chip catalog")
    for mod in first_party(root, packages).values():
        rel = mod.path.relative_to(root).as_posix()
        if rel == CATALOG_LOADER or rel.startswith("tests/"):
            continue
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in _LOADER_NAMES:
                found.append(f"{where(mod, node, root)}: defines {node.name}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _CATALOG_FILE.match(node.value):
                found.append(f"{where(mod, node, root)}: names a catalog file {node.value!r}")
    return found


CLOCK = "pdd_serve/emulation/clock.py"


def _is_time_scale(e: ast.AST) -> bool:
    return (isinstance(e, ast.Name) and e.id == "time_scale") or (
        isinstance(e, ast.Attribute) and e.attr == "time_scale")


def time_scale_arithmetic(root: Path, packages: tuple[str, ...] = FIRST_PARTY) -> list[str]:
    """`time_scale` in arithmetic (an operand of a binary operation or an augmented assignment)
    anywhere but the clock: the clock is the one code that turns emulated time into real time."""
    found = []
    for mod in first_party(root, packages).values():
        if str(mod.path.relative_to(root)) == CLOCK:
            continue
        for node in ast.walk(mod.tree):
            if (isinstance(node, ast.BinOp) and (_is_time_scale(node.left) or _is_time_scale(node.right))) or (
                    isinstance(node, ast.AugAssign) and (_is_time_scale(node.target) or _is_time_scale(node.value))):
                found.append(f"{where(mod, node, root)}: {ast.unparse(node)}")
    return found
