"""The code stays one a newcomer can live in: no module of the installed packages over 400 lines,
no import cycles in the app's packages (``ssd_chat/``, ``tui/`` and the engine), their folders import one
way (the engine's layers, ``docs/design.md``), and code outside the engine imports only the names
``ssd_chat.engine`` exports.  An import inside a
function counts, and so does one for type checking only: it is still a dependency, and a cycle through one
is how bottom-of-file imports and lazy workarounds start.  The measurement scripts in ``lab/`` are not
installed, and nothing installed imports them."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def installed_packages(pyproject: Path) -> dict[str, Path]:
    """Package name -> folder, as pyproject.toml's ``packages`` and ``package-dir`` install them."""
    cfg = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["setuptools"]
    dirs = cfg.get("package-dir", {})

    def folder(pkg: str) -> Path:
        if pkg in dirs:
            return pyproject.parent / dirs[pkg]
        parent, _, leaf = pkg.rpartition(".")
        return folder(parent) / leaf if parent else pyproject.parent / pkg

    return {pkg: folder(pkg) for pkg in cfg["packages"]}


PACKAGES = installed_packages(ROOT / "pyproject.toml")
CHECKED = ("ssd_chat", "ssd_chat.tui", "ssd_chat.engine")  # the packages held to the no-cycle rule
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


