"""The frame every decoder (AR, SD, SSD) shares: one reply from prompt to Done.

A mode supplies its context budget, what may leave notices (the handles of the models it runs
here, :class:`forward.Forwards`; SSD's speculator) and its body (prefill, then a loop of steps);
the frame owns the rest, so the events around the loop are the same in every mode: before each
step the notices left since the last and the stop flag; a failure ends the reply with an Error that
keeps the partial reply, anything else with a Done carrying the stats.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..errors import ModelError, ParamError, TPError
from ..events import Done, DoneReason, Error, Event, Notice, Token
from ..load.models import LoadedModel
from ..metrics import Metrics
from ..params import SamplingParams
from . import logprobs
from .detok import ReplyBuilder


def context_budget(model: LoadedModel, num_prompt: int, params: SamplingParams, lookahead: int = 0) -> int:
    """How many new tokens fit in the model's context (raises if the prompt alone does not fit).

    ``lookahead`` reserves room for draft tokens a speculative decoder scores past the budget.
    """
    ctx = int(getattr(model.model.config, "max_position_embeddings", 0) or 0)
    if num_prompt == 0:
        raise ParamError("the prompt is empty")
    if ctx and num_prompt >= ctx:
        raise ParamError(f"the prompt is {num_prompt} tokens but '{model.name}' has a context of {ctx} tokens; shorten it or start a new chat")
    return min(params.max_new_tokens, ctx - num_prompt - lookahead) if ctx else params.max_new_tokens


def error_event(exc: BaseException, builder: ReplyBuilder) -> Error:
    """An Error event for a failure mid-reply, keeping what was produced."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        msg, kind = "out of GPU memory during generation; try a shorter chat, fewer new tokens or a smaller model", "oom"
    elif isinstance(exc, ModelError):  # e.g. no memory for a KV cache: its message names the model and the size
        msg, kind = str(exc), "oom" if "out of memory" in str(exc) else "runtime"
    elif isinstance(exc, TPError):  # a rank died or hung: all were closed, and the next reply starts them (tp_load)
        msg, kind = f"{exc}; they start again with the next message", "runtime"
    else:
        msg, kind = f"{type(exc).__name__}: {exc}", "runtime"
    return Error(msg, kind, builder.text + builder.flush(), tuple(builder.token_ids))


def emit_block(
    builder: ReplyBuilder, metrics: Metrics, drafts: list[int], num_accepted: int, bonus: int, t0: float,
    logits: torch.Tensor | None = None, top: int | None = None,
) -> Generator[Token, None, tuple[int, int | None]]:
    """Push one round's accepted drafts and bonus through ``builder``, yielding their Token
    events; EOS / stop / length end the block at that token.  Returns ``(emitted, bonus_id)``
    (bonus_id None if the reply ended before the bonus).  Shared by SD and SSD.  With ``top``
    (the request's logprobs), the tokens carry their logprobs from the verify's raw ``logits``
    (row i scored token i of the block)."""
    emitted, bonus_id = 0, None
    t = time.perf_counter() - t0  # one time for the block: its tokens became known together
    block = [*drafts[:num_accepted], bonus]
    lps = logprobs.of_rows(logits, block, top) if top is not None and logits is not None else None
    for i, tok in enumerate(block):
        delta = builder.push(tok)
        if i == num_accepted:
            bonus_id = tok
        if builder.reason != "eos":
            ev = Token(tok, delta, "draft" if i < num_accepted else "target", t,
                       *(lps[i] if lps is not None else (None, None)))
            emitted += 1
            metrics.add(ev)
            yield ev
        elif lps is not None:
            builder.eos_logprob = (tok, *lps[i])
        if builder.finished:
            break
    return emitted, bonus_id


class Noticing(Protocol):
    """What leaves notices for the reply: a model's handle, the speculator."""

    def take_notices(self) -> list[str]: ...


@dataclass
class ReplyFrame:
    """One reply as the frame sees it; a mode's body reads and advances it."""

    builder: ReplyBuilder
    metrics: Metrics
    params: SamplingParams
    stop: threading.Event | None
    noticed: tuple[Noticing, ...] = ()  # what may leave notices during the reply (Decoder._noticed)
    t0: float = field(default_factory=time.perf_counter)  # the reply's clock: event times and stats count from here
    cancelled: bool = False

    def go_on(self) -> Generator[Event, None, bool]:
        """Before each step: the notices the models left (on transformers, a compile that failed),
        then the stop flag.  False once the reply is over."""
        if self.builder.finished:
            return False
        yield from self.notices()
        if self.stop is not None and self.stop.is_set():
            self.cancelled = True
        return not self.cancelled

    def notices(self) -> Iterator[Notice]:
        """The notices the models left since the last call."""
        for source in self.noticed:
            for note in source.take_notices():
                yield Notice(note, "info")

    @property
    def reason(self) -> DoneReason | None:
        return "cancelled" if self.cancelled else self.builder.reason


class Decoder(ABC):
    """A mode's decoder: :meth:`stream` is the frame; the mode supplies ``_budget`` and ``_reply``."""

    mode: str
    target: LoadedModel

    def stream(self, prompt_ids: list[int], params: SamplingParams, stop: threading.Event | None = None) -> Iterator[Event]:
        budget = self._budget(len(prompt_ids), params)  # a prompt that does not fit raises here, before any event
        builder = ReplyBuilder(self.target.tokenizer, self.target.eos_ids, params.stop, budget, params.ignore_eos)
        metrics = Metrics(self.mode)
        self._prepare()
        r = ReplyFrame(builder, metrics, params, stop, self._noticed())
        try:
            first = True
            for ev in self._reply(prompt_ids, r):
                if first and isinstance(ev, Token):  # what the reply's setup said (a compile starting) comes first
                    first = False
                    yield from r.notices()
                yield ev
        except Exception as e:  # noqa: BLE001 - reported as an event, with the partial reply
            yield error_event(e, builder)
            return
        metrics.path = self.target.forwards.path("target")
        yield Done(r.reason, builder.text + builder.flush(), tuple(builder.token_ids), metrics.stats(time.perf_counter() - r.t0),
                   builder.eos_logprob)

    @abstractmethod
    def _budget(self, num_prompt: int, params: SamplingParams) -> int:
        """How many new tokens the reply may have (:func:`context_budget` for the models it uses)."""

    def _noticed(self) -> tuple[Noticing, ...]:
        """What may leave notices during a reply: the handles of the models it runs here."""
        return (self.target.forwards,)

    def _prepare(self) -> None:
        """Work before the reply's clock starts (SSD: the speculator's load)."""

    @abstractmethod
    def _reply(self, prompt_ids: list[int], r: ReplyFrame) -> Generator[Event, None, None]:
        """The mode's prefill and loop: ``while (yield from r.go_on()): <one step>``."""
