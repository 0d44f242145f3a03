"""Verifier <-> speculator messages (the frozen dataclasses below) over one duplex ``multiprocessing`` Pipe.

The draft's proposal distributions q' of the k speculated tokens go through one shared-memory
tensor ``[k, V]`` float32 instead: the speculator writes it *before* it answers and the verifier
reads it before it sends its next request, so the buffer is never written while it is read.  Under
greedy decoding, and for fast-fallback tokens, q' is a point mass and nothing is written
(``Speculation.has_q`` is False).
"""

from __future__ import annotations

import select
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from ..errors import SpeculatorError
from ..params import SamplingParams


@dataclass(frozen=True, slots=True)
class Begin:
    """A new reply, or the rest of one: the draft samples with the target's ``params``."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    saguaro_c: float = 1.0  # EngineConfig.saguaro_c: how q' is reshaped at temperature > 0
    prompt_len: int | None = None  # tokens of prompt_ids that are prompt (the rest: reply so far); None: all


@dataclass(frozen=True, slots=True)
class Spec:
    req: int
    k_prev: int  # drafts the target accepted last round (-1: the first round of a reply)
    bonus: int  # the token the target sampled after them
    verify_s: float  # how long that verification took (for --fallback auto)


@dataclass(frozen=True, slots=True)
class Ping:
    req: int


@dataclass(frozen=True, slots=True)
class Close:
    pass


@dataclass(frozen=True, slots=True)
class Ready:
    pid: int
    threads: int
    forward: str = "transformers"  # what forwards the draft there (forward.LABELS)
    notices: tuple[str, ...] = ()  # e.g. why the draft is not on the core


@dataclass(frozen=True, slots=True)
class Pong:
    req: int


@dataclass(frozen=True, slots=True)
class Failed:
    message: str


@dataclass(frozen=True, slots=True)
class Speculation:
    """The speculation for one round."""

    req: int
    tokens: tuple[int, ...]  # d_1..d_k
    has_q: bool  # q' rows are in the shared buffer (else: point masses on the tokens)
    hit: bool  # served from the speculation cache
    fallback: str | None  # "neural" | "fast" on a miss
    fallback_s: float  # time the fallback drafting took (on the verifier's critical path)
    predicted: tuple[tuple[int, tuple[int, ...]], ...]  # the cache this lookup searched: ((j, (bonus...)), ...)
    build_s: float  # speculator compute that built that cache (glue + tree)
    step_s: float  # the speculator's median warm single-token draft step (for the SD estimate)


class Channel:
    """The verifier's end: requests with a deadline that notice a dead or silent speculator."""

    def __init__(self, conn: Connection, qbuf: torch.Tensor, sentinel: int | None = None, spin_s: float = 0.0) -> None:
        self.conn = conn
        self.qbuf = qbuf  # [k, V] float32, shared with the speculator
        self.sentinel = sentinel  # the speculator process's sentinel (readable once it has exited)
        self.spin_s = spin_s  # how long recv polls before it sleeps (0 where a core is shared)
        self._ready = Poller(conn)
        self._req = 0

    def send(self, msg: Any) -> None:
        try:
            self.conn.send(msg)
        except (OSError, EOFError, ValueError):
            raise SpeculatorError("the speculator process exited unexpectedly") from None

    def recv(self, timeout: float, stop: Any = None, want_req: int | None = None) -> Any:
        """The next message (skipping stale replies to older requests); raises SpeculatorError
        if the speculator died, reported an error or stayed silent for ``timeout`` seconds.
        Returns None if ``stop`` (a threading.Event) was set while waiting."""
        deadline = time.perf_counter() + timeout
        self._ready.spin(self.spin_s)
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise SpeculatorError(f"the speculator did not answer within {timeout:g} s")
            waitables: list[Any] = [self.conn] + ([self.sentinel] if self.sentinel is not None else [])
            ready = wait(waitables, timeout=min(left, 0.05 if stop is not None else left))
            if self.conn in ready:
                try:
                    msg = self.conn.recv()
                except (OSError, EOFError):
                    raise SpeculatorError("the speculator process exited unexpectedly") from None
                if isinstance(msg, Failed):
                    raise SpeculatorError(f"the speculator failed: {msg.message}")
                if want_req is not None and isinstance(msg, (Speculation, Pong)) and msg.req != want_req:
                    continue  # an answer to a request of an abandoned reply
                return msg
            if self.sentinel is not None and self.sentinel in ready:
                raise SpeculatorError("the speculator process exited unexpectedly")
            if stop is not None and stop.is_set():
                return None

    def request(self, k_prev: int, bonus: int, verify_s: float) -> None:
        """Send the last outcome; the speculator starts serving the next round's drafts (:meth:`reply`)."""
        self._req += 1
        self.send(Spec(self._req, k_prev, bonus, verify_s))

    def reply(self, timeout: float, stop: Any = None) -> Speculation | None:
        """The speculation for the last request (None if ``stop`` was set while waiting)."""
        return self.recv(timeout, stop, want_req=self._req)

    def ping(self, timeout: float = 5.0) -> float:
        """One round trip through the speculator's loop, in seconds."""
        self._req += 1
        t0 = time.perf_counter()
        self.send(Ping(self._req))
        self.recv(timeout, want_req=self._req)
        return time.perf_counter() - t0

    def q_rows(self, reply: Speculation) -> torch.Tensor | None:
        """q' for the reply's tokens [k, V] (a copy), or None for point masses."""
        return self.qbuf[: len(reply.tokens)].clone() if reply.has_q else None


class Poller:
    """Polls a connection without sleeping: a sleeping process is woken up tens of microseconds after
    its message arrives (more on a VM), and both ends of a round wait on each other once per round.
    The caller spins only where it has a core of its own."""

    def __init__(self, conn: Connection) -> None:
        self._poll = select.poll()
        self._poll.register(conn.fileno(), select.POLLIN)

    def spin(self, seconds: float) -> bool:
        """Poll for up to ``seconds``; True once a message (or EOF) is waiting."""
        end = time.perf_counter() + seconds
        while True:
            if self._poll.poll(0):
                return True
            if time.perf_counter() >= end:
                return False
