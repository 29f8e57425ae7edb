"""The package's layers: every import of every module of nmt, lazy ones inside functions included, points
down the declared order, and no import circle exists.

The order, bottom to top (the README's layout section shows the same). A module may import modules of
the layers below its own and of its own package; two units of one layer are side by side and import
neither each other (`nmt.data` and `nmt.model`: data knows nothing of the model, the model nothing of
files). The package's own `nmt/__init__.py` (its version) is at the bottom.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nmt

LAYERS = [
    ["nmt", "nmt.errors", "nmt.tokens", "nmt.progress", "nmt.languages"],  # nothing of nmt
    ["nmt.limits"],  # the bounds of every number the commands take
    ["nmt.atomic", "nmt.config"],
    ["nmt.output", "nmt.device"],
    ["nmt.subword", "nmt.score", "nmt.plot", "nmt.sentences"],
    ["nmt.data", "nmt.model"],  # side by side
    ["nmt.checkpoint"],
    ["nmt.formats", "nmt.untrained", "nmt.shortlist"],
    ["nmt.translate"],
    ["nmt.train", "nmt.serve"],
    ["nmt.backtranslate"],  # a reverse model's translations of monolingual text, for `nmt run` to train on
    ["nmt.pipeline", "nmt.distill"],  # side by side: `nmt run`, and a student from a teacher
    ["nmt.cli"],
    ["nmt.__main__"],
]
ROOT = Path(nmt.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def imported(name: str, tree: ast.AST) -> set[str]:
    """The nmt modules `name` imports anywhere in its source: at the top, in functions, under `if`."""
    package = name if is_package(name) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from nmt import atomic` imports the module nmt.atomic; `from nmt.x import f`, nmt.x
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
            found.update(subs or [base])
    return {m for m in found if m == "nmt" or m.startswith("nmt.")}


def graph() -> dict[str, set[str]]:
    """Module -> the modules importing it runs: those named, and the packages above them that it is not
    inside (importing nmt.translate.search from outside runs nmt/translate/__init__.py first)."""
    edges = {}
    for name, path in MODULES.items():
        targets = set()
        for m in imported(name, ast.parse(path.read_text(encoding="utf-8"), str(path))):
            assert m in MODULES, f"{name} imports {m}, which is not a module of nmt"
            targets.add(m)
            parts = m.split(".")
            for i in range(1, len(parts)):
                parent = ".".join(parts[:i])
                if not (name == parent or name.startswith(parent + ".")):
                    targets.add(parent)
        edges[name] = targets - {name}
    return edges


def unit(name: str) -> str:
    """The entry of LAYERS that `name` belongs to: the longest one that is it or a package above it."""
    units = [u for layer in LAYERS for u in layer if name == u or (u != "nmt" and name.startswith(u + "."))]
    assert units, f"{name} is in no layer: add it to LAYERS here and to the README's layout"
    return max(units, key=len)


def test_every_module_has_a_layer_and_the_layers_name_real_modules():
    for name in MODULES:
        unit(name)
    for layer in LAYERS:
        for u in layer:
            assert u in MODULES, f"LAYERS names {u}, which is not a module or package of nmt"


def test_every_import_points_down_the_layers():
    level = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    wrong = []
    for name, targets in graph().items():
        for target in sorted(targets):
            a, b = unit(name), unit(target)
            if a != b and level[b] >= level[a]:
                side = "beside" if level[b] == level[a] else "above"
                wrong.append(
                    f"{name} imports {target}, {side} it ({b} is in layer {level[b]}, {a} in {level[a]})"
                )
    assert not wrong, "\n".join(wrong)


def test_no_import_circle():
    edges = graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                circles.append(sorted([v, *component]))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_walk_sees_lazy_imports_and_imports_of_modules_by_name():
    tree = ast.parse(
        "from nmt import atomic\n"
        "def f():\n"
        "    from nmt.checkpoint import load_model\n"
        "    import nmt.translate.search\n"
        "    if True:\n"
        "        from nmt.formats import META_FILE\n"
    )
    assert imported("nmt.x", tree) == {"nmt.atomic", "nmt.checkpoint", "nmt.translate.search", "nmt.formats"}
