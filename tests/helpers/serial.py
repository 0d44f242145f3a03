"""The suite runs on pytest-xdist's workers (pyproject: ``-n auto``, at most ``MAX_WORKERS``); a test marked
``serial`` runs alone.  Serial tests are those that judge the machine itself: the mode probe's verdict
(quiet or busy), pinned cores, a machine kept busy on purpose, figures compared with a bound.  A test
that merely runs slower next to another one is not serial.

Workers share one lock file as a readers-writer lock: every test holds it shared, a serial test holds it
exclusive, from its setup (module fixtures included) to its teardown.  A turnstile lock taken before
either keeps a waiting serial test from being starved by the other workers' next tests.

A worker starts with COLUMNS=80 and LINES=24 in its environment, which the controller does not have; the
apps the tests start would take them for the terminal's size, so each worker gets the controller's."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

MAX_WORKERS = 4  # each worker holds its own models and inductor state (about 1-2 GB)
TERMINAL_ENV = ("COLUMNS", "LINES")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "serial: runs with no other test at the same time (it measures the machine)")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # the controller, for each worker
    node.workerinput["terminal_env"] = {k: os.environ.get(k) for k in TERMINAL_ENV}


def pytest_sessionstart(session: pytest.Session) -> None:
    given = getattr(session.config, "workerinput", {}).get("terminal_env")
    for k, v in (given or {}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:  # noqa: ARG001
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


@contextlib.contextmanager
def _held(run: str, exclusive: bool) -> Iterator[None]:
    base = Path(tempfile.gettempdir()) / f"ssd-chat-tests-{run}"
    with open(f"{base}.turn", "a") as turn, open(f"{base}.lock", "a") as lock:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(turn, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ARG001
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: nothing runs beside it
        return (yield)
    alone = item.get_closest_marker("serial") is not None
    # beside another worker, one torch thread each: two apiece oversubscribe the cores (a test that wants
    # another count sets it, as the `one_thread` fixture does)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads if alone or os.environ.get("PYTEST_XDIST_WORKER_COUNT") == "1" else 1)
    try:
        with _held(run, alone):
            return (yield)
    finally:
        torch.set_num_threads(threads)
