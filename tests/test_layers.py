"""The package's import graph, read from the AST, obeys the layer table of docs/architecture.md.

Every import counts: module level, inside functions (lazy) and under ``TYPE_CHECKING``.
The test fails on any cycle between files and on any arrow the layer rules forbid.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "attnplug"
SKIP_DIRS = {"tests", "docs", ".venv", ".venv-vllm", "build", "dist", ".git", "__pycache__", ".hypothesis"}

# (importer layer, the layers it may import). The first prefix that matches a module is its
# layer; a layer may always import itself. The package roots (``attnplug``, ``attnplug.runner``)
# are façades that re-export lazily and may import anything but the commands.
LAYERS: list[tuple[str, set[str]]] = [
    ("core", set()),
    ("cache_groups", {"core"}),
    ("backends", {"core", "cache_groups"}),
    ("plugins.conformance", {"core", "cache_groups", "backends", "plugins", "runner.step"}),
    ("plugins", {"core", "cache_groups", "backends"}),
    ("runner.step.fast", {"core"}),
    ("runner.step", {"core", "cache_groups", "runner.step.fast"}),
    ("runner.models", {"core", "cache_groups", "plugins"}),
    ("runner.execute", {"runner.step", "runner.models", "core", "cache_groups", "plugins"}),
    ("runner.parallel", {"runner.execute", "runner.step", "runner.models", "core", "cache_groups", "plugins"}),
    ("runner.serve", {"runner.execute", "runner.step", "core", "cache_groups"}),
    ("runner.api", {"runner.serve", "runner.execute", "runner.step", "runner.models", "core", "cache_groups",
                    "plugins"}),
    ("runner.commands", {"*"}),
    ("runner.data", set()),
    ("runner", {"*"}),  # attnplug.runner (__init__): the public API, lazily
    ("", {"*"}),  # attnplug (__init__, __main__)
]
NOBODY_IMPORTS = "runner.commands"
"""Only the commands themselves (and ``__main__``) import ``runner.commands``."""
API = "runner.api"
"""The server (``runner/api/``) sits above ``runner/serve/``: only ``runner.commands`` imports it."""
FAST = "runner.step.fast"
FAST_IMPORTERS = {f"{PKG}.runner.step.kernels", f"{PKG}.runner.step.compiler"}
"""The compiled kernels sit behind one seam: only ``runner/step/kernels.py`` (and the
compiler that chooses the kernels) import ``runner.step.fast``."""


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PKG, *parts])


def imports_of(path: Path, mod: str) -> set[str]:
    """Every ``attnplug`` module name ``path`` imports, wherever the import stands."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    base = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name == PKG or a.name.startswith(PKG + "."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == PKG or target.startswith(PKG + "."):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)  # from pkg import submodule
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the package's files (arrows into a package's
    ``__init__`` from inside that package are not counted: Python runs it first anyway)."""
    files = {}
    for p in sorted(root.rglob("*.py")):
        if not any(part in SKIP_DIRS for part in p.relative_to(root).parts):
            files[module_name(p, root)] = p

    def resolve(name: str) -> str | None:
        while name not in files:
            if "." not in name:
                return None
            name = name.rsplit(".", 1)[0]
        return name

    graph: dict[str, set[str]] = defaultdict(set)
    for m, p in files.items():
        for t in imports_of(p, m):
            r = resolve(t)
            if r and r != m and not (files[r].name == "__init__.py" and m.startswith(r + ".")):
                graph[m].add(r)
        graph.setdefault(m, set())
    return dict(graph)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on, stack, out = set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def layer_of(mod: str) -> str:
    rel = mod[len(PKG) + 1:] if mod.startswith(PKG + ".") else ""
    for name, _ in LAYERS:
        if name == "" or rel == name or rel.startswith(name + "."):
            return name
    raise AssertionError(f"{mod} is in no layer of LAYERS")


def forbidden_arrows(graph: dict[str, set[str]]) -> list[str]:
    allowed = dict(LAYERS)
    bad = []
    for m, targets in sorted(graph.items()):
        src = layer_of(m)
        for t in sorted(targets):
            dst = layer_of(t)
            if dst == NOBODY_IMPORTS and src != NOBODY_IMPORTS and m != f"{PKG}.__main__":
                bad.append(f"{m} -> {t} (nothing imports runner/commands)")
            elif dst == API and src not in (API, NOBODY_IMPORTS):
                bad.append(f"{m} -> {t} (only runner/commands imports runner.api)")
            elif dst == FAST and src != FAST and m not in FAST_IMPORTERS:
                bad.append(f"{m} -> {t} (only runner/step/kernels.py and compiler.py import runner.step.fast)")
            elif dst != src and "*" not in allowed[src] and dst not in allowed[src]:
                bad.append(f"{m} -> {t} ({src or 'attnplug'} may import only "
                           f"{', '.join(sorted(allowed[src])) or 'nothing of ours'})")
    return bad


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_is_read(graph):
    # a reader that saw no arrows would pass every rule
    assert len(graph) > 100
    assert "attnplug.runner.step.input_batch" in graph["attnplug.runner.step.compiler"]
    lazy = "attnplug.backends.triton.builder"  # imported inside a method of the backend class
    assert lazy in graph["attnplug.backends.triton.backend"]


def test_no_import_cycles_between_files(graph):
    assert cycles(graph) == []


def test_no_forbidden_arrows(graph):
    assert forbidden_arrows(graph) == []


def test_the_checks_can_fail(tmp_path):
    """A planted cycle and a planted upward arrow are found (the checks have teeth)."""
    for rel, text in {
        "core/__init__.py": "",
        "core/a.py": "from attnplug.core import b\n",
        "core/b.py": "def f():\n    from attnplug.core.a import x\n",
        "cache_groups/__init__.py": "",
        "cache_groups/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from attnplug.runner.step.compiler import StepCompiler\n",
        "runner/__init__.py": "", "runner/step/__init__.py": "", "runner/step/compiler.py": "",
        "runner/step/fast/__init__.py": "", "runner/step/prepare.py": "from attnplug.runner.step import fast\n",
        "runner/api/__init__.py": "", "runner/api/app.py": "",
        "runner/models/m.py": "from attnplug.runner.api.app import create_app\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    g = import_graph(tmp_path)
    assert cycles(g) == [["attnplug.core.a", "attnplug.core.b"]]
    assert forbidden_arrows(g) == ["attnplug.cache_groups.c -> attnplug.runner.step.compiler "
                                   "(cache_groups may import only core)",
                                   "attnplug.runner.models.m -> attnplug.runner.api.app "
                                   "(only runner/commands imports runner.api)",
                                   "attnplug.runner.step.prepare -> attnplug.runner.step.fast "
                                   "(only runner/step/kernels.py and compiler.py import runner.step.fast)"]


def test_small_modules():
    """No ``.py`` file over 400 lines; no function over 80 lines (numbered sections inside a
    long function are named functions waiting to be born)."""
    big = [f"{p.relative_to(ROOT)} ({n} lines)" for p in ROOT.rglob("*.py")
           if not any(part in SKIP_DIRS for part in p.relative_to(ROOT).parts)
           for n in [len(p.read_text(encoding="utf-8").splitlines())] if n > 400]
    assert big == []
    long_fns = []
    for p in ROOT.rglob("*.py"):
        if any(part in SKIP_DIRS for part in p.relative_to(ROOT).parts):
            continue
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long_fns.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert long_fns == []


def test_docstrings_cite_documents_that_exist():
    """"design notes §…" names a document that is not in the repository."""
    cites = [f"{p.relative_to(ROOT)}:{i}" for p in ROOT.rglob("*.py")
             if not any(part in SKIP_DIRS for part in p.relative_to(ROOT).parts)
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if "design notes" in line.lower()]
    assert cites == []


def test_the_compiled_path_is_named_only_behind_its_seam():
    """``grep -rn native runner/step`` finds the word only in ``kernels.py``, ``compiler.py``
    and ``fast/`` (issue 30): no step module takes a ``native=`` flag or names the compiled
    files; the others see the kernels through ``StepKernels``."""
    step = ROOT / "runner" / "step"
    seam = {step / "kernels.py", step / "compiler.py"}
    named = [f"{p.relative_to(ROOT)}:{i}" for p in sorted(step.rglob("*.py"))
             if p not in seam and (step / "fast") not in p.parents
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if "native" in line]
    assert named == []
