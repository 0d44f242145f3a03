"""Starting the engine's worker processes (the SSD speculator, tensor-parallel ranks, background compiles).

Workers are never forked from the app (a fork of a process that already runs torch threads, and in
the app Textual's, is unsafe): they are ``spawn``ed, or forked by a forkserver (:func:`context`), a
clean single-threaded process that has imported torch once.  Three things make a start fail or leak
unless handled here:

* Textual's ``sys.stdout``/``sys.stderr`` have ``fileno()`` -1, which makes multiprocessing's
  resource tracker fail to start ("bad value(s) in fds_to_keep"): :func:`prepare` starts it while
  the real streams are in place, and :func:`start` puts them back while it makes sure it runs.
* A worker must not outlive the app, even when the app is killed: :func:`child_start` sets Linux
  ``PR_SET_PDEATHSIG``.  That signal comes when the *thread* that started the worker ends, so
  :func:`start` starts every worker from one thread that lives as long as the process.
* Ctrl-C reaches every process of the terminal's foreground group: workers start with SIGINT
  blocked and ignore it; the parent closes them.  A forkserver keeps SIGINT and SIGHUP blocked
  too, exits when its parent does, and its workers die with it.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_lock = threading.Lock()


# what the engine's workers import before their first request: imported once, in the forkserver
PRELOAD = ("torch", "numpy", "numba", "transformers", "transformers.models.llama.modeling_llama")


def context(forked: bool = False) -> Any:
    """The multiprocessing context a worker is started with (torch's, so tensors can be shared).

    ``spawn`` by default (the app's engine process: the app itself never imports torch).
    ``forked``: a forkserver, a clean process that imports :data:`PRELOAD` once and forks each
    worker from there.  Only its main thread runs, so the fork is safe, and a worker starts in a
    fraction of a second instead of the seconds torch and transformers take to import."""
    import torch.multiprocessing

    if not forked:
        return torch.multiprocessing.get_context("spawn")
    torch.multiprocessing.set_forkserver_preload(list(PRELOAD))
    return _ForkServer()


def _with_env(cls: type, env: dict[str, str]) -> Any:
    os.environ.clear()
    os.environ.update(env)
    return cls.__new__(cls)


class _EnvProcess(multiprocessing.context.ForkServerProcess):
    """A forkserver's worker takes the parent's environment as it is now, not as it was when the
    server started.  ``__reduce__`` puts it first in the pickle, so it is in place before the
    target's module is imported (the engine reads some variables at import)."""

    def __reduce__(self) -> Any:
        return _with_env, (type(self), dict(os.environ)), self.__dict__


class _ForkServer(multiprocessing.context.ForkServerContext):
    Process = _EnvProcess


def _has_fd(stream: Any) -> bool:
    try:
        return stream is not None and stream.fileno() >= 0
    except (AttributeError, OSError, ValueError):
        return False


@contextlib.contextmanager
def real_stdio() -> Iterator[None]:
    """Within the block, ``sys.stdout``/``sys.stderr`` have real file descriptors."""
    with _lock:
        swapped: dict[str, tuple[Any, Any]] = {}  # name -> (what was there, what this put there)
        devnull = None
        try:
            for name in ("stdout", "stderr"):
                if not _has_fd(getattr(sys, name)):
                    real = getattr(sys, f"__{name}__")
                    if not _has_fd(real):
                        devnull = devnull or open(os.devnull, "w")  # noqa: SIM115 - closed below
                        real = devnull
                    swapped[name] = getattr(sys, name), real
                    setattr(sys, name, real)
            yield
        finally:
            # Put back only what is still ours: another thread may have replaced a stream meanwhile
            # (a test's CliRunner, whose output a blind restore would send elsewhere).
            for name, (was, ours) in swapped.items():
                if getattr(sys, name) is ours:
                    setattr(sys, name, was)
            if devnull is not None:
                devnull.close()


def prepare() -> None:
    """Start what spawning needs (multiprocessing's resource tracker) while the process still
    has its real stdio.  Idempotent and cheap after the first call."""
    from multiprocessing import resource_tracker

    with real_stdio():
        resource_tracker.ensure_running()


_spawner: ThreadPoolExecutor | None = None
# the spawner thread's kernel id: the app lowers its own threads' priority but not this one's, which a process
# started later (the engine again, after /model) would inherit
spawner_tid: int | None = None


def _on_spawner(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)`` on the process's spawner thread, which lives as long as the process."""
    global _spawner, spawner_tid
    with _lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(1, thread_name_prefix="ssd-spawner")  # its thread stays until exit
            spawner_tid = _spawner.submit(threading.get_native_id).result()
    return _spawner.submit(fn, *args, **kw).result()


def start(proc: multiprocessing.process.BaseProcess) -> None:
    """``proc.start()`` from the process's spawner thread, the resource tracker running (see the module docstring)."""
    _on_spawner(_start, proc.start)


def warm() -> None:
    """Start the forkserver now and return: its imports take seconds, on another core while the
    models load, and the worker started afterwards forks at once."""
    from multiprocessing import forkserver

    context(forked=True)
    _on_spawner(_start, forkserver.ensure_running)


LEFT_TO_PARENT = {signal.SIGINT, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])}


