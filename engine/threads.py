"""torch's CPU threads when several Python threads compute.

libgomp (torch's OpenMP) keeps a pool of worker threads for every thread that has started a parallel
region, and once it manages more threads than there are CPUs it stops spin-waiting between regions:
every region then wakes sleeping workers (about 50 us each on a 2-core VM, and a compiled step has
hundreds).  A decode in a second thread ran at 38 tok/s, against 95 in the main thread, once the
main thread had run one parallel region (78 with what follows).  So a thread that only coordinates (the UI's) keeps torch on one thread, which
starts no pool, and each thread that computes sets the count it computes with."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")


_compute: list[int] = []  # torch's thread count before the first coordinator() call


def coordinator() -> int:
    """Call in a thread that should start no OpenMP pool (as early as possible: a pool it has started
    stays); returns the thread count :func:`worker` threads should use (torch's, before the first call)."""
    if not _compute:
        _compute.append(torch.get_num_threads())
    torch.set_num_threads(1)
    return _compute[0]


def count() -> int:
    """The thread count compute threads use: the one :func:`coordinator` remembered, else torch's."""
    return _compute[0] if _compute else torch.get_num_threads()


def others_running(samples: int = 3) -> int | None:
    """How many threads besides the caller are runnable right now on this machine (the least of a
    few reads of /proc/loadavg's running count; None where there is none).  Spreading a forward
    over every core pays only when the others are free: libgomp waits at the end of each parallel
    region for every one of its threads, so one that waits for a core held by another process
    stalls them all (a 42-token prompt took 0.9-2.8 s on two threads, 0.2-0.5 s on one, on a 2-core machine
    where another process decoded)."""
    try:
        counts = []
        for _ in range(samples):
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]))
    except (OSError, ValueError, IndexError):
        return None
    return max(0, min(counts) - 1)


def free_for(n: int) -> bool:
    """Whether ``n`` threads would each find a core no other process holds now (:func:`others_running`)."""
    others = others_running()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return others is not None and others + n <= cores


def call(n: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a new thread computing on ``n`` torch threads, waited for here (a
    coordinating thread: ``serve``'s, which then runs the HTTP server).  Ctrl-C still interrupts the
    wait; the thread and its OpenMP pool end with the call."""
    box: dict[str, Any] = {}
    ended = threading.Event()
    t = _start(n, fn, args, kwargs, lambda error, result: (box.update(error=error, result=result), ended.set()))
    try:
        # Short waits, not join(): a Ctrl-C the kernel gives another thread is handled here only when
        # this thread wakes, and Python 3.11's join() marks a thread that a Ctrl-C interrupted as ended.
        while not ended.wait(0.05):
            pass
        t.join()  # its OpenMP pool ends with it
    except KeyboardInterrupt:
        # Raised in the thread too, so it unwinds (closing what it started) as the calling thread would
        # have: a process that exits while it is inside torch's C++ aborts ("terminate called ...").
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(KeyboardInterrupt))
        while t.is_alive():
            time.sleep(0.05)
        raise
    if box["error"] is not None:
        raise box["error"]
    return box["result"]


def worker(n: int) -> None:
    """Call first in a thread that computes: torch uses ``n`` threads in it."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


async def in_thread(n: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``await fn(*args, **kwargs)`` run in a new thread computing on ``n`` torch threads.  Unlike
    ``asyncio.to_thread``, whose executor threads live on (and would keep their OpenMP pools), the
    thread ends with the call."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    _start(n, fn, args, kwargs, lambda error, result: loop.call_soon_threadsafe(_settle, done, error, result))
    return await done


def _start(n: int, fn: Callable[..., Any], args: tuple, kwargs: dict,
           finished: Callable[[BaseException | None, Any], Any]) -> threading.Thread:
    """A thread computing on ``n`` torch threads that runs ``fn`` and then ``finished(error, result)``."""

    def run() -> None:
        worker(n)
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - raised where the caller waits
            finished(e, None)
        else:
            finished(None, result)

    t = threading.Thread(target=run, name="ssd-chat-compute", daemon=True)
    t.start()
    return t


def _settle(done: asyncio.Future, error: BaseException | None, result: Any) -> None:
    # Arguments, not a closure: Python deletes ``except ... as e`` names when the block ends, and a
    # lambda closing over ``e`` then raised NameError in the loop and the await never returned.
    if done.done():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


@contextlib.contextmanager
def pinned(cores: tuple[int, ...] | None, threads: int | None) -> Iterator[None]:
    """Pin the calling thread to ``cores`` and torch to ``threads`` threads; restore after."""
    old_aff = os.sched_getaffinity(0) if cores and hasattr(os, "sched_setaffinity") else None
    if old_aff is not None and old_aff == set(cores):  # already there (moving a thread costs ~ms)
        old_aff = None
    old_threads = torch.get_num_threads()
    try:
        if old_aff is not None:
            os.sched_setaffinity(0, cores)
        if threads:
            torch.set_num_threads(threads)
        yield
    finally:
        if old_aff is not None:
            os.sched_setaffinity(0, old_aff)
        torch.set_num_threads(old_threads)
