"""The docs stay true to the code (issue 39): every command README.md and docs/*.md show still runs
(its `--help` answers 0), every `--flag` they show is in that command's `--help`, every repository
path and first-party module they name exists, every link between them resolves, and the README
stays short.

Commands are read from ```bash blocks and from inline code spans that start with `pdd`, `python`,
`serve` or `ray`: `pdd X` and `python -m M` / `python evaluations/X.py` run with `--help` (cached
per command), walking subcommands through each `--help`'s own list, so a moved module or a renamed
subcommand fails here; `serve run FILE` and `ray up FILE` only have their files checked (nothing
starts a cluster). A section titled "Paths that changed" names old paths on purpose and is skipped.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import importlib
import importlib.util
import io
import re
import shlex
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *(ROOT / d / "README.md" for d in ("evaluations", "evaluations/sim", "cluster_configs"))]
README_MAX_LINES = 200
TOP_DIRS = ("graphs", "cluster_configs", "evaluations", "pdd_serve", "tests", "docs")
FIRST_PARTY = ("pdd_serve", "evaluations")
SKIPPED_SECTIONS = ("Paths that changed",)
NOT_MODULES = {"pdd_serve.commands"}  # the `pdd` CLI's entry-point group, named like a module
HELP_TIMEOUT_S = 120
HELP_WORKERS = 4  # commands checked at once (each --help is mostly a Python start-up)

_PATH = re.compile(r"^(?:~/pdd_serve/)?((?:" + "|".join(TOP_DIRS) + r")/[\w.*{},/-]*)$")
_MODULE = re.compile(r"^(?:" + "|".join(FIRST_PARTY) + r")(?:\.[A-Za-z_]\w*)+(?::\w+)?$")
_COMMAND_SPAN = re.compile(r"^(?:pdd|python3?|\S*/python3?|serve|ray)\s")
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
_OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}
_REDIRECTS = {">", ">>", "<", "2>", "&>", "2>&1"}


# ---- reading the markdown ------------------------------------------------------------------


def _skip_sections(text: str) -> str:
    """`text` without the sections that name old paths on purpose (to the next heading as high)."""
    out, skip_level = [], None
    for line in text.split("\n"):
        m = re.match(r"^(#+) (.*)", line)
        if m and skip_level is not None and len(m.group(1)) <= skip_level:
            skip_level = None
        if m and any(s in m.group(2) for s in SKIPPED_SECTIONS):
            skip_level = len(m.group(1))
        if skip_level is None:
            out.append(line)
    return "\n".join(out)


def _blocks(text: str) -> tuple[list[str], list[str], str]:
    """(bash blocks, python blocks, the prose with every fenced block taken out)."""
    bash = [m.group(2) for m in _FENCE.finditer(text) if m.group(1) in ("bash", "sh", "shell", "console")]
    python = [m.group(2) for m in _FENCE.finditer(text) if m.group(1) == "python"]
    return bash, python, _FENCE.sub("", text)


def _spans(prose: str) -> list[str]:
    """Inline code spans; a span may wrap a line but not a paragraph."""
    return [re.sub(r"\s*\n\s*", " ", s).strip()
            for para in re.split(r"\n\s*\n", prose) for s in re.findall(r"`([^`]+)`", para)]


def _shell_lines(block: str) -> list[str]:
    """The block's command lines: continuations joined, here-document bodies dropped."""
    lines, heredoc = [], None
    for line in block.replace("\\\n", " ").split("\n"):
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        m = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
        if m:
            heredoc, line = m.group(1), line[:m.start()]
        if line.strip():
            lines.append(line)
    return lines


def _simple_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at `&&`, `|`, `;`...), redirections dropped,
    leading VAR=value assignments dropped; `$(...)` inside a word is a command of its own."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split, lex.commenters = True, "#"
    words = list(lex)
    commands, cur, skip_next = [], [], False
    for w in words:
        if skip_next:
            skip_next = False
            continue
        if w in _OPERATORS:
            commands.append(cur)
            cur = []
        elif w in _REDIRECTS or (w and set(w) <= set("<>&|")):
            skip_next = True
        else:
            for inner in re.findall(r"\$\(([^()]*)\)", w):
                commands.extend(_simple_commands(inner))
            cur.append(w)
    commands.append(cur)
    out = []
    for c in commands:
        while c and re.match(r"^[A-Za-z_]\w*=", c[0]):
            c = c[1:]
        if c:
            out.append(c)
    return out