def import_statements(path: Path, packages: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in ``path``, anywhere in it, relative ones resolved
    (``import a.b``: ("a.b", []))."""
    name = module_name(path, packages)
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            out.append((base, [a.name for a in node.names]))
    return out


def imports_of(path: Path, packages: dict[str, Path]) -> set[str]:
    """The modules of ``packages`` that ``path`` imports, anywhere in it (``from a import b``: a.b if that is a module)."""
    out: set[str] = set()
    for base, names in import_statements(path, packages):
        if not names and module_file(base, packages):
            out.add(base)
        for n in names:
            if module_file(f"{base}.{n}", packages):
                out.add(f"{base}.{n}")
            elif module_file(base, packages):
                out.add(base)
    out.discard(module_name(path, packages))
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
    """Strongly connected groups of more than one module among the checked packages."""
    return knots({module_name(f, packages): imports_of(f, packages) for f in checked_files(packages, checked)})


def folders(packages: dict[str, Path], base: str) -> dict[str, set[str]]:
    """The folders (sub-packages) of package ``base`` and the folders each imports; a module directly in
    ``base`` is a node of its own (``base/__init__.py`` is none)."""
    def node(mod: str) -> str | None:
        return mod[len(base) + 1:].split(".")[0] if mod.startswith(base + ".") else None

    graph: dict[str, set[str]] = {}
    for f in checked_files(packages, tuple(packages)):
        me = node(module_name(f, packages))
        if me is not None:
            graph.setdefault(me, set()).update(n for m in imports_of(f, packages) if (n := node(m)) not in (None, me))
    return graph


def knots(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan)."""
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


def past_the_surface(packages: dict[str, Path], surface: set[str]) -> dict[str, list[str]]:
    """What code outside the engine (``ssd_chat/``'s other folders, ``tui/``) imports from it other than
    the names of ``ssd_chat.engine`` itself that ``surface`` lists: module -> those imports."""
    eng = "ssd_chat.engine"
    out: dict[str, list[str]] = {}
    for f in checked_files(packages, tuple(packages)):
        me = module_name(f, packages)
        if me == eng or me.startswith(eng + ".") or not me.startswith("ssd_chat."):
            continue
        bad = [f"{base}.{n}" if base == eng else base for base, names in import_statements(f, packages)
               if base.startswith(eng + ".") or base == eng and (not names or set(names) - surface)
               for n in (set(names) - surface if base == eng and names else [None])]
        if bad:
            out[me] = sorted(set(bad))
    return out


def imports_lab(path: Path) -> list[str]:
    """The ``lab`` modules ``path`` imports (absolute imports: a relative one cannot leave its package)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        found += [n for n in names if n == "lab" or n.startswith("lab.")]
    return found


def test_every_installed_package_is_a_folder_of_the_repository():
    assert set(PACKAGES) >= {"ssd_chat", "ssd_chat.engine", "ssd_chat.tui", "ssd_chat.bench", "ssd_chat.train"}
    for pkg, folder in PACKAGES.items():
        assert (folder / "__init__.py").is_file(), pkg
    # a sub-folder with code that pyproject.toml does not list would silently stay out of the wheel
    listed = set(PACKAGES.values())
    for folder in list(listed):
        for init in folder.rglob("__init__.py"):
            assert init.parent in listed, f"{init.parent.relative_to(ROOT)} is not in pyproject.toml's packages"


def test_the_lab_is_not_installed():
    assert (ROOT / "lab" / "__init__.py").is_file()
    assert not [p for p, f in PACKAGES.items() if p.split(".")[-1] == "lab" or f == ROOT / "lab" or ROOT / "lab" in f.parents]


def test_nothing_installed_imports_the_lab():
    files = checked_files(PACKAGES, tuple(PACKAGES))
    assert len(files) > 100
    assert {str(f.relative_to(ROOT)): imports_lab(f) for f in files if imports_lab(f)} == {}


def test_the_lab_import_check_sees_every_form(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom .lab import x\nimport laboratory\n\ndef g():\n    from lab.gpucheck import main\n    import lab\n")
    assert imports_lab(f) == ["lab.gpucheck", "lab"]


@pytest.mark.parametrize("path", checked_files(PACKAGES, tuple(PACKAGES)), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_at_most_400_lines(path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines: split it by concept"


def test_no_import_cycles_in_the_app():
    assert cycles(PACKAGES, CHECKED) == []


def test_the_engine_folders_import_one_way():
    assert knots(folders(PACKAGES, "ssd_chat.engine")) == []


def test_the_app_folders_import_one_way():
    graph = folders(PACKAGES, "ssd_chat")
    assert {"cli", "chat", "history", "server", "bench", "train", "tui", "engine"} <= set(graph)
    assert knots(graph) == []


def test_code_outside_the_engine_uses_only_its_surface():
    import ssd_chat.engine

    assert past_the_surface(PACKAGES, set(ssd_chat.engine.__all__)) == {}


def test_the_command_line_imports_no_torch():
    """``--help``, usage errors and the settings checks stay fast: the CLI and the engine's light names
    (its surface loads a name on first use) import no torch."""
    code = ("import sys\nimport ssd_chat.engine as e\nfrom ssd_chat.cli import app\ne.EngineConfig(mode='ssd')\n"
            "e.SamplingParams()\ntry:\n    app(['--help'])\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.stdout.splitlines()[-1:] == ["False"], r.stdout[-300:] + r.stderr[-2000:]


def test_the_folder_and_surface_checks_see_every_form(tmp_path):
    eng = tmp_path / "engine"
    (eng / "decode").mkdir(parents=True)
    (eng / "sampling").mkdir()
    app = tmp_path / "app"
    app.mkdir()
    for f in ("engine/__init__.py", "engine/decode/__init__.py", "engine/sampling/__init__.py", "app/__init__.py"):
        (tmp_path / f).write_text("")
    (eng / "decode" / "ar.py").write_text("from ..sampling.draw import sample\n")
    (eng / "sampling" / "draw.py").write_text("def sample():\n    from ..decode import ar\n")
    (app / "cli.py").write_text("from ..engine import Engine\n\ndef main():\n    from ..engine.decode import ar\n")
    pkgs = {"ssd_chat": tmp_path, "ssd_chat.engine": eng, "ssd_chat.engine.decode": eng / "decode",
            "ssd_chat.engine.sampling": eng / "sampling", "ssd_chat.app": app}
    assert knots(folders(pkgs, "ssd_chat.engine")) == [["decode", "sampling"]]
    assert folders(pkgs, "ssd_chat") == {"engine": set(), "app": {"engine"}}
    assert past_the_surface(pkgs, {"Engine"}) == {"ssd_chat.app.cli": ["ssd_chat.engine.decode"]}
    assert past_the_surface(pkgs, set()) == {"ssd_chat.app.cli": ["ssd_chat.engine.Engine", "ssd_chat.engine.decode"]}
    (eng / "sampling" / "draw.py").write_text("def sample():\n    pass\n")
    assert knots(folders(pkgs, "ssd_chat.engine")) == []


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


def project_bases(packages: dict[str, Path], pkg: str) -> dict[str, list[str]]:
    """Class (module.Class) -> its bases that are classes of the project, for every class in ``pkg``'s files: a
    base is the project's when its name is defined as a class in one of the installed packages."""
    defined = {n.name for f in checked_files(packages, tuple(packages)) for n in ast.walk(ast.parse(f.read_text(encoding="utf-8")))
               if isinstance(n, ast.ClassDef)}
    out = {}
    for f in checked_files(packages, tuple(p for p in packages if p == pkg or p.startswith(pkg + "."))):
        for n in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(n, ast.ClassDef):
                names = [ast.unparse(b).rpartition(".")[2] for b in n.bases]
                out[f"{module_name(f, packages)}.{n.name}"] = [b for b in names if b in defined and b != "object"]
    return out


def folder_cycles(packages: dict[str, Path], folders: tuple[str, ...]) -> list[str]:
    """The ``folders`` that reach themselves through imports, each module counting as the innermost folder that holds it."""
    def folder(mod: str) -> str | None:
        return max((p for p in folders if mod == p or mod.startswith(p + ".")), key=len, default=None)

    graph: dict[str, set[str]] = {p: set() for p in folders}
    for f in checked_files(packages, folders):
        src = folder(module_name(f, packages))
        graph[src] |= {d for m in imports_of(f, packages) if (d := folder(m)) not in (None, src)}

    def reached(a: str) -> set[str]:
        seen, todo = set(), [a]
        while todo:
            todo += [d for d in graph[todo.pop()] if d not in seen and not seen.add(d)]
        return seen

    return sorted(a for a in folders if a in reached(a))


def test_the_chat_view_is_composed_and_its_widgets_import_nothing_above_them():
    """No mixins in tui/: a class has at most one base of the project's (its behaviour is in objects it calls,
    in an order written in one place, not in a base-class list), and tui/widgets does not import tui/."""
    mixed = {c: b for c, b in project_bases(PACKAGES, "ssd_chat.tui").items() if len(b) > 1}
    assert mixed == {}
    assert folder_cycles(PACKAGES, ("ssd_chat.tui", "ssd_chat.tui.widgets")) == []


def test_the_composition_checks_see_a_mixin_and_a_folder_cycle(tmp_path):
    app, widgets = tmp_path / "app", tmp_path / "app" / "widgets"
    widgets.mkdir(parents=True)
    for d in (app, widgets):
        (d / "__init__.py").write_text("")
    (app / "parts.py").write_text("class Replies:\n    pass\n\nclass Rerun:\n    pass\n")
    (app / "view.py").write_text("from .parts import Replies, Rerun\nfrom .widgets.log import Log\n\nclass View(Rerun, Replies, object):\n    pass\n")
    (widgets / "log.py").write_text("class Log:\n    def draw(self):\n        from ..parts import Replies\n")
    packages = {"app": app, "app.widgets": widgets}
    assert {c: b for c, b in project_bases(packages, "app").items() if b} == {"app.view.View": ["Rerun", "Replies"]}
    assert folder_cycles(packages, ("app", "app.widgets")) == ["app", "app.widgets"]
    (widgets / "log.py").write_text("class Log:\n    pass\n")
    assert folder_cycles(packages, ("app", "app.widgets")) == []
