"""Every third-party module the installed code imports is declared in pyproject.toml.

`pip install -e .` (the README's install in an environment of one's own) gets only
[project].dependencies, while .venv also has every extra, so a missing declaration shows up only
outside CI's venv (.ci/own-env-check runs that install for real).  Imports at a module's top run when
the module is imported: they must be dependencies.  Imports inside a function (the bench's plot) may
come from an extra.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "ssd_chat", "tui")  # what pyproject installs (engine/ and tui/ under ssd_chat)


def _dist(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def third_party_imports() -> list[tuple[str, str, bool]]:
    """(file, top-level module, imported inside a function) for every absolute import of a module
    outside the standard library and ssd_chat."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            lazy_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                          for n in ast.walk(f)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "ssd_chat":
                        out.append((str(path.relative_to(ROOT)), top, id(node) in lazy_nodes))
    return out


def test_every_import_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    required = {_dist(r) for r in project["dependencies"]}
    extras = {_dist(r) for reqs in project.get("optional-dependencies", {}).values() for r in reqs}
    owners = packages_distributions()
    found = third_party_imports()
    assert any(m == "torch" for _, m, _ in found)  # the scan sees the engine's imports
    missing = []
    for path, module, lazy in found:
        dists = {_dist(d) for d in owners.get(module, [])}
        allowed = required | extras if lazy else required
        if not dists & allowed:
            missing.append(f"{path}: {'function-level ' if lazy else ''}import {module} "
                           f"(distribution {', '.join(sorted(dists)) or 'not installed'}) is not in "
                           f"{'dependencies or an extra' if lazy else '[project].dependencies'}")
    assert not missing, "\n".join(sorted(set(missing)))
