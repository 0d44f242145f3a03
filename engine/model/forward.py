"""Which forward runs a model: the compact core (:mod:`core`) where it can, else transformers.

A :class:`Forwards` is one model's handle in this process (``LoadedModel.forwards``; the speculator
process makes its own): every decoder gets its :mod:`runner` runners from it.  ``compile`` is the
``--compile`` setting: ``off`` the core eager, ``on`` every row shape compiled, ``auto`` compiled on
GPUs and, on CPU, the target compiled (:mod:`aoti`) and drafts eager; ``transformers`` the reference
path on a ``DynamicCache``.  A model the core does not run (:func:`core.supports`) keeps the
transformers path, with one notice saying why; a tensor-parallel target (``sharded``) always runs
the core, over its ranks.

The handle keeps one core per role and row shapes, so each reply reuses the cache buffer and the
compiled graphs of the one before.  Notices are queued once each; the decoder frame hands them on
as :class:`events.Notice`.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..config import COMPILE
from ..cpu import quant
from ..errors import ParamError
from . import runner as kv, simulate
from .core import Core, supports

LABELS = ("core eager", "core compiled", "transformers")


class Forwards:
    """One model's forwards: its cores, its last runner per role, its notices, its tensor-parallel ranks."""

    def __init__(self, model: torch.nn.Module, title: str | None = None, sharded: Any = None) -> None:
        self.model = model
        self.title = title  # the model's name in messages (an out-of-memory cache, a failed compile)
        self.sharded = sharded  # tp.load.Sharded: the ranks that hold this (weightless) model's weights
        self._cores: dict[tuple, Core] = {}
        self._runners: dict[tuple[str, str], kv.Runner | kv.CoreRunner] = {}  # (role, compile) -> the last runner made
        self._said: set[str] = set()
        self._pending: list[str] = []
        self._last: dict[str, kv.Runner | kv.CoreRunner] = {}  # role -> the runner of its last reply
        # () -> (make, recipe): how a background compile process rebuilds this model (``auto`` on CPU,
        # :mod:`background`); None: shapes compile before their first use, as under ``on``
        self.source: Any = None

    def say(self, text: str) -> None:
        if text not in self._said:
            self._said.add(text)
            self._pending.append(text)

    def take_notices(self) -> list[str]:
        """The notices queued since the last call (each said once)."""
        out, self._pending = self._pending, []
        return out

    def runner(self, role: str, compile: str = "off", rows: tuple[int, ...] = (1,),
               device: torch.device | None = None, mid_layer: int | None = None) -> kv.Runner | kv.CoreRunner:
        """A runner in the role ``role`` (target, draft), at length 0 (see the module docstring).
        ``rows``: the row counts the decoder's forwards have (compiled shapes under on/auto)."""
        if compile not in COMPILE:
            raise ValueError(f"compile must be one of {', '.join(COMPILE)}, got '{compile}'")
        model, requested = self.model, compile
        if self.sharded is not None:
            if mid_layer is not None:
                raise ParamError("a feature draft reads the target's hidden states, which a tensor-parallel target does not return")
            core = self.sharded.core(self.say)  # started again if a rank was lost
            core.reset()
            made: kv.Runner | kv.CoreRunner = kv.CoreRunner(core)
        elif compile != "transformers" and supports(model)[0]:
            compile = _effective(compile, role, model)
            key = (role, mid_layer, compile, () if compile == "off" else tuple(sorted(set(rows))))
            core = self._cores.get(key)
            if core is None:
                core = self._cores[key] = Core(model, self.title or role, compile=compile, rows=key[3], mid_layer=mid_layer,
                                               notify=self.say, progress=self.say)
                core.compiler.source = self.source
            core.reset()
            core.compiler.begin()
            core.latency = simulate.latency(role)
            made = kv.CoreRunner(core)
        else:
            if compile != "transformers":
                self.say(f"the {role} runs on transformers, not the compact core: {supports(model)[1]}")
            made = kv.Runner(model, device, mid_layer=mid_layer)
        self._runners[role, requested] = made
        self._last[role] = made
        return made

    def path(self, role: str = "target") -> str | None:
        """Which path the last reply in ``role`` ran: "compiled" (its graphs) or "eager"; None before any."""
        r = self._last.get(role)
        if r is None:
            return None
        compiler = getattr(getattr(r, "core", None), "compiler", None)
        return "compiled" if compiler is not None and compiler.compiled else "eager"

    def status(self) -> str | None:
        """What a background compile of this model is doing ("compiling ... in the background, 40%"), or None."""
        return next(filter(None, (core.compiler.status() for core in self._cores.values())), None)

    def wait_for_builds(self, say: Callable[[str], None] = lambda s: None, every_s: float = 10.0) -> bool:
        """Until no graph of this model is being built in the background, passing :meth:`status` to ``say``
        every ``every_s``; True if it waited."""
        waited, said_at = False, -every_s
        while (busy := self.status()) is not None:
            if time.monotonic() - said_at >= every_s:
                say(busy)
                said_at = time.monotonic()
            waited = True
            time.sleep(0.5)
        return waited

    def predict(self, compile: str) -> str:
        """The label a runner will have, before one exists (``auto``: "core auto")."""
        if self.sharded is not None:
            return self.sharded.label
        if compile == "transformers" or not supports(self.model)[0]:
            return "transformers"
        return {"off": "core eager", "on": "core compiled"}.get(compile, "core auto")

    def label(self, role: str, compile: str) -> str:
        """What forwards the model in the role ``role``: its last runner's label, else :meth:`predict`."""
        r = self._runners.get((role, compile))
        return r.label if r is not None else self.predict(_effective(compile, role, self.model))

    def close(self) -> None:
        """Stop the background compiles and the ranks that run the model, if it has any (idempotent)."""
        for core in self._cores.values():
            core.compiler.close()
        if self.sharded is not None:
            self.sharded.close()


def _effective(compile: str, name: str, model: torch.nn.Module) -> str:
    """``compile`` as :meth:`Forwards.runner` applies it: on CPU ``auto`` compiles a target with Q4 GGUF
    blocks (the int4 GEMM in row-invariant graphs: the configuration measured fastest there) and runs
    anything else eagerly."""
    first = next(model.parameters(), None) if compile == "auto" else None
    if first is None or first.device.type != "cpu":
        return compile
    return "auto" if name == "target" and quant.int4_ready(model) else "off"


def prefill(runner: Any, ids: list[int]) -> torch.Tensor:
    """Feed a prompt; the logits after its last token.  Every decoder computes a prompt this way: all
    but the last token in one forward (eager: :meth:`core.Core._forward`; :func:`feed`), the last as a
    decode-time row (:func:`last`), which SD's first verify also computes as its row 0.  With
    row-invariant forwards (the compiled CPU core) AR, SD and SSD then see the very same numbers."""
    feed(runner, ids)
    return last(runner, ids)


def feed(runner: Any, ids: list[int]) -> None:
    """All but the last token of a prompt, in one eager forward on the calling thread's torch threads
    (SSD runs it on AR's threads, before pinning its verifier to its one core: the bulk of its TTFT)."""
    if len(ids) > 1:
        runner.append(ids[:-1], logits="none")


def last(runner: Any, ids: list[int]) -> torch.Tensor:
    """The prompt's last token as a decode-time row, after :func:`feed`: the logits of the first new token."""
    return runner.append(ids[-1:]).logits[-1]