# ---- running --help -------------------------------------------------------------------------


_HELP: dict[tuple[str, ...], list] = {}  # argv -> [its lock, (exit status, output) once run]
_HELP_LOCK = threading.Lock()
_STDIO_LOCK = threading.Lock()  # in-process runs swap sys.stdout: one at a time


def _run_help(argv: tuple[str, ...]) -> tuple[int, str]:
    """`pdd` itself runs as the console script; its subcommands run in-process through the same
    `pdd_serve.cli.main` the script calls (a start-up each would cost seconds on a busy box)."""
    if argv[0] == "pdd" and len(argv) > 1:
        from pdd_serve import cli

        out = io.StringIO()
        with _STDIO_LOCK, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                rc = cli.main([*argv[1:], "--help"])
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
        return rc, out.getvalue()
    cmd = [_pdd_executable() if argv[0] == "pdd" else argv[0], *argv[1:], "--help"]
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HELP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 1, f"{type(e).__name__}: {e}"
    return p.returncode, p.stdout + p.stderr


def _help(argv: tuple[str, ...]) -> tuple[int, str]:
    """`argv --help`: exit status and output, run once per command for the whole session (a
    second thread asking for the same command waits for the first one's answer)."""
    with _HELP_LOCK:
        entry = _HELP.setdefault(argv, [threading.Lock(), None])
    with entry[0]:
        if entry[1] is None:
            entry[1] = _run_help(argv)
        return entry[1]


def _subcommands(help_text: str) -> set[str]:
    """The subcommands a --help lists: a positional `{a,b}` in its usage (not an option's choices,
    `--mode {a,b}`), or 4-space entries under its positional arguments (argparse's layout for a
    subparser's choices)."""
    usage = help_text.split("\n\n", 1)[0]
    names = {n for m in re.finditer(r"(\S*)\s+\{([\w,-]+)\}", usage) if not m.group(1).lstrip("[").startswith("-")
             for n in m.group(2).split(",")}
    m = re.search(r"^positional arguments:\n(.*?)(?:\n\n|\Z)", help_text, re.S | re.M)
    if m:
        names |= {mm.group(1) for mm in re.finditer(r"^ {4}(\w[\w-]*)", m.group(1), re.M)}
    return names


def _pdd_executable() -> str:
    exe = Path(sys.executable).parent / "pdd"
    return str(exe) if exe.exists() else "pdd"


def _source_runs_argparse(path: Path) -> bool:
    """Whether running `path` with --help only prints help: it parses with argparse, itself or
    (a `__main__.py` stub) through the first-party `main` it imports."""
    src = path.read_text()
    if "argparse" in src:
        return True
    m = re.search(r"^from ((?:" + "|".join(FIRST_PARTY) + r")[\w.]*) import main$", src, re.M)
    spec = importlib.util.find_spec(m.group(1)) if m else None
    return bool(spec and spec.origin and "argparse" in Path(spec.origin).read_text())


def _check_runnable(words: list[str], where: str) -> list[str]:
    """A `pdd ...` / `python -m ...` / `python evaluations/X.py ...` command: its --help answers 0
    for the deepest subcommand it names, and every --flag it shows is in that --help."""
    prog = Path(words[0]).name
    if prog == "pdd":
        argv, rest = ("pdd",), words[1:]
    elif prog.startswith("python"):
        if len(words) < 2 or words[1] in ("-", "-c"):
            return []
        if words[1] == "-m":
            if len(words) < 3:
                return [f"{where}: `{' '.join(words)}`: no module"]
            module, rest = words[2], words[3:]
            try:
                spec = importlib.util.find_spec(module)
            except (ImportError, ValueError):
                spec = None
            if spec is None:
                return [f"{where}: `python -m {module}`: no such module"]
            if module.split(".")[0] in FIRST_PARTY:
                entry = Path(spec.origin)
                if entry.name == "__init__.py":
                    entry = entry.with_name("__main__.py")
                if not entry.exists() or not _source_runs_argparse(entry):
                    return [f"{where}: `python -m {module}`: not runnable with --help (no argparse)"]
            argv = (sys.executable, "-m", module)
        else:
            if _placeholder(words[1]):
                return []
            script = ROOT / words[1]
            if not script.is_file():
                return [f"{where}: `python {words[1]}`: no such file"]
            if not _source_runs_argparse(script):
                return [f"{where}: `python {words[1]}`: not runnable with --help (no argparse)"]
            argv, rest = (sys.executable, words[1]), words[2:]
    else:
        return []
    rc, text = _help(argv)
    for w in rest:
        if w.startswith("-"):
            break
        subs = _subcommands(text)
        if not subs:
            break
        if w not in subs:
            return [f"{where}: `{' '.join(words)}`: `{w}` is not a subcommand of `{' '.join(argv[-2:])}` "
                    f"(it has {sorted(subs)})"]
        argv = (*argv, w)
        rc, text = _help(argv)
    if rc != 0:
        return [f"{where}: `{' '.join(words)}`: `{' '.join(argv)} --help` exited {rc}: {text.strip()[-300:]}"]
    problems = []
    for w in rest:
        flag = w.strip("[]").split("=", 1)[0]
        shown = re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text)
        if re.fullmatch(r"--[A-Za-z][\w-]*", flag) and not shown:
            problems.append(f"{where}: `{' '.join(words)}`: {flag} is not in `{' '.join(argv)} --help`")
    return problems


