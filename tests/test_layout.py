"""The code stays one a newcomer can live in: no module over 400 lines and no import cycles in the
app's packages (``ssd_chat/`` and ``tui/``).  An import inside a function counts: it is still a
dependency, and a cycle through one is how bottom-of-file imports and lazy workarounds start.
The engine's own layout is checked with the engine; here its modules only end an edge."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package name -> folder, as pyproject.toml installs them
PACKAGES = {"ssd_chat": ROOT / "ssd_chat", "ssd_chat.tui": ROOT / "tui", "ssd_chat.engine": ROOT / "engine"}
CHECKED = ("ssd_chat", "ssd_chat.tui")  # the packages whose modules are held to the rules below
MAX_LINES = 400


def module_name(path: Path, packages: dict[str, Path]) -> str | None:
    for pkg, folder in sorted(packages.items(), key=lambda kv: -len(kv[0])):
        if folder in path.parents:
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([pkg, *parts])
    return None


def module_file(name: str, packages: dict[str, Path]) -> Path | None:
    for pkg, folder in sorted(packages.items(), key=lambda kv: -len(kv[0])):
        if name == pkg or name.startswith(pkg + "."):
            base = folder.joinpath(*name[len(pkg):].lstrip(".").split(".")) if name != pkg else folder
            for f in (base.with_suffix(".py"), base / "__init__.py"):
                if f.is_file():
                    return f
            return None
    return None


def imports_of(path: Path, packages: dict[str, Path]) -> set[str]:
    """The modules of ``packages`` that ``path`` imports, anywhere in it (``from a import b``: a.b if that is a module)."""
    name = module_name(path, packages)
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if module_file(a.name, packages))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for a in node.names:
                if module_file(f"{base}.{a.name}", packages):
                    out.add(f"{base}.{a.name}")
                elif module_file(base, packages):
                    out.add(base)
    out.discard(name)
    return out


def checked_files(packages: dict[str, Path], checked: tuple[str, ...]) -> list[Path]:
    files = []
    for pkg in checked:
        for f in sorted(packages[pkg].rglob("*.py")):
            if module_name(f, packages) is not None and module_name(f, packages).startswith(pkg):
                inner = [p for p in checked if p != pkg and p.startswith(pkg + ".") and packages[p] in f.parents]
                if not inner:  # a nested package's files are listed under it
                    files.append(f)
    return files


def cycles(packages: dict[str, Path], checked: tuple[str, ...]) -> list[list[str]]:
    """Strongly connected groups of more than one module among the checked packages (Tarjan)."""
    files = checked_files(packages, checked)
    graph = {module_name(f, packages): imports_of(f, packages) for f in files}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue  # outside the checked packages
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("path", checked_files(PACKAGES, CHECKED), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_at_most_400_lines(path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines: split it by concept"


def test_no_import_cycles_in_the_app():
    assert cycles(PACKAGES, CHECKED) == []


def test_the_cycle_check_sees_an_import_inside_a_function(tmp_path):
    pkg = tmp_path / "app"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("from .options import Target\n\ndef main():\n    from . import bench\n")
    (pkg / "options.py").write_text("Target = str\n")
    (pkg / "bench.py").write_text("def command():\n    from .cli import main\n")
    assert cycles({"app": pkg}, ("app",)) == [["app.bench", "app.cli"]]
    (pkg / "bench.py").write_text("from .options import Target\n")
    assert cycles({"app": pkg}, ("app",)) == []
