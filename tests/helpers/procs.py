"""The engine's worker processes as tests find them (engine/processes.py): spawned ones (the app's engine
process, tensor-parallel ranks, background compiles), and the speculators a forkserver forks, with the
forkserver itself (it must not outlive the app either)."""

from __future__ import annotations

import psutil

FORKSERVER = "multiprocessing.forkserver"


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def workers(pid: int | None = None) -> list[psutil.Process]:
    """Every worker process under ``pid`` (default: this one), not multiprocessing's resource tracker."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    return [p for p in kids if "spawn_main" in _cmd(p) or FORKSERVER in _cmd(p)]


def speculators(pid: int | None = None) -> list[psutil.Process]:
    """The SSD speculators under ``pid``: the processes a forkserver forked."""
    out = []
    for p in workers(pid):
        try:
            parent = p.parent()
        except psutil.Error:
            continue
        if parent is not None and FORKSERVER in _cmd(parent):
            out.append(p)
    return out