def _start(begin: Callable[[], Any]) -> None:
    from multiprocessing import resource_tracker

    # The child inherits this thread's signal mask: with SIGINT and SIGHUP blocked it starts deaf to the
    # Ctrl-C (or hang-up) the terminal sends its whole process group, which otherwise interrupted its
    # imports (a traceback on the user's terminal) before child_start could ignore it.  Blocked after
    # the resource tracker has started: starting it unblocks SIGINT in the calling thread.
    with real_stdio():  # the tracker is handed sys.stderr's fd; starting the process itself needs none
        resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, LEFT_TO_PARENT)
    try:
        begin()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def popen(args: list[str], env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()) -> Any:
    """``subprocess.Popen(args)`` (``env`` added to this process's, ``pass_fds`` inherited) from the spawner thread (the child's ``die_with_parent`` follows that
    thread), in a session of its own (the terminal's Ctrl-C is the parent's to handle), output discarded
    unless ``SSD_CHAT_DEBUG`` is set."""
    import subprocess

    out = None if os.environ.get("SSD_CHAT_DEBUG") else subprocess.DEVNULL
    return _on_spawner(subprocess.Popen, args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                       env={**os.environ, **(env or {})}, pass_fds=pass_fds)


def die_with_parent() -> None:
    """In a worker: SIGKILL this process when its parent dies (Linux), and leave Ctrl-C and a
    terminal's hang-up to the parent, which closes its workers itself (``serve`` drains its reply first)."""
    for sig in LEFT_TO_PARENT:
        signal.signal(sig, signal.SIG_IGN)
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        role = multiprocessing.current_process().name.encode()[:15]  # ssd-speculator, ssd-engine, ssd-compile
        libc.prctl(15, ctypes.c_char_p(role), 0, 0, 0)  # PR_SET_NAME: ps and top show the worker's role
    except (OSError, AttributeError):
        pass


def child_start(parent_pid: int) -> bool:
    """The first thing a worker runs: die with the parent, and quiet stdout/stderr (the parent's
    terminal belongs to the app) unless ``SSD_CHAT_DEBUG`` is set.  False when the parent is
    already gone: the worker should return at once."""
    die_with_parent()
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if os.getppid() != parent_pid:
        if server._forkserver_alive_fd is None:  # spawned, and the parent died before PR_SET_PDEATHSIG took hold
            return False
        # Forked by a forkserver (:func:`context`), which exits, and so signals this worker, when the
        # last process holding its "alive" pipe ends: that must be ``parent_pid`` alone, not this worker.
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
        if not pid_alive(parent_pid):
            return False
    if not os.environ.get("SSD_CHAT_DEBUG"):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
    return True


def stop(proc: Any, conn: Any, goodbye: Any, timeout_s: float) -> None:
    """Send a worker ``goodbye`` over ``conn``; terminate, then kill it if it does not exit.  Idempotent."""
    with contextlib.suppress(Exception):
        conn.send(goodbye)
    proc.join(timeout_s)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout_s)
    with contextlib.suppress(Exception):
        conn.close()


def exit_now(code: int = 0) -> None:
    """End a worker at once after a clean goodbye.  The atexit handlers run (the simulated padding
    writes its tallies there), then the interpreter's own teardown, which took the speculator seconds
    (torch's, numba's and OpenMP's threads and modules) and which ``stop`` waited out, is skipped:
    nothing a worker owns needs it (the parent owns the shared buffers)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_words(proc: Any) -> str:
    """How a worker process ended, for an error line: "exited with status 3", "was killed by SIGKILL"."""
    code = proc.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
