"""Measurement scripts (``python -m lab.NAME`` from the repository root); not part of the installed package.

They import the product as ``ssd_chat``.  Run from a source tree where it is not installed (the lent
GPU machine has torch and transformers only), ``ssd_chat.engine`` is found in ``engine/`` at the
repository root, as pyproject.toml's package-dir maps it.
"""

from pathlib import Path

import ssd_chat

try:
    import ssd_chat.engine  # noqa: F401
except ImportError:
    ssd_chat.__path__.append(str(Path(__file__).resolve().parents[1]))