# ---- paths, modules, links ---------------------------------------------------------------------


def _placeholder(path: str) -> bool:
    """`cluster_configs/X.yaml`, `RUN_DIR/requests.parquet`: a name to fill in, not a path."""
    return any(re.fullmatch(r"[A-Z][A-Z0-9_]*", seg.split(".")[0]) for seg in path.split("/"))


def _expand_braces(p: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", p)
    if not m:
        return [p]
    return [q for alt in m.group(1).split(",") for q in _expand_braces(p[:m.start()] + alt + p[m.end():])]


def _check_path(token: str, where: str) -> list[str]:
    """A repository path (`graphs/pdd.yaml`, `cluster_configs/*-two-site.yaml`, `~/pdd_serve/...`
    as the launched nodes see the checkout) must exist; a placeholder segment (`X.yaml`, `FILE`)
    is not a path. A comma-separated list (a `--graphs a.yaml,b.yaml` value) is checked path by path."""
    token = token.rstrip(".,:;")
    if "," in token and "{" not in token:
        return [f for part in token.split(",") if part for f in _check_path(part, where)]
    m = _PATH.match(token)
    if not m:
        return []
    path = m.group(1).rstrip("/")
    if _placeholder(path):
        return []
    missing = [p for p in _expand_braces(path) if not glob.glob(str(ROOT / p))]
    return [f"{where}: `{token}` does not exist" for _ in missing[:1]]


def _check_module(name: str, where: str) -> list[str]:
    """A first-party dotted name (`pdd_serve.serve.app:build_app`, `pdd_serve.policy.pick_md`):
    the longest importable module prefix, then attributes for the rest."""
    if name in NOT_MODULES:
        return []
    parts = name.replace(":", ".").split(".")
    for i in range(len(parts), 0, -1):
        modname = ".".join(parts[:i])
        try:
            if importlib.util.find_spec(modname) is None:
                continue
        except (ImportError, ValueError):
            continue
        try:
            obj = importlib.import_module(modname)
        except Exception as e:  # noqa: BLE001 - any failure to import is what this reports
            return [f"{where}: `{name}`: importing {modname} fails: {type(e).__name__}: {e}"]
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return [f"{where}: `{name}`: {modname} has no {'.'.join(parts[i:])}"]
            obj = getattr(obj, attr)
        return []
    return [f"{where}: `{name}`: no such module"]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#+ (.*)$", _FENCE.sub("", path.read_text()), re.M):
        s = _slug(m.group(1))
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def _check_link(target: str, doc: Path, where: str) -> list[str]:
    if re.match(r"^[a-z]+:", target):
        return []
    file, _, anchor = target.partition("#")
    dest = (doc.parent / file).resolve() if file else doc
    if not dest.exists():
        return [f"{where}: link to {target}: no such file"]
    if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
        return [f"{where}: link to {target}: no heading #{anchor} in {dest.name}"]
    return []


def _check_python_block(code: str, where: str) -> list[str]:
    """A python example's first-party imports resolve."""
    problems = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FIRST_PARTY:
            problems += [p for a in node.names for p in _check_module(f"{node.module}.{a.name}", where)]
        elif isinstance(node, ast.Import):
            problems += [p for a in node.names if a.name.split(".")[0] in FIRST_PARTY
                         for p in _check_module(a.name, where)]
    return problems


def _where(doc: Path) -> str:
    return str(doc.relative_to(ROOT)) if doc.is_relative_to(ROOT) else doc.name


def _read(text: str, doc: Path) -> tuple[list[list[str]], list[str]]:
    """One markdown document: (the commands it shows, what is already wrong in it: its paths,
    modules, python examples and links)."""
    where = _where(doc)
    text = _skip_sections(text)
    bash, python, prose = _blocks(text)
    out: list[str] = []
    command_lines = [line for block in bash for line in _shell_lines(block)]
    command_lines += [s for s in _spans(prose) if _COMMAND_SPAN.match(s)]
    commands: list[list[str]] = []
    for line in command_lines:
        try:
            todo = _simple_commands(line)
        except ValueError as e:
            out.append(f"{where}: can't parse `{line}`: {e}")
            continue
        while todo:
            words = todo.pop(0)
            if words[0] == "ray" and len(words) > 2 and words[1] == "exec":  # the command it runs on the head
                todo += _simple_commands(words[-1])
                words = words[:-1]
            commands.append(words)
            out += [p for w in words for p in _check_path(w, where)]
    for s in _spans(prose):
        out += _check_path(s, where)
        if _MODULE.match(s):
            out += _check_module(s, where)
    for code in python:
        out += _check_python_block(code, where)
    for m in _LINK.finditer(prose):
        out += _check_link(m.group(1), doc, where)
    return commands, out


def problems(docs: dict[Path, str]) -> list[str]:
    """Everything in these markdown documents (path -> text) that no longer matches the code. The
    commands of every document run their --help together, a few at a time."""
    out: list[str] = []
    tasks: list[tuple[list[str], str]] = []
    for doc, text in docs.items():
        commands, found = _read(text, doc)
        out += found
        tasks += [(words, _where(doc)) for words in commands]
    with ThreadPoolExecutor(HELP_WORKERS) as pool:
        for found in pool.map(lambda task: _check_runnable(*task), tasks):
            out += found
    return list(dict.fromkeys(out))


# ---- the tests ---------------------------------------------------------------------------------


def test_every_command_path_module_and_link_in_the_docs_is_current():
    assert len(DOCS) > 8, "docs/ holds the usage, design, results... pages"
    found = problems({doc: doc.read_text() for doc in DOCS})
    assert not found, "\n".join(found)


def test_the_readme_is_short_and_keeps_the_ci_test_command():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move the detail to docs/"
    # .ci/run takes the line after ```bash after the marker, as it is
    i = lines.index("<!-- test-command -->")
    assert lines[i + 1] == "```bash" and lines[i + 3] == "```"
    assert lines[i + 2].startswith("python3 -m venv .venv && ") and "pytest" in lines[i + 2]


def test_the_checks_catch_a_stale_command_flag_path_module_and_link(tmp_path):
    doc = tmp_path / "planted.md"
    text = "\n".join([
        "# Planted", "",
        "```bash",
        "python -m pdd_serve.no_such_module run",
        "pdd compare --no-such-flag 3",
        "pdd no-such-command",
        "serve run graphs/no_such_graph.yaml",
        "python evaluations/no_such_bench.py --repeats 1",
        "pdd compare --emulate emulated_70b --repeats 1      # current: no problem",
        "pdd compare --graphs graphs/pdd.yaml,graphs/no_such_listed.yaml",
        "```", "",
        "Also `python -m evaluations.sim.validate RUN --no-such-option`, `pdd_serve.policy.no_such_function`",
        "and [a page](no-such-page.md), [a heading](#no-such-heading).",
        "",
        "## Paths that changed",
        "",
        "`evaluations/bench_engine.py` -> `evaluations/bench/engine.py` (old names on purpose: skipped)",
    ])
    found = problems({doc: text})
    expected = ["pdd_serve.no_such_module", "--no-such-flag", "`no-such-command` is not a subcommand",
                "graphs/no_such_graph.yaml", "evaluations/no_such_bench.py", "--no-such-option",
                "no_such_function", "no-such-page.md", "#no-such-heading", "graphs/no_such_listed.yaml"]
    for e in expected:
        assert any(e in p for p in found), f"missed {e!r} in {found}"
    assert not any("emulated_70b" in p or "bench_engine" in p or "graphs/pdd.yaml" in p for p in found), found
