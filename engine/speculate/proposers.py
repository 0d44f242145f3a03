"""Where an SSD round's drafts come from.  The round (:mod:`ssd`) calls one small interface and
does not know which implementation it has:

* ``begin(Begin)``: a new reply (or the rest of one), whose tokens all have target KV;
* ``request(k_prev, bonus, verify_s)``: the outcome of the last round (``k_prev`` drafts accepted,
  -1 for the first round, then ``bonus``), told as soon as it is known, so that the speculator
  serves the next round while the verifier commits this one;
* ``drafts(stop) -> Proposal | None``: the drafts for that next round, or None if ``stop`` was set
  while waiting.  Raises SpeculatorError if the speculator failed (a failed ``request`` too).

:class:`RemoteProposer` is the speculator process (:mod:`worker`) behind :mod:`channel`:
its drafts come from the speculation cache built while the last round was verified (a hit) or
from a fallback (a miss).  After it fails, the reply goes on in this process as SD with the
in-process draft (:class:`LocalProposer`), or, without one, as AR (:class:`NoProposer`).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .. import processes
from ..sampling.penalties import Penalties
from ..sampling.host import read
from ..sampling.sampling import make_generator
from ..drafts.drafter import ModelDrafter, plain_choice
from ..model.forward import Forwards
from ..errors import SpeculatorError
from .channel import Begin, Channel, Close, Ready, Speculation
from ..fanout import FanOut
from .process import Recipe, worker_main

CLOSE_TIMEOUT_S = 3.0
# polling before sleeping: the verifier, for a reply (a hit answers within about 0.2 ms); the speculator,
# for the next request (due about when its tree is done)
VERIFIER_SPIN_S = 0.001
SPECULATOR_SPIN_S = 0.002


@dataclass(frozen=True)
class Proposal:
    """The drafts for one round."""

    tokens: tuple[int, ...]  # d_1..d_k
    q: torch.Tensor | None  # [k, V] the distributions they were drawn from; None: point masses
    draft_s: float  # drafting on the verifier's critical path
    sd_draft_s: float  # what SD would spend drafting these tokens (for the SD estimate)
    cache: Speculation | None = None  # SSD: the speculator's reply (where the drafts came from)

    def round_fields(self, wait_s: float) -> dict[str, Any]:
        """The SSD-only fields of this round's ``Round`` event (none for in-process drafts)."""
        r = self.cache
        if r is None:
            return {}
        return {"cache_hit": r.hit, "predicted": r.predicted, "wait_s": wait_s, "speculator_busy_s": r.build_s,
                "fallback": r.fallback}


class Proposer(Protocol):
    """Where an SSD round's drafts come from (the module docstring)."""

    def begin(self, msg: Begin) -> None: ...
    def request(self, k_prev: int, bonus: int, verify_s: float = 0.0) -> None: ...
    def drafts(self, stop: threading.Event | None = None) -> Proposal | None: ...


