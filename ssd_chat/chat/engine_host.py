"""The engine process of the chat app: an :class:`~ssd_chat.chat.backend.EngineBackend` served over a pipe.

The app draws a growing Markdown reply on every token; in the process that decodes, that drawing
competed with the compiled step for the GIL.  So the app decodes here, in a process of its own
(:class:`~ssd_chat.chat.engine_process.ProcessBackend` starts it), and reads the one event stream back.

Messages are tuples.  From the app: ``("stream", messages, params)``, ``("stop",)``,
``("reconfigure", changes)``, ``("close",)``.  To the app: ``("progress", stage, frac)`` and
``("warn", text)`` while loading, then ``("loaded", state, vocab)`` or ``("failed", text)``;
``("event", ev)`` per event of a reply and ``("end", state)`` after its last; ``("ok", state)`` or
``("error", text)`` for a reconfigure.  ``state`` is what the app shows between calls: the backend's
``info()`` and ``sampling_defaults()``.

A reader thread takes the app's messages, so a stop reaches the reply while it decodes; the main
thread computes.  The process dies with the app (:func:`processes.child_start`: PDEATHSIG, and here EOF
on the pipe), ignores the Ctrl-C and SIGHUP the terminal sends its whole process group (the app closes
it), and keeps its SSD speculator and tensor-parallel ranks as children of its own.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from typing import Any

from .backend import EngineBackend, readable
from ..engine import threads, processes, Error


def vocabulary(engine: Any) -> list[str]:
    """Each token id's text, for the app's token_text (the speculation-cache view, recordings)."""
    tok = engine.tokenizer
    ids = [[i] for i in range(len(tok))]
    try:
        return list(tok.batch_decode(ids))
    except Exception:  # noqa: BLE001 - a tokenizer without batch_decode
        return [tok.decode(i) for i in ids]


class Host:
    def __init__(self, conn: Any, values: dict[str, Any]) -> None:
        self.conn = conn
        self.backend = EngineBackend(values)
        self.backend.warn = lambda text: self.send(("warn", text))
        self.inbox: queue.Queue[tuple] = queue.Queue()
        self.stop: threading.Event | None = None  # the stop flag of the reply being decoded, or queued
        self._send_lock = threading.Lock()

    def send(self, msg: tuple) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def read(self) -> None:
        """The reader thread: a stop sets the reply's flag at once; the rest wait for the main thread."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the app is gone: leave now (its speculator dies with this process)
                os._exit(0)
            if msg[0] == "stream":
                self.stop = threading.Event()
                msg = (*msg, self.stop)
            elif msg[0] in ("stop", "close"):
                if self.stop is not None:
                    self.stop.set()
                if msg[0] == "stop":
                    continue
            self.inbox.put(msg)

    def state(self) -> dict[str, Any]:
        return {"info": self.backend.info(), "defaults": self.backend.sampling_defaults()}

    def run(self) -> None:
        threading.Thread(target=self.read, name="ssd-engine-reader", daemon=True).start()
        try:
            self.backend.load(lambda stage, frac: self.send(("progress", stage, frac)))
            self.send(("loaded", self.state(), vocabulary(self.backend.engine)))
        except BaseException as e:  # noqa: BLE001 - the app shows it as its load error
            self.send(("failed", readable(e)))
            return
        while True:
            msg = self.inbox.get()
            if msg[0] == "close":
                return
            if msg[0] == "stream":
                self.decode(*msg[1:])
            elif msg[0] == "count":
                try:
                    self.send(("counted", self.backend.count_tokens(msg[1])))
                except Exception:  # noqa: BLE001 - a tokenizer that fails: the reply's own check still runs
                    self.send(("counted", None))
            elif msg[0] == "reconfigure":
                try:
                    self.backend.reconfigure(**msg[1])
                except Exception as e:  # noqa: BLE001 - the app says it cannot change that
                    self.send(("error", readable(e)))
                else:
                    self.send(("ok", self.state()))

    def decode(self, messages: list[dict[str, str]], params: Any, stop: threading.Event) -> None:
        try:
            for ev in self.backend.stream(messages, params, stop):
                self.send(("event", ev))
        except Exception as e:  # noqa: BLE001 - an Error event, as the in-process reply worker makes it
            self.send(("event", Error(readable(e), "runtime")))
        self.send(("end", self.state()))

    def close(self) -> None:
        self.backend.close()  # stops the speculator and the tensor-parallel ranks


def main(conn: Any, values: dict[str, Any], parent_pid: int, compute_threads: int) -> None:
    """The engine process's entry point (spawned)."""
    if not processes.child_start(parent_pid):
        return
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a terminal that hangs up is the app's to answer
    threads.worker(compute_threads)
    host = Host(conn, values)
    try:
        host.run()
    except (EOFError, OSError):  # the app went away while this process answered it
        pass
    finally:
        host.close()
    os._exit(0)  # its workers are closed; the interpreter's teardown of torch would only delay the app's quit
