"""Autoregressive decoding: the reference every faster decoder is tested against.

As plain as nanoGPT's ``generate``: one target forward per token, KV cache kept.
"""

from __future__ import annotations

import time
from collections.abc import Generator

from ..events import Event, Token
from ..load.models import LoadedModel
from ..model import forward
from ..params import SamplingParams
from .decoder import Decoder, ReplyFrame, context_budget
from . import logprobs
from ..sampling.penalties import Penalties
from ..sampling.sampling import make_generator, sample_next


class ARDecoder(Decoder):
    mode = "ar"

    def __init__(self, target: LoadedModel, compile: str = "auto") -> None:
        self.target = target
        self.compile = compile  # which forward: see forward.Forwards.runner

    def _budget(self, num_prompt: int, params: SamplingParams) -> int:
        return context_budget(self.target, num_prompt, params)

    def _reply(self, prompt_ids: list[int], r: ReplyFrame) -> Generator[Event, None, None]:
        dev, params, builder = self.target.device, r.params, r.builder
        gen = make_generator(params.seed, dev)
        pen = Penalties.of(params, prompt_ids)
        # prefill: the whole prompt in one forward
        runner = self.target.forwards.runner("target", self.compile, (1,), dev)
        logits = forward.prefill(runner, prompt_ids)
        r.metrics.prefill_s = time.perf_counter() - r.t0
        while (yield from r.go_on()):
            # sample one token, then feed it back
            tok = sample_next(pen.apply(logits), params.temperature, params.top_k, params.top_p, gen)
            pen.add([tok])
            delta = builder.push(tok)
            lp = logprobs.of_rows(logits[None], [tok], params.logprobs)[0] if params.logprobs is not None else (None, None)
            if builder.reason == "eos" and params.logprobs is not None:
                builder.eos_logprob = (tok, *lp)  # type: ignore[assignment]
            if builder.reason != "eos":
                ev = Token(tok, delta, "target", time.perf_counter() - r.t0, *lp)
                r.metrics.add(ev)
                yield ev
            if builder.finished:
                break
            logits = runner.append([tok]).logits[-1]
