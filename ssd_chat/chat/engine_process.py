"""The chat app's backend: the engine in a process of its own (:mod:`ssd_chat.chat.engine_host`).

The app keeps the conversation, draws and records; the engine process loads the models and decodes,
so drawing a reply never competes with decoding it for the GIL.  This is the
:class:`~ssd_chat.chat.backend.Backend` interface over a pipe; the app cannot tell it from the in-process
:class:`~ssd_chat.chat.backend.EngineBackend`.

* One request at a time on the pipe (a reply, a reconfigure), as the app asks them.  What the app reads
  between replies (``info()``, the sampling defaults, token texts) is kept here, refreshed by every answer.
* Esc sets the reply's stop flag here; the reply's reader passes it on as a message.
* The process is spawned as the SSD speculator is (:mod:`ssd_chat.engine.processes`): with SIGINT
  blocked, dying with the app (PDEATHSIG, and EOF on the pipe).  :meth:`close` asks it to exit, then
  terminates and kills it; an ``atexit`` hook does the same on any other way out of the interpreter.
* A crash of the process is an Error of the reply it was decoding, or (between replies) a warning; the
  chat stays here, and the process is started and loaded again.  The next reply waits for it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Iterator
from multiprocessing.connection import wait
from typing import Any

from .backend import Backend, Progress, readable
from ..engine import SSDChatError, Error, Event, Notice, SamplingParams

CLOSE_TIMEOUT_S = 5.0
POLL_S = 0.05  # how often a waiting reply looks at its stop flag (an answer wakes it at once)


class EngineProcessError(SSDChatError):
    """The engine process failed, or said why it could not do something (text already readable)."""


class EngineGone(Exception):
    """The engine process ended while the app waited for it."""


class ProcessBackend(Backend):
    """The engine in a child process, configured from resolved settings, as :class:`EngineBackend`."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.proc: Any = None
        self._conn: Any = None
        self._gen = 0  # which process this is (a restart starts the next)
        self._state: dict[str, Any] = {"info": {"mode": values.get("mode"), "target": values.get("target")}, "defaults": {}}
        self._vocab: list[str] = []
        self._busy = threading.Lock()  # one request on the pipe at a time
        self._send_lock = threading.Lock()  # a stop and a close may be sent from two threads
        self._ready = threading.Event()  # loaded and not restarting
        self._restart_lock = threading.Lock()
        self._broken: str | None = None  # why a restart failed: every later reply says it
        self._closing = False
        self._streaming = False
        self._changes: dict[str, Any] = {}  # what reconfigure changed: a restarted engine is put back in it

    # -- the process -------------------------------------------------------------------------
    def _spawn(self) -> None:
        from . import engine_host
        from ..engine import threads, processes

        ctx = processes.context()
        parent, child = ctx.Pipe(duplex=True)
        # not a daemon: a daemonic process may not start the speculator or tensor-parallel ranks
        proc = ctx.Process(target=engine_host.main, name="ssd-engine",
                           args=(child, self.values, os.getpid(), threads.count()))
        processes.start(proc)  # SIGINT blocked, PDEATHSIG tied to a thread that lives as long as the app
        child.close()
        self._gen += 1
        self.proc, self._conn = proc, parent
        atexit.register(_shutdown, proc, parent)  # before multiprocessing's own hook, which would wait for it
        threading.Thread(target=self._watch, args=(proc, self._gen), name="ssd-engine-watch", daemon=True).start()

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(msg)
            except (OSError, ValueError) as e:
                raise EngineGone(self._exit_words()) from e

    def _exit_words(self) -> str:
        from ..engine import processes

        self.proc.join(1.0)
        return processes.exit_words(self.proc)

    def _recv(self, timeout: float | None) -> tuple | None:
        """The next message, None after ``timeout``; EngineGone once the process has ended (what it sent first is read first)."""
        try:
            ready = wait([self._conn, self.proc.sentinel], timeout)
        except (OSError, ValueError):  # closed here: the app is closing
            raise EngineGone(self._exit_words()) from None
        if not ready:
            return None
        if self._conn in ready or self._conn.poll():
            try:
                return self._conn.recv()
            except (EOFError, OSError):
                pass
        raise EngineGone(self._exit_words())

    def _load(self, progress: Progress) -> None:
        while True:
            msg = self._recv(None)
            if msg[0] == "progress":
                progress(msg[1], msg[2])
            elif msg[0] == "warn":
                self.warn(msg[1])
            elif msg[0] == "loaded":
                self._state, self._vocab = msg[1], msg[2]
                return
            elif msg[0] == "failed":
                raise EngineProcessError(msg[1])

    def _watch(self, proc: Any, gen: int) -> None:
        """Waits for the process to end; a crash between replies is a warning, and a restart."""
        wait([proc.sentinel])
        if self._closing or gen != self._gen or not self._ready.is_set() or self._broken:
            return  # closing, an old process, one still loading (load() reports that one), or one that could not load
        if not self._streaming:
            from ..engine import processes

            proc.join(1.0)  # its exit code
            self.warn(f"the engine process {processes.exit_words(proc)}; it is restarting, and the chat is kept "
                      "(your next prompt is answered once it has loaded)")
        self._crashed(gen)

    def _crashed(self, gen: int) -> None:
        with self._restart_lock:
            if self._closing or gen != self._gen or not self._ready.is_set():
                return
            self._ready.clear()
        threading.Thread(target=self._restart, name="ssd-engine-restart", daemon=True).start()

    def _restart(self) -> None:
        with self._busy:  # after the reply that saw the crash has read its last message
            _shutdown(self.proc, self._conn)
            try:
                if not self._closing:
                    self._spawn()
                    self._load(lambda stage, frac: None)
                    if self._changes:
                        self._configure(self._changes)
                    self._broken = None
            except EngineGone as e:
                self._broken = f"the engine process {e} while it restarted"
            except Exception as e:  # noqa: BLE001 - every later reply says why
                self._broken = f"the engine could not restart: {readable(e)}"
            finally:
                if self._closing:  # the app closed while this one started
                    _shutdown(self.proc, self._conn)
                self._ready.set()

    def _wait_ready(self, stop: threading.Event | None = None) -> None:
        while not self._ready.wait(POLL_S):
            if stop is not None and stop.is_set():
                raise EngineProcessError("stopped while the engine process restarted")
            if self._closing:
                raise EngineProcessError("the app is closing")
        if self._closing:
            raise EngineProcessError("the app is closing")
        if self._broken:
            raise EngineProcessError(self._broken)

    # -- the Backend interface ---------------------------------------------------------------
    def load(self, progress: Progress) -> None:
        self._spawn()
        try:
            self._load(progress)
        except EngineGone as e:
            raise EngineProcessError(f"the engine process {e} while loading") from None
        self._ready.set()

    def info(self) -> dict[str, Any]:
        return dict(self._state["info"])

    def sampling_defaults(self) -> dict[str, Any]:
        return dict(self._state["defaults"])

    def token_text(self, token_id: int) -> str | None:
        return self._vocab[token_id] if 0 <= token_id < len(self._vocab) else None

    def stream(self, messages: list[dict[str, str]], params: SamplingParams, stop: threading.Event) -> Iterator[Event]:
        if self._ready.is_set() and not self.proc.is_alive():  # it died between replies; the watcher may not know yet
            self._crashed(self._gen)
        if not self._ready.is_set():
            yield Notice("the engine process is restarting; this reply starts once it has loaded", "warning")
        self._wait_ready(stop)
        with self._busy:
            gen, self._streaming = self._gen, True
            try:
                yield from self._reply(messages, params, stop)
            except EngineGone as e:
                self._crashed(gen)
                yield Error(f"the engine process {e}; it is restarting, and the chat is kept "
                            "(your next prompt is answered once it has loaded)", "runtime")
            finally:
                self._streaming = False

    def _reply(self, messages: list[dict[str, str]], params: SamplingParams, stop: threading.Event | None) -> Iterator[Event]:
        self._send(("stream", messages, params))
        stopped = ended = False
        try:
            while True:
                if not stopped and stop is not None and stop.is_set():
                    self._send(("stop",))
                    stopped = True
                msg = self._recv(POLL_S)
                if msg is None:
                    continue
                if msg[0] == "event":
                    yield msg[1]
                elif msg[0] == "end":
                    self._state, ended = msg[1], True
                    return
                elif msg[0] == "warn":
                    self.warn(msg[1])
        finally:
            if not ended:  # the reader left early (or the process died): stop the reply and read to its end
                with contextlib.suppress(EngineGone):
                    if not stopped:
                        self._send(("stop",))
                    while (msg := self._recv(CLOSE_TIMEOUT_S)) is not None and msg[0] != "end":
                        pass

    def reconfigure(self, **changes: Any) -> None:
        self._wait_ready()
        with self._busy:
            gen = self._gen
            try:
                self._configure(changes)
            except EngineGone as e:
                self._crashed(gen)
                raise EngineProcessError(f"the engine process {e}; it is restarting") from None
        self._changes.update(changes)

    def _configure(self, changes: dict[str, Any]) -> None:
        self._send(("reconfigure", changes))
        msg = self._answer()
        if msg[0] == "error":
            raise EngineProcessError(msg[1])
        self._state = msg[1]

    def count_tokens(self, text: str) -> tuple[int, int | None] | None:
        """Counted by the engine process's tokenizer; None while it loads or decodes (it answers one at a time)."""
        if not self._ready.is_set() or not self._busy.acquire(blocking=False):
            return None
        try:
            gen = self._gen
            try:
                self._send(("count", text))
                msg = self._answer()
            except EngineGone:
                self._crashed(gen)
                return None
        finally:
            self._busy.release()
        return msg[1] if msg[0] == "counted" else None

    def _answer(self) -> tuple:
        """The answer to a reconfigure (warnings on the way are passed on)."""
        while (msg := self._recv(None))[0] == "warn":
            self.warn(msg[1])
        return msg

    def close(self) -> None:
        self._closing = True
        self._ready.set()  # a reply waiting for a restart gives up
        if self.proc is not None:
            _shutdown(self.proc, self._conn)
            with contextlib.suppress(Exception):
                atexit.unregister(_shutdown)


def _shutdown(proc: Any, conn: Any) -> None:
    """Ask the engine process to exit (it closes its speculator); terminate, then kill it if it does not.  Idempotent."""
    from ..engine import processes

    processes.stop(proc, conn, ("close",), CLOSE_TIMEOUT_S)