class RemoteProposer:
    """A running speculator process and its channel."""

    def __init__(self, recipe: Recipe, k: int, fan: FanOut, fallback: str, vocab: int, cores: tuple[int, ...] | None,
                 threads: int | None, timeout: float, fault: str | None = None, compile: str = "off", spin: bool = False) -> None:
        """``spin``: each side has a core (or device) of its own, so each polls for the other's next
        message before it sleeps (:class:`channel.Poller`)."""
        ctx = processes.context(forked=True)
        parent, child = ctx.Pipe(duplex=True)
        qbuf = torch.zeros(k, vocab, dtype=torch.float32).share_memory_()
        self.k = k
        self.proc = ctx.Process(target=worker_main, name="ssd-speculator", daemon=True,
                                args=(child, recipe, k, fan, fallback, vocab, qbuf, cores, threads, os.getpid(), fault, compile,
                                      SPECULATOR_SPIN_S if spin else 0.0))
        processes.start(self.proc)  # works under Textual too (its stderr has no fd)
        child.close()
        self.channel = Channel(parent, qbuf, self.proc.sentinel, VERIFIER_SPIN_S if spin else 0.0)
        self.ready = False
        self._failed: SpeculatorError | None = None
        self.forward: str | None = None  # what forwards the draft there (forward.LABELS), from Ready
        self._notices: list[str] = []  # what it said once loaded (on transformers, a compile that failed)
        self.pid = self.proc.pid
        self.timeout = timeout  # a silent speculator is given up on after this long
        self._finalizer = weakref.finalize(self, _shutdown, self.proc, parent)

    def wait_ready(self, timeout: float) -> None:
        if not self.ready:
            msg = self.channel.recv(timeout)
            if not isinstance(msg, Ready):
                raise SpeculatorError(f"unexpected first message from the speculator: {msg!r}")
            self.ready = True
            self.forward, self._notices = msg.forward, [f"speculator: {n}" for n in msg.notices]

    def take_notices(self) -> list[str]:
        """What the speculator said at its start, once."""
        out, self._notices = self._notices, []
        return out

    def begin(self, msg: Begin) -> None:
        self.channel.send(msg)  # the draft's prefill overlaps the target's last prompt row

    def request(self, k_prev: int, bonus: int, verify_s: float) -> None:
        try:
            self.channel.request(k_prev, bonus, verify_s)
        except SpeculatorError as e:  # raised by drafts(): the round that found the outcome still commits it
            self._failed = e

    def drafts(self, stop: threading.Event | None = None) -> Proposal | None:
        if self._failed is not None:
            raise self._failed
        reply = self.channel.reply(self.timeout, stop)
        if reply is None:
            return None
        return Proposal(reply.tokens, self.channel.q_rows(reply), reply.fallback_s, self.k * reply.step_s, reply)

    def ping(self) -> float:
        return self.channel.ping()

    def close(self) -> None:
        self._finalizer()


def _shutdown(proc: Any, conn: Any) -> None:
    """Ask the speculator to exit; terminate, then kill it if it does not.  Idempotent."""
    processes.stop(proc, conn, Close(), CLOSE_TIMEOUT_S)


class LocalProposer:
    """Plain SD drafting with the in-process draft (no speculation cache): k draft steps per round."""

    def __init__(self, forwards: Forwards, k: int, vocab: int, device: torch.device, compile: str = "off") -> None:
        self.forwards, self.k, self.vocab, self.device, self.compile = forwards, k, vocab, device, compile

    def begin(self, msg: Begin) -> None:
        self.params = msg.params
        self.gen = make_generator(None if msg.params.seed is None else msg.params.seed * 2 + 1, self.device)
        self.drafter = ModelDrafter(self.forwards, self.vocab, self.device, self.compile, (1, self.k + 1))
        self.drafter.prefill(list(msg.prompt_ids))
        self.ctx = list(msg.prompt_ids)  # tokens the target has committed
        n = len(self.ctx) if msg.prompt_len is None else msg.prompt_len
        self.pen = Penalties.of(msg.params, self.ctx[:n], self.ctx[n:])
        self.pending: int | None = None
        self.last: tuple[int, ...] = ()

    def request(self, k_prev: int, bonus: int, verify_s: float = 0.0) -> None:
        self._outcome = (k_prev, bonus)

    def drafts(self, stop: threading.Event | None = None) -> Proposal:
        t0 = time.perf_counter()
        k_prev, bonus = self._outcome
        if k_prev >= 0:
            self.ctx += [self.pending, *self.last[:k_prev]]  # type: ignore[list-item]
            self.pen.add([self.pending, *self.last[:k_prev]])  # type: ignore[list-item]
        self.pending = bonus
        self.drafter.rollback(len(self.ctx))
        drafted, qs = self.drafter.propose(self.ctx + [bonus], self.k, plain_choice(self.params, self.gen, self.pen, (bonus,)))
        self.last = tuple(read(drafted, "local drafts"))  # the round's drafts, read once
        q = None if qs[0] is None else torch.stack(qs)  # type: ignore[arg-type]
        draft_s = time.perf_counter() - t0
        return Proposal(self.last, q, draft_s, draft_s)


class NoProposer:
    """Nothing to draft with: every round verifies no drafts, a plain target step (AR)."""

    def begin(self, msg: Begin) -> None:
        pass

    def request(self, k_prev: int, bonus: int, verify_s: float = 0.0) -> None:
        pass

    def drafts(self, stop: threading.Event | None = None) -> Proposal:
        return Proposal((), None, 0.0, 0.0)
