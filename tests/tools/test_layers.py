"""The package's layers point one way, and its modules stay small.

    options, _dynamo  <-  ir  <-  patterns  <-  kernels  <-  rewriter  <-  gradcheck  <-  cli, kernelgraft

A module may import from its own layer or the ones to its left, never to its right; the module graph
has no cycle; a function-level import of kernelgraft's own modules needs a comment on its line
saying `import here:` and why (none does today); no module is over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "kernelgraft"
LAYERS = [
    ("kernelgraft.options", "kernelgraft._dynamo", "kernelgraft._warnings"),
    ("kernelgraft.ir",),
    ("kernelgraft.patterns",),
    ("kernelgraft.kernels",),
    ("kernelgraft.rewriter",),
    ("kernelgraft.gradcheck",),
    ("kernelgraft.cli", "kernelgraft.__main__", "kernelgraft"),
]
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = ["kernelgraft", *p.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def layer(module: str) -> int:
    """The layer of a module: the longest prefix named in LAYERS."""
    best, depth = None, -1
    for i, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and n.count(".") > depth:
                best, depth = i, n.count(".")
    assert best is not None, module
    return best


def _imports(module: str, text: str, is_package: bool = False):
    """(imported kernelgraft module, line, at function level, the line's text) for each import."""
    tree = ast.parse(text)
    lines = text.splitlines()
    package = module if is_package else module.rpartition(".")[0]
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}  # fmt: skip
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import sub` names the submodule where there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            if t == "kernelgraft" or t.startswith("kernelgraft."):
                while t not in MODULES:  # kernelgraft.x.y where y is a name in module x
                    t = t.rpartition(".")[0]
                yield t, node.lineno, id(node) in nested, lines[node.lineno - 1]


EDGES = {m: list(_imports(m, p.read_text(), p.name == "__init__.py")) for m, p in MODULES.items()}


def back_edges(edges: dict) -> list[str]:
    return [
        f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)}), line {line}"
        for m, found in edges.items()
        for t, line, _, _ in found
        if layer(t) > layer(m) and not m.startswith(t + ".")
    ]


def unexplained_local_imports(edges: dict) -> list[str]:
    return [
        f"{m}:{line}: {text.strip()}"
        for m, found in edges.items()
        for t, line, nested, text in found
        if nested and "import here:" not in text
    ]


# what the rewriter may import of kernels/: the family interface and what every family shares, never
# a family's own package (rows/, lm_head/, lora/): a new family touches nothing in rewriter/
FAMILY_INTERFACE = {
    "kernelgraft.kernels",
    "kernelgraft.kernels.family",
    "kernelgraft.kernels.fallback",
    "kernelgraft.kernels.launching",
}


def family_imports_in_rewriter(edges: dict) -> list[str]:
    return [
        f"{m} imports {t}, line {line}"
        for m, found in edges.items()
        if m.startswith("kernelgraft.rewriter")
        for t, line, _, _ in found
        if t.startswith("kernelgraft.kernels") and t not in FAMILY_INTERFACE
    ]


def test_the_rewriter_imports_kernels_only_through_the_family_interface():
    bad = family_imports_in_rewriter(EDGES)
    assert not bad, "\n".join(bad)


def test_a_family_import_inside_the_rewriter_is_found():
    src = "from ..kernels import FAMILIES\nfrom ..kernels.rows.ops import adding_input\n"
    edges = {"kernelgraft.rewriter.residual": list(_imports("kernelgraft.rewriter.residual", src))}
    assert family_imports_in_rewriter(edges) == [
        "kernelgraft.rewriter.residual imports kernelgraft.kernels.rows.ops, line 2"
    ]


def test_the_layers_are_known():
    # a new top-level module or folder is placed in LAYERS on purpose
    for m in MODULES:
        layer(m)


def test_no_import_points_up_a_layer():
    bad = back_edges(EDGES)
    assert not bad, "\n".join(bad)


def test_no_function_level_import_of_the_package_without_a_reason():
    bad = unexplained_local_imports(EDGES)
    assert not bad, "\n".join(bad)


def test_the_module_graph_has_no_cycle():
    graph = {m: {t for t, *_ in edges if t != m and not m.startswith(t + ".")} for m, edges in EDGES.items()}
    state: dict = {}
    path: list = []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                pytest.fail("import cycle: " + " -> ".join(path[path.index(t) :] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_checks_find_what_they_look_for():
    # a module of ir/ importing the rewriter, at the top and inside a function
    src = "from ..rewriter import optimize\n\n\ndef f():\n    from ..kernels import op_for\n"
    edges = {"kernelgraft.ir.graph": list(_imports("kernelgraft.ir.graph", src))}
    assert [t for t, *_ in edges["kernelgraft.ir.graph"]] == ["kernelgraft.rewriter", "kernelgraft.kernels"]
    assert len(back_edges(edges)) == 2
    assert unexplained_local_imports(edges) == ["kernelgraft.ir.graph:5: from ..kernels import op_for"]


def test_no_module_is_over_500_lines():
    big = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, big
