"""Autoregressive decoding: the reference every faster decoder is tested against.

As plain as nanoGPT's ``generate``: one target forward per token, KV cache kept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import torch

from . import forward
from .detok import ReplyBuilder
from .events import Done, Error, Event, Notice, Token
from .metrics import Metrics
from .models import LoadedModel
from .params import SamplingParams
from .penalties import Penalties
from .sampling import make_generator, sample_next
from .errors import ModelError, ParamError, TPError


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


class ARDecoder:
    mode = "ar"

    def __init__(self, target: LoadedModel, compile: str = "auto") -> None:
        self.target = target
        self.compile = compile  # which forward: see forward.runner

    def stream(
        self, prompt_ids: list[int], params: SamplingParams, stop: threading.Event | None = None
    ) -> Iterator[Event]:
        t0 = time.perf_counter()
        model, dev = self.target.model, self.target.device
        budget = context_budget(self.target, len(prompt_ids), params)
        builder = ReplyBuilder(self.target.tokenizer, self.target.eos_ids, params.stop, budget, params.ignore_eos)
        metrics = Metrics(self.mode)
        gen = make_generator(params.seed, dev)
        pen = Penalties.of(params, prompt_ids)
        reason = None
        try:
            # prefill: the whole prompt in one forward
            runner = forward.runner(model, "target", self.compile, (1,), dev, title=self.target.name)
            logits = forward.prefill(runner, prompt_ids)
            metrics.prefill_s = time.perf_counter() - t0
            while True:
                for note in forward.take_notices(model):  # on transformers, or a compile that failed
                    yield Notice(note, "info")
                if stop is not None and stop.is_set():
                    reason = "cancelled"
                    break
                # sample one token, then feed it back
                tok = sample_next(pen.with_extra(logits, None), params.temperature, params.top_k, params.top_p, gen)
                pen.add([tok])
                delta = builder.push(tok)
                if builder.reason != "eos":
                    ev = Token(tok, delta, "target", time.perf_counter() - t0)
                    metrics.add(ev)
                    yield ev
                if builder.finished:
                    reason = builder.reason
                    break
                logits = runner.append([tok]).logits[-1]
        except Exception as e:  # noqa: BLE001 - reported as an event, with the partial reply
            yield error_event(e, builder)
            return
        yield Done(reason, builder.text + builder.flush(), tuple(builder.token_ids), metrics.stats(time.perf_counter() - t0))
