"""Building a core's CPU graphs in a process of their own, at low priority, while the core answers eagerly.

An AOTInductor package (:mod:`aoti`) takes about a minute per row shape on two cores.  Under
``--compile auto`` a shape whose package is not on disk yet is built here instead of before the
reply: the process rebuilds the model from its source (a folder, or a config and state dict: never
the live model), lowers its priority (``os.nice``), and exports and compiles each shape to the
path the caller chose; the caller keeps answering on the eager kernels and loads the package when
it is written.  A separate process, not a thread: compiling holds the GIL for seconds at a time.

The package appears only by ``os.replace`` of a finished file (:func:`aoti.load_or_build`), so a
build that is stopped (Ctrl-C, the app closing, a kill) leaves no half-written entry; :meth:`Build.close`
kills the process's whole group (its C++ compiler runs included) and removes its temporary files.
The process dies with its parent (:func:`processes.child_start`).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .. import processes
from ..config import cache_dir, write_atomic

DEFAULT_SHAPE_S = 75.0  # the first estimate of one shape's build (2 cores, SmolLM2-135M), before any was timed


def _times_file() -> Path:
    return cache_dir() / "aoti" / "build-seconds.json"


def expected_s(name: str) -> float:
    """How long one shape of ``name`` took to build last time on this machine (for the percentage)."""
    try:
        return float(json.loads(_times_file().read_text()).get(name, DEFAULT_SHAPE_S))
    except (OSError, ValueError, AttributeError):
        return DEFAULT_SHAPE_S


def _record_s(name: str, seconds: float) -> None:
    f = _times_file()
    try:
        data = json.loads(f.read_text()) if f.exists() else {}
        data[name] = round(seconds, 1)
        write_atomic(f, json.dumps(data))
    except (OSError, ValueError):
        pass


class Build:
    """One background process building ``jobs`` ((rows, threads, package path), in order) of one model.
    ``source()`` gives (make, recipe): ``make(recipe)`` rebuilds the model in the process.

    ``on_built(rows, threads, path)`` and ``on_failed(why)`` are called from a watcher thread."""

    def __init__(self, source: Callable[[], tuple[Callable, Any]], core_cls: type, name: str, mid_layer: int | None, width: int,
                 jobs: list[tuple[int, int, Path]], on_built: Callable[[int, int, Path], None], on_failed: Callable[[str], None]) -> None:
        self.name, self.jobs = name, list(jobs)
        self.on_built, self.on_failed = on_built, on_failed
        self.started = time.monotonic()
        self.done = 0
        self.closed = False
        for _r, _t, path in self.jobs:
            _sweep(path)
        ctx = processes.context(forked=True)
        self._conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=child_main, name="ssd-compile", daemon=True,
                                args=(child, source(), core_cls, name, mid_layer, width, [(r, t, str(p)) for r, t, p in self.jobs], os.getpid()))
        processes.start(self.proc)
        child.close()
        self._watch = threading.Thread(target=self._watcher, name="ssd-compile-watch", daemon=True)
        self._watch.start()

    @property
    def running(self) -> bool:
        return not self.closed and self.done < len(self.jobs)

    def current(self) -> tuple[int, int, float]:
        """(rows, threads, about how far) of the shape being built now."""
        r, t, _path = self.jobs[min(self.done, len(self.jobs) - 1)]
        return r, t, min(0.95, (time.monotonic() - self._shape_t0()) / expected_s(self.name)) if self.running else 0.0

    def _shape_t0(self) -> float:
        return getattr(self, "_t0", self.started)

    def _watcher(self) -> None:
        self._t0 = time.monotonic()
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                if not self.closed and self.done < len(self.jobs):
                    self.closed = True
                    self.on_failed(f"the compile process {processes.exit_words(self.proc)}")
                return
            if msg[0] == "built":
                _, r, t, path = msg
                _record_s(self.name, time.monotonic() - self._t0)
                self._t0 = time.monotonic()
                self.done += 1
                try:
                    self.on_built(r, t, Path(path))
                except Exception as e:  # noqa: BLE001 - a package that does not load: stay eager, say so
                    self.closed = True
                    self.on_failed(f"{type(e).__name__}: {e}")
                    return
            elif msg[0] == "failed":
                self.closed = True
                self.on_failed(msg[1])
                return

    def close(self) -> None:
        """Stop the process (and its compiler runs) and remove its unfinished files; idempotent."""
        self.closed = True
        pid = self.proc.pid
        if pid is not None and self.proc.is_alive():
            for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                try:
                    kill()
                except (ProcessLookupError, PermissionError, OSError):
                    pass
        self.proc.join(5)
        for _r, _t, path in self.jobs:
            _sweep(path, pid)
        try:
            self._conn.close()
        except OSError:
            pass


def _sweep(path: Path, pid: int | None = None) -> None:
    """Remove the temporary files of builds of ``path`` by ``pid`` (None: by processes that are gone)."""
    for tmp in path.parent.glob(f"{path.stem}.*.tmp.pt2"):
        owner = tmp.name[len(path.stem) + 1:].split(".", 1)[0]
        if not owner.isdigit() or (pid is not None and int(owner) != pid):
            continue
        if pid is None and processes.pid_alive(int(owner)):
            continue
        try:
            tmp.unlink()
        except OSError:
            pass



def child_main(conn: Any, source: tuple[Callable, Any], core_cls: type, name: str, mid_layer: int | None, width: int,
               jobs: list[tuple[int, int, str]], parent_pid: int) -> None:
    """The compile process: its own process group (the parent kills it whole), nice 19, then each job."""
    if not processes.child_start(parent_pid):
        return
    try:
        os.setpgid(0, 0)
        os.nice(19)
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1  # no pool of compile workers: a daemon process has no children of its own
        make, recipe = source
        model = make(recipe)
        from . import aoti

        aoti.use_disk_cache()
        for rows, threads, path in jobs:
            torch.set_num_threads(threads)  # inductor's kernels are generated for the caller's thread count
            core = core_cls(model, name, compile="on", rows=(rows,), mid_layer=mid_layer)
            kv = core.kv
            kv.reserve(min(width, kv.limit or width))
            example = core.compiler.example(rows)
            with torch.inference_mode():
                aoti.load_or_build(core, rows, (kv.k, kv.v, *example), lambda s: None, Path(path), load=False)
            conn.send(("built", rows, threads, path))
    except (EOFError, OSError, KeyboardInterrupt) as e:
        try:
            conn.send(("failed", f"{type(e).__name__}: {e}"))
        except (OSError, EOFError):
            pass
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which stays eager
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        try:
            conn.send(("failed", f"{type(e).__name__}: {first}"))
        except (OSError, EOFError):
            pass
