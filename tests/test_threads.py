"""engine/threads.py: the UI thread keeps torch on one thread (it starts no OpenMP pool, which would
throttle the compute thread's pool), and compute threads get the count back."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from ssd_chat.engine import threads


@pytest.fixture
def restore():
    before, saved = torch.get_num_threads(), list(threads._compute)
    yield
    threads._compute[:] = saved
    torch.set_num_threads(before)


def test_coordinator_keeps_its_thread_on_one_and_remembers_the_count(restore):
    threads._compute.clear()
    torch.set_num_threads(2)
    assert threads.coordinator() == 2 and torch.get_num_threads() == 1
    assert threads.coordinator() == 2  # a second call keeps the first count


def test_in_thread_runs_on_a_new_thread_with_its_count_and_raises_there(restore):
    threads._compute.clear()
    torch.set_num_threads(2)
    n = threads.coordinator()
    seen = {}

    def job(x):
        seen["thread"], seen["threads"] = threading.current_thread(), torch.get_num_threads()
        return x * 2

    def fail():
        raise ValueError("no such draft")

    async def main():
        assert await asyncio.wait_for(threads.in_thread(n, job, 21), 10) == 42
        with pytest.raises(ValueError, match="no such draft"):
            await asyncio.wait_for(threads.in_thread(n, fail), 10)

    asyncio.run(main())
    seen["thread"].join(5)  # it ends with the call
    assert seen["thread"] is not threading.current_thread() and not seen["thread"].is_alive()
    assert seen["threads"] == 2 and torch.get_num_threads() == 1


def test_an_error_reaches_the_await_even_when_the_loop_is_slow_to_look(restore):
    # The loop runs the thread's callback after the thread has left its except block (here: the loop
    # is blocked meanwhile), when a closure over ``e`` would find it deleted and the await would hang.
    def fail():
        raise ValueError("no such draft")

    async def main():
        task = asyncio.ensure_future(threads.in_thread(1, fail))
        await asyncio.sleep(0)  # the thread starts
        time.sleep(0.3)  # ... and finishes while the loop is blocked
        with pytest.raises(ValueError, match="no such draft"):
            await asyncio.wait_for(task, 10)

    asyncio.run(main())


def test_call_runs_on_a_thread_of_its_own_with_the_count_and_raises_here(restore):
    threads._compute.clear()
    torch.set_num_threads(2)
    n = threads.coordinator()
    assert threads.count() == 2
    seen = {}

    def job(x):
        seen["thread"], seen["threads"] = threading.current_thread(), torch.get_num_threads()
        return x + 1

    assert threads.call(n, job, 1) == 2
    assert seen["thread"] is not threading.current_thread() and not seen["thread"].is_alive()
    assert seen["threads"] == 2 and torch.get_num_threads() == 1
    with pytest.raises(KeyError):
        threads.call(n, dict().__getitem__, "x")


def test_the_servers_engine_thread_computes_on_the_remembered_count(restore, monkeypatch):
    from types import SimpleNamespace

    from ssd_chat.server.metrics import ServerMetrics
    from ssd_chat.server.engine_thread import END, EngineWorker

    threads._compute.clear()
    torch.set_num_threads(2)
    threads.coordinator()
    seen = []
    monkeypatch.setattr(EngineWorker, "_decode", lambda self, job: seen.append(torch.get_num_threads()))
    worker = EngineWorker(SimpleNamespace(config=SimpleNamespace(mode="ar"), close=lambda: None), ServerMetrics("m"))
    worker._queue.put(SimpleNamespace(stop=threading.Event()))
    worker._queue.put(END)
    worker._thread.join(10)
    assert seen == [2] and torch.get_num_threads() == 1


CTRL_C = """
import signal, threading, time
from ssd_chat.engine import threads

seen = []

def load():  # a long load: it ends early only if the Ctrl-C reaches it
    try:
        seen.append(threading.get_ident())
        for _ in range(600):
            time.sleep(0.1)
        seen.append("finished")
    except KeyboardInterrupt:
        seen.append("interrupted")
        raise

def ctrl_c():  # the kernel may give a process's SIGINT to any thread that does not block it: here, the load's
    while len(seen) < 1:
        time.sleep(0.01)
    signal.pthread_kill(seen[0], signal.SIGINT)

threading.Thread(target=ctrl_c, daemon=True).start()
try:
    threads.call(1, load)
except KeyboardInterrupt:
    print("KeyboardInterrupt", seen[1:])
"""


def test_call_ends_on_a_ctrl_c_that_another_thread_received():
    """A Ctrl-C delivered to the load's thread, not the waiting one, still interrupts ``call`` and
    unwinds the load (the waiting thread wakes to handle it, instead of blocking until the load ends)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", CTRL_C], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "KeyboardInterrupt ['interrupted']", r.stdout + r.stderr
