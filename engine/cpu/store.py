"""Where :mod:`fastlinear` keeps its timed choices: ``fastlinear.json`` in the cache dir, one entry
per machine key (CPU model, torch version, thread count, transpose permission, candidates), so
the timing runs once per machine and every later load (the app, the speculator process, a
draft) reads it back.  A missing, unreadable or corrupt store only means timing again; a
read-only cache dir keeps the choices for the process only."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import cache_dir, cpu_name, write_atomic
from .rowkernels import MAX_ROWS

Tune = Callable[[list[torch.Tensor], bool], dict[int, str]]


def machine_key(allow_t: bool, methods: list[str]) -> str:
    ident = [cpu_name(), torch.__version__, torch.get_num_threads(), allow_t, MAX_ROWS, methods, "v2"]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


def stored_or_tuned(by_shape: dict[tuple[int, int], list[torch.Tensor]], allow_t: bool, tune: Tune, methods: list[str],
                    announce: Callable[[], None] | None = None, tuned: Callable[[float], None] | None = None,
                    store: Path | None = None) -> dict[tuple[int, int, int], str]:
    """Choices (out, in, rows) -> method for every shape in ``by_shape`` at the current thread count:
    from the store when timed before, otherwise timed now (``tune``, after one call of ``announce``;
    ``tuned(fraction)`` hears the progress) and added to the store."""
    key = machine_key(allow_t, methods)
    path = Path(store) if store is not None else cache_dir() / "fastlinear.json"
    try:
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict):
            stored = {}
    except (OSError, ValueError):
        stored = {}
    mine = stored.get(key) if isinstance(stored.get(key), dict) else {}

    def valid(got: Any) -> bool:
        return isinstance(got, dict) and all(got.get(str(r)) in methods for r in range(1, MAX_ROWS + 1))

    todo = sum(1 for o, i in by_shape if not valid(mine.get(f"{o}x{i}")))
    out: dict[tuple[int, int, int], str] = {}
    done = 0
    for (out_f, in_f), ws in by_shape.items():
        name = f"{out_f}x{in_f}"
        got = mine.get(name)
        if not valid(got):
            if announce is not None and done == 0:
                announce()
            if tuned is not None:
                tuned(done / todo)
            got = {str(r): m for r, m in tune(ws, allow_t).items()}
            mine[name] = got
            done += 1
        out.update({(out_f, in_f, int(r)): m for r, m in got.items()})  # type: ignore[union-attr]
    if done:
        if tuned is not None:
            tuned(1.0)
        stored[key] = mine
        write_atomic(path, json.dumps(stored, indent=1, sort_keys=True))  # read-only: kept for this process only
    return out
