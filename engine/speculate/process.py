"""The speculator process: load the draft, then serve the verifier's requests (:mod:`channel`).

The draft is rebuilt here from a :class:`Recipe` (a folder to load, or for models that exist
only in memory a config and a state dict), never pickled whole.  The process is pinned to its
own cores, dies with its parent (:func:`processes.child_start`) and reports a failure as a
:class:`channel.Failed` before it exits.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from .. import processes
from ..model.forward import Forwards
from .channel import Begin, Close, Failed, Ping, Poller, Pong, Ready, Spec
from ..fanout import FanOut
from .speculator import Speculator


@dataclass(frozen=True)
class Recipe:
    """How the worker gets its draft without pickling a big model: load a folder (and derive
    ``derived`` from it), or for models that exist only in memory (tests), a config + state_dict.
    ``gguf``: the GGUF whose blocks the model computes from (:mod:`precision`), as in the app."""

    dtype: torch.dtype
    device: str
    folder: str | None = None
    config: Any = None
    state_dict: dict | None = None
    derived: str | None = None  # copy | int8 | layers:N | a trained draft's folder, applied to what folder/state_dict holds
    gguf: str | None = None


def recipe_for(draft: Any, target: Any, device: str, dtype: torch.dtype) -> Recipe:
    """The recipe that rebuilds ``draft`` (a LoadedModel) in another process."""
    from ..load import precision

    derived = draft.spec.source if draft.spec.kind == "derived" else None
    src = target if derived else draft
    gguf = src.spec.source if precision.state(src) is not None else None
    if src.folder is not None and (src.folder / "config.json").is_file():
        return Recipe(dtype, device, folder=str(src.folder), derived=derived, gguf=gguf)
    with precision.float_view(src):  # the float weights (GGUF linears hold no state_dict entries)
        state = {n: t.detach().cpu() for n, t in src.model.state_dict().items()}
    return Recipe(dtype, device, config=src.model.config, state_dict=state, derived=derived, gguf=gguf)


def build_model(recipe: Recipe) -> torch.nn.Module:
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from ..drafts import gguf as gguf_drafts
    from ..load import precision
    from ..load.models import LoadedModel, ModelSpec, Placement

    dev = torch.device(recipe.device)
    if recipe.folder is not None:
        model = AutoModelForCausalLM.from_pretrained(recipe.folder, dtype=recipe.dtype)
    else:
        model = AutoModelForCausalLM.from_config(recipe.config).to(recipe.dtype)
        model.load_state_dict(recipe.state_dict)
    model = model.to(dev).eval()
    spec = ModelSpec("target", "gguf", recipe.gguf) if recipe.gguf else ModelSpec("target", "folder", recipe.folder or "memory")
    base = LoadedModel("target", spec, model, None, Placement(dev, recipe.dtype), folder=Path(recipe.folder) if recipe.folder else None)
    if recipe.gguf:
        precision.to_gguf(base)  # the tiles from the converted folder's cache, as the app read them
    if recipe.derived:
        model = gguf_drafts.derive(recipe.derived, base).model
    from ..cpu import fastlinear

    fastlinear.install(model)  # as models.load_model does for the app's models (CPU float32 only)
    return model.eval()


def worker_main(conn: Any, recipe: Recipe, k: int, fan_out: FanOut, fallback: str, vocab: int, qbuf: torch.Tensor,
                cores: tuple[int, ...] | None, threads: int | None, parent_pid: int, fault: str | None = None,
                compile: str = "off", spin_s: float = 0.0) -> None:
    """The speculator process: load the draft, then serve requests until ``close`` or EOF.  ``spin_s``:
    how long it polls for the next request before it sleeps (0 where it shares a core)."""
    if not processes.child_start(parent_pid):
        return
    try:
        if cores is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
        if threads:
            torch.set_num_threads(threads)
        model = build_model(recipe)
        spec = Speculator(Forwards(model), k, fan_out, fallback, vocab, compile)  # after the thread count: compiled kernels depend on it
        warm = getattr(getattr(spec.runner, "core", None), "warm", None)
        if compile in ("on", "auto") and warm is not None:
            warm()  # compile every row shape before Ready, not inside the verifier's per-request timeout
        conn.send(Ready(os.getpid(), torch.get_num_threads(), spec.runner.label, tuple(spec.forwards.take_notices())))
        _serve_loop(conn, spec, qbuf, _Fault.parse(fault), spin_s)
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    except BaseException as e:  # noqa: BLE001 - reported to the verifier, which falls back
        try:
            conn.send(Failed(f"{type(e).__name__}: {e}"))
        except (OSError, EOFError):
            pass
        sys.exit(1)
    processes.exit_now()


@dataclass
class _Fault:
    """Test hook (``SSDDecoder.fault``): ``raise:N``, ``sleep:N:S``, ``exit:N`` at the N-th request."""

    kind: str
    at: int
    arg: float = 0.0

    @staticmethod
    def parse(s: str | None) -> "_Fault | None":
        if not s:
            return None
        parts = s.split(":")
        return _Fault(parts[0], int(parts[1]), float(parts[2]) if len(parts) > 2 else 0.0)

    def fire(self, n: int) -> None:
        if n != self.at:
            return
        if self.kind == "raise":
            raise RuntimeError("injected fault")
        if self.kind == "sleep":
            time.sleep(self.arg)
        if self.kind == "exit":
            os._exit(3)


def stops_tree(msg: Any, building: frozenset[tuple[int, int]]) -> bool:
    """Whether a message that arrives during a tree ends the tree: a new reply or close, or a request
    for an outcome the tree does not answer (a miss: its fallback should start now, not after the
    tree).  A ping, or a request the tree answers (a hit), waits for the tree."""
    return isinstance(msg, (Begin, Close)) or (isinstance(msg, Spec) and (msg.k_prev, msg.bonus) not in building)


def _serve_loop(conn: Any, spec: Speculator, qbuf: torch.Tensor, fault: _Fault | None, spin_s: float = 0.0) -> None:
    pending: list[Any] = []
    num_requests = 0
    ready = Poller(conn)

    def abort() -> bool:
        while conn.poll():
            pending.append(conn.recv())
        return any(stops_tree(m, spec.building) for m in pending)

    while True:
        if not pending:
            ready.spin(spin_s)  # the next request is due about when the tree is done
        msg = pending.pop(0) if pending else conn.recv()
        if isinstance(msg, Close):
            return
        if isinstance(msg, Ping):
            conn.send(Pong(msg.req))
        elif isinstance(msg, Begin):
            spec.begin(msg)
        elif isinstance(msg, Spec):
            num_requests += 1
            if fault is not None:
                fault.fire(num_requests)
            reply, q = spec.serve(msg.req, msg.k_prev, msg.bonus, msg.verify_s)
            if q is not None:
                qbuf[: q.shape[0]].copy_(q)
            conn.send(reply)
            spec.build(abort)
