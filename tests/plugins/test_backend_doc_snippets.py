"""docs/writing-a-backend.md stays true: every ```python snippet compiles, its imports
import, and a snippet that uses no name it does not define (a *complete* one) runs.

A snippet that names something defined elsewhere (``model``, ``kv_cache_config``...) is a
fragment: only its syntax and its ``import`` statements are checked, and it may define no
class or function (a definition must show its imports and base classes). The example plugin's
folder is put on ``sys.path`` so the snippets' lazy imports of it resolve.
"""

from __future__ import annotations

import ast
import builtins
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "writing-a-backend.md"
EXAMPLE = ROOT / "docs" / "examples" / "plugin-example"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets(text: str) -> list[tuple[int, str]]:
    """``[(line number of the fence, source)]`` of every python block of ``text``."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


def free_names(tree: ast.AST) -> set[str]:
    """Names read but bound nowhere in ``tree`` (scope-insensitive) and not builtins."""
    bound, loaded = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound


SNIPPETS = snippets(DOC.read_text())


@pytest.fixture(autouse=True)
def _example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    yield
    for mod in [m for m in sys.modules if m.startswith("attnplug_sdpa_example")]:
        del sys.modules[mod]


def test_the_doc_has_complete_snippets():
    complete = [line for line, src in SNIPPETS if not free_names(ast.parse(src))]
    assert len(SNIPPETS) >= 6 and len(complete) >= 4, (len(SNIPPETS), complete)


@pytest.mark.parametrize("line,src", SNIPPETS, ids=[f"line{line}" for line, _ in SNIPPETS])
def test_snippet(line, src):
    where = f"{DOC.name}:{line}"
    tree = ast.parse(src, filename=where)
    missing = free_names(tree)
    defines = [n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
    assert not (missing and defines), (f"{where}: the snippet defines {defines} but uses names it never "
                                       f"imports or defines: {sorted(missing)}")
    if missing:  # a fragment (a call site: `model`, `kv_cache_config`...): its imports must import
        imports = ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))],
                             type_ignores=[])
        exec(compile(imports, where, "exec", dont_inherit=True), {"__name__": "doc_snippet"})
        return
    module = types.ModuleType("doc_snippet")  # a real module: dataclasses look their module up
    sys.modules["doc_snippet"] = module
    try:
        exec(compile(tree, where, "exec", dont_inherit=True), module.__dict__)
        _check_definitions(module.__dict__, where)
    finally:
        del sys.modules["doc_snippet"]


def _check_definitions(ns: dict, where: str) -> None:
    """A backend class a snippet defines must pass registration; a builder must build."""
    from attnplug import AttentionBackend, AttentionMetadataBuilder, CommonAttentionMetadata
    from attnplug.cache_groups.specs import FullAttentionSpec
    from attnplug.core import BuilderConfig
    from attnplug.plugins.registry import check_backend_class, check_declarations

    for obj in list(ns.values()):
        if not isinstance(obj, type) or obj.__module__ != "doc_snippet":
            continue
        if issubclass(obj, AttentionBackend):
            name, problems = check_backend_class(obj)
            assert not problems and not check_declarations(obj), (where, problems)
            assert issubclass(obj.get_builder_cls(), AttentionMetadataBuilder), where
        elif issubclass(obj, AttentionMetadataBuilder):
            spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8)
            builder = obj(spec, ["l0"], BuilderConfig(2, 16, 16), "cpu")
            cm = CommonAttentionMetadata.from_lengths([0, 3], [3, 1], [[1, 0], [2, 0]], block_size=4)
            assert builder.build(0, cm) is not None, where
