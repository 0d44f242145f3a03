"""The recordings shipped in ``assets/recordings``: ``ssd-chat demo --list`` and ``--replay NAME``."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path


def folder() -> Path:
    return Path(str(resources.files("ssd_chat.assets"))) / "recordings"


def shipped() -> list[Path]:
    return sorted(folder().glob("*.jsonl"))


def header(path: Path) -> dict:
    """The recording's setup (its Header's info), or {} when its first line is not one."""
    try:
        with path.open(encoding="utf-8") as f:
            first = json.loads(f.readline() or "{}")
    except (OSError, ValueError):
        return {}
    return first.get("info") or {} if isinstance(first, dict) else {}


def describe(path: Path) -> str:
    i = header(path)
    mode = (i.get("mode") or "?").upper() + (f" k={i['k']}" if i.get("k") else "")
    sim = f", SIMULATED on {i['simulated']}" if i.get("simulated") else ""
    return f"{path.stem}: {mode}, {i.get('target') or '?'} + {i.get('draft') or '?'}{sim}"


def listing() -> str:
    lines = [describe(p) for p in shipped()]
    return "\n".join(lines + ["replay one with: ssd-chat demo --replay NAME (a unique part of the name will do)"])


def resolve(arg: str) -> Path:
    """A file that exists, else the shipped recording whose name is ``arg`` or the only one containing it.
    Raises ValueError (one line) when none or several match."""
    path = Path(arg)
    if path.exists():
        return path
    names = {p.stem: p for p in shipped()}
    key = path.name.removesuffix(".jsonl")
    if key in names:
        return names[key]
    hits = [p for n, p in names.items() if key.lower() in n.lower()]
    if len(hits) == 1:
        return hits[0]
    known = ", ".join(names) or "none"
    if hits:
        raise ValueError(f"'{arg}' matches several shipped recordings ({', '.join(p.stem for p in hits)}): say which")
    raise ValueError(f"no recording at {arg} (shipped recordings: {known}; ssd-chat demo --list)")
