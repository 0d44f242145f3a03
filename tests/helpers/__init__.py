"""What the tests share: models, the app, pty, server, history, distribution checks, tensor parallel.

Tests import it as ``helpers.*``: pyproject's ``[tool.pytest.ini_options] pythonpath`` puts tests/ on
``sys.path``; a child Python that needs it gets :func:`env_with_helpers`."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = str(Path(__file__).resolve().parents[1])


def env_with_helpers(env: dict | None = None) -> dict:
    """``env`` (default: this process's) with tests/ first on PYTHONPATH, for a child that imports helpers.*"""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH")) if p)
    return env
