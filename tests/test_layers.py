"""The house's two import rules (docs/architecture.md), read from the source: `difftest/` never
imports `runners/` (engines live behind a process boundary, in their own environments) nor
`dashboards/` (the CLI names the dashboard's parser by string), and no two difftest modules import
each other, directly or round a longer circle, at the top of a file or inside a function."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path, package: str = "difftest") -> dict[str, set[str]]:
    """module -> every module name it imports (absolute; `from pkg import mod` gives pkg and pkg.mod)."""
    files = {module_name(p, root): p for p in (root / package).rglob("*.py")}
    out = {}
    for name, path in files.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                found.add(target)
                found |= {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in files}
        out[name] = found
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in graph or w == v:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_difftest_never_imports_the_runners_or_the_dashboard():
    bad = sorted((m, d) for m, deps in imports(REPO).items() for d in deps
                 if d.split(".")[0] in ("runners", "dashboards"))
    assert not bad, f"difftest modules importing runners/ or dashboards/: {bad}"


def test_no_import_circle_among_difftest_modules():
    assert circles(imports(REPO)) == []


def test_the_checks_see_a_circle_and_an_import_of_the_runners(tmp_path):
    """Both tests above can fail: a package whose two modules import each other (one of them inside a
    function, one relatively) and import runners/."""
    pkg = tmp_path / "difftest"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    from runners.cpu_engine.defects import DEFECTS\n")
    graph = imports(tmp_path)
    assert circles(graph) == [["difftest.a", "difftest.sub.b"]]
    assert "runners.cpu_engine.defects" in graph["difftest.sub.b"]
