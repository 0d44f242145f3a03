"""The engine's worker processes as tests find them (engine/processes.py): spawned ones (the app's engine
process), the ones a forkserver forks (speculators, tensor-parallel ranks, background compiles), and
the forkserver itself (it must not outlive the app either)."""

from __future__ import annotations

import psutil

FORKSERVER = "multiprocessing.forkserver"


def _cmd(p: psutil.Process | None) -> str:
    try:
        return " ".join(p.cmdline()) if p is not None else ""
    except psutil.Error:
        return ""


def _forked(p: psutil.Process) -> bool:
    """Whether a forkserver forked ``p`` (a worker, not the server: the server's parent is no forkserver)."""
    try:
        return FORKSERVER in _cmd(p.parent())
    except psutil.Error:
        return False


def workers(pid: int | None = None, servers: bool = True) -> list[psutil.Process]:
    """Every worker process under ``pid`` (default: this one), not multiprocessing's resource tracker;
    ``servers``: forkservers too."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    return [p for p in kids if "spawn_main" in _cmd(p) or FORKSERVER in _cmd(p) and (servers or _forked(p))]


def forked(pid: int | None = None) -> list[psutil.Process]:
    """The workers under ``pid`` that a forkserver forked: speculators, tensor-parallel ranks, compiles."""
    return [p for p in workers(pid, servers=False) if _forked(p)]


def speculators(pid: int | None = None) -> list[psutil.Process]:
    """The SSD speculators under ``pid``: the forked workers that name themselves so."""
    out = []
    for p in forked(pid):
        try:
            if p.name() == "ssd-speculator":
                out.append(p)
        except psutil.Error:
            continue
    return out
