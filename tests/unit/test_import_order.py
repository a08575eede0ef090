"""The import order documented in docs/ARCHITECTURE.md holds for every import in cpuckpt, in functions too.

The layers are read from the block between ``<!-- import-order -->`` and ``<!-- /import-order -->``
in docs/ARCHITECTURE.md (one line per layer, bottom first: ``<layer name>: <module> <module> ...``,
module names relative to ``cpuckpt``, ``pkg.*`` for every module of a subpackage). A module may
import only modules of its own layer or below; no two modules may import each other in a cycle;
every module must have a layer; nothing in ``cpuckpt`` imports ``cpuckpt.integrations``. The
integrations (``integrations/``, installed as ``cpuckpt.integrations``) sit above every layer.
"""

from __future__ import annotations

import ast
import shutil
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- import-order -->", "<!-- /import-order -->"


def read_layers(doc: Path) -> list[tuple[str, list[str]]]:
    text = doc.read_text()
    block = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    layers = []
    for line in block.splitlines():
        line = line.strip().strip("`")
        if not line or line.startswith(("```", "#")):
            continue
        name, _, modules = line.partition(":")
        layers.append((name.strip(), modules.split()))
    return layers


def module_names(package_dir: Path) -> dict[str, Path]:
    """``cpuckpt.x.y`` -> file, for every module of the package (``__init__`` as the package name)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = ["cpuckpt", *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """Every cpuckpt module ``name`` imports (module level, functions, classes), with line numbers."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            # ``from cpuckpt.transfer import files`` imports the module cpuckpt.transfer.files
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        for t in targets:
            if t == "cpuckpt" or t.startswith("cpuckpt."):
                found.append((t, node.lineno))
    return found


def check_import_order(package_dir: Path, doc: Path) -> list[str]:
    """Violations of the documented order, as readable lines (empty when the order holds)."""
    layers = read_layers(doc)
    modules = module_names(package_dir)
    known = set(modules)
    level: dict[str, int] = {}
    problems = []
    for rank, (_, patterns) in enumerate(layers):
        for pattern in patterns:
            full = "cpuckpt" if pattern == "cpuckpt" else f"cpuckpt.{pattern}"
            matched = [m for m in modules if m == full or (full.endswith(".*") and m.startswith(full[:-1]))]
            if full.endswith(".*"):
                matched.append(full[:-2])  # the subpackage's __init__
            if not [m for m in matched if m in modules]:
                problems.append(f"ARCHITECTURE.md names {pattern!r}, which is no module of cpuckpt")
            for m in matched:
                level.setdefault(m, rank)
    for m in modules:
        if m not in level and not m.startswith("cpuckpt.integrations"):
            problems.append(f"{m} has no layer in docs/ARCHITECTURE.md's import order")
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, path in modules.items():
        for target, line in imports_of(m, path, known):
            where = f"{path.relative_to(package_dir.parent)}:{line}"
            if target.startswith("cpuckpt.integrations"):
                problems.append(f"{where}: {m} imports {target}: the core never imports an integration")
                continue
            target = target if target in modules else target.rsplit(".", 1)[0]
            if target not in level or m not in level or target == m:
                continue
            graph[m].add(target)
            if level[target] > level[m]:
                problems.append(f"{where}: {m} ({layers[level[m]][0]}) imports {target} "
                                f"({layers[level[target]][0]}), a higher layer")
    problems.extend(_cycles(graph))
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per import cycle (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append("import cycle: " + " <-> ".join(sorted(comp)))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cpuckpt_imports_follow_the_documented_order():
    problems = check_import_order(REPO / "cpuckpt", REPO / "docs" / "ARCHITECTURE.md")
    assert not problems, "\n".join(problems)


def test_a_planted_back_import_inside_a_function_is_caught(tmp_path):
    """Regression guard for the guard: a lower layer importing the API (lazily, in a function) fails."""
    pkg = tmp_path / "cpuckpt"
    shutil.copytree(REPO / "cpuckpt", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    layout = pkg / "format" / "layout.py"
    layout.write_text(layout.read_text() + textwrap.dedent("""

        def _planted():
            from cpuckpt.api import save

            return save
        """))
    problems = check_import_order(pkg, REPO / "docs" / "ARCHITECTURE.md")
    assert any("cpuckpt.format.layout" in p and "imports cpuckpt.api" in p for p in problems), problems


def test_a_planted_cycle_within_one_layer_is_caught(tmp_path):
    pkg = tmp_path / "cpuckpt"
    shutil.copytree(REPO / "cpuckpt", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    manifest = pkg / "format" / "manifest.py"
    manifest.write_text(manifest.read_text() + "\n\ndef _planted():\n    from cpuckpt.format import layout\n")
    layout = pkg / "format" / "layout.py"
    layout.write_text(layout.read_text() + "\n\ndef _planted():\n    from . import manifest\n")
    problems = check_import_order(pkg, REPO / "docs" / "ARCHITECTURE.md")
    assert any(p.startswith("import cycle:") and "cpuckpt.format.layout" in p for p in problems), problems


def test_an_unmapped_module_is_caught(tmp_path):
    pkg = tmp_path / "cpuckpt"
    shutil.copytree(REPO / "cpuckpt", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "newthing.py").write_text('"""x"""\n')
    problems = check_import_order(pkg, REPO / "docs" / "ARCHITECTURE.md")
    assert "cpuckpt.newthing has no layer in docs/ARCHITECTURE.md's import order" in problems


def test_every_public_name_loads_on_first_use():
    """``cpuckpt``'s names load lazily (PEP 562) from the module each is listed under: every name of ``__all__`` has
    a home there and resolves to that module's object; nothing is listed that ``__all__`` lacks."""
    import importlib

    import cpuckpt

    homes = cpuckpt._HOMES
    assert set(cpuckpt.__all__) == {*homes, "__version__"}
    for name, home in homes.items():
        assert getattr(cpuckpt, name) is getattr(importlib.import_module(home), name), name
    assert set(cpuckpt.__all__) <= set(dir(cpuckpt))
