"""Autoregressive decoding: the reference every faster decoder is tested against.

As plain as nanoGPT's ``generate``: one target forward per token, KV cache kept.
"""

from __future__ import annotations

import time
from collections.abc import Generator

from ..events import Event
from ..load.models import LoadedModel
from ..model import forward
from ..params import SamplingParams
from .decoder import Decoder, ReplyFrame, context_budget, emit_block
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
            yield from emit_block(builder, r.metrics, [], 0, tok, r.t0, logits[None], params.logprobs)
            if builder.finished:
                break
            logits = runner.append([tok]).logits[-1]
