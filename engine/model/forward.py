"""Which forward runs a model: the compact core (:mod:`core`) where it can, else transformers.

:func:`runner` is what every decoder and the SSD speculator call to get a :mod:`runner` runner.
``compile`` is the ``--compile`` setting:

* ``off``: the core, eager; ``on``: the core, every row shape compiled; ``auto``: the core,
  compiled on GPUs; on CPU the target compiled (AOTInductor packages, :mod:`aoti`) and drafts eager;
* ``transformers``: the transformers modules on a ``DynamicCache`` (the reference path).

A model the core does not run (:func:`core.supports`: another architecture, a feature draft, a
model split over devices) keeps the transformers path, with one notice saying why.  A
tensor-parallel target (:mod:`tp.load`) has a :class:`tp.load.Sharded` attached (:func:`attach`):
its runner is always the core, over its ranks.

Cores are kept with their model, one per role (``name``: target, draft) and row shapes, so each
reply reuses the cache buffer and the compiled graphs of the one before (a reply starts with
``reset``).  Notices (why a model is on transformers, a compile that failed) are queued once per
model and role; decoders hand them on as :class:`events.Notice` (:func:`take_notices`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import COMPILE
from ..cpu import quant
from ..errors import ParamError
from . import runner as kv, simulate
from .core import Core, supports

LABELS = ("core eager", "core compiled", "transformers")


class _State:
    """What this process keeps per model: its cores, its last runner per role, notices."""

    def __init__(self, owner: int = 0) -> None:
        self.owner = owner  # id() of the model this belongs to: a shallow copy (copy.copy) shares the __dict__ entry
        self.cores: dict[tuple, Core] = {}
        self.runners: dict[tuple[str, str], Any] = {}  # (role, compile) -> the last runner made
        self.said: set[str] = set()
        self.pending: list[str] = []
        self.sharded: Any = None  # tp.load.Sharded: the ranks that hold this (weightless) model's weights

    def __deepcopy__(self, memo: dict) -> "_State":
        return _State()  # a copied model (the ``copy`` draft) gets cores of its own

    def say(self, text: str) -> None:
        if text not in self.said:
            self.said.add(text)
            self.pending.append(text)


_ATTR = "_ssd_chat_forward"  # kept on the model itself: a weak mapping would keep it alive (core -> model)


def _own(model: torch.nn.Module) -> _State | None:
    st = model.__dict__.get(_ATTR)
    return st if st is not None and st.owner == id(model) else None


def _state(model: torch.nn.Module) -> _State:
    st = model.__dict__.get(_ATTR)
    if st is None or st.owner != id(model):  # none yet, or inherited by a shallow copy (a derived draft)
        st = model.__dict__[_ATTR] = _State(id(model))
    return st


def runner(model: torch.nn.Module, name: str, compile: str = "off", rows: tuple[int, ...] = (1,),
           device: torch.device | None = None, mid_layer: int | None = None, title: str | None = None) -> kv.Runner | kv.CoreRunner:
    """A runner for ``model`` in the role ``name`` (target, draft), at length 0 (see the module docstring).
    ``rows``: the row counts the decoder's forwards have (compiled shapes under on/auto); ``title``:
    the model's name in messages (an out-of-memory cache, a failed compile)."""
    if compile not in COMPILE:
        raise ValueError(f"compile must be one of {', '.join(COMPILE)}, got '{compile}'")
    st = _state(model)
    if st.sharded is not None:
        if mid_layer is not None:
            raise ParamError("a feature draft reads the target's hidden states, which a tensor-parallel target does not return")
        core = st.sharded.core(st.say)  # started again if a rank was lost
        core.reset()
        st.runners[name, compile] = kv.CoreRunner(core)
        return st.runners[name, compile]
    if compile != "transformers":
        ok, why = supports(model)
        if ok:
            compile = _effective(compile, name, model)
            key = (name, mid_layer, compile, () if compile == "off" else tuple(sorted(set(rows))))
            core = st.cores.get(key)
            if core is None:
                core = st.cores[key] = Core(model, title or name, compile=compile, rows=key[3], mid_layer=mid_layer,
                                            notify=st.say, progress=st.say)
            core.reset()
            core.latency = simulate.latency(name)
            st.runners[name, compile] = kv.CoreRunner(core)
            return st.runners[name, compile]
        st.say(f"the {name} runs on transformers, not the compact core: {why}")
    st.runners[name, compile] = kv.Runner(model, device, mid_layer=mid_layer)
    return st.runners[name, compile]


def _effective(compile: str, name: str, model: torch.nn.Module) -> str:
    """``compile`` as :func:`runner` applies it: on CPU ``auto`` compiles a target with Q4 GGUF blocks
    (the int4 GEMM in row-invariant graphs: the configuration measured fastest there) and runs
    anything else eagerly."""
    first = next(model.parameters(), None) if compile == "auto" else None
    if first is None or first.device.type != "cpu":
        return compile
    return "auto" if name == "target" and quant.int4_ready(model) else "off"


def prefill(runner: Any, ids: list[int]) -> torch.Tensor:
    """Feed a prompt; the logits after its last token.  Every decoder computes a prompt this way: all
    but the last token in one forward (eager: :meth:`core.Core._forward`), the last as a decode-time
    row, which SD's first verify also computes as its row 0.  With row-invariant forwards (the
    compiled CPU core) AR, SD and SSD then see the very same numbers."""
    if len(ids) > 1:
        runner.append(ids[:-1], logits="none")
    return runner.append(ids[-1:]).logits[-1]


def attach(model: torch.nn.Module, sharded: Any) -> None:
    """Run ``model`` (weightless) on the ranks of ``sharded`` from now on (see :mod:`tp.load`)."""
    _state(model).sharded = sharded


def attached(model: torch.nn.Module) -> Any:
    """The :class:`tp.load.Sharded` that runs ``model``, if any."""
    got = _own(model)
    return got.sharded if got is not None else None


def close(model: torch.nn.Module | None) -> None:
    """Stop the ranks that run ``model``, if it has any (idempotent)."""
    sharded = attached(model) if model is not None else None
    if sharded is not None:
        sharded.close()


def predict(model: torch.nn.Module, compile: str) -> str:
    """The label a runner for ``model`` will have, before one exists (``auto``: "core auto")."""
    sharded = attached(model)
    if sharded is not None:
        return sharded.label
    if compile == "transformers" or not supports(model)[0]:
        return "transformers"
    return {"off": "core eager", "on": "core compiled"}.get(compile, "core auto")


def label(model: torch.nn.Module, name: str, compile: str) -> str:
    """What forwards ``model`` in the role ``name``: its last runner's label, else :func:`predict`."""
    got = _own(model)
    r = got.runners.get((name, compile)) if got is not None else None
    return r.label if r is not None else predict(model, _effective(compile, name, model))


def take_notices(*models: torch.nn.Module | None) -> list[str]:
    """The notices queued for these models since the last call (each said once per process)."""
    out: list[str] = []
    for m in models:
        st = _own(m) if m is not None else None
        if st is not None and st.pending:
            out += st.pending
            st.pending.clear()
    return out
