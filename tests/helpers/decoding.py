"""Decoders on tiny models: an SSD decoder, a run that collects its events, the shared prompts."""

from __future__ import annotations

from ssd_chat.engine.decode.ssd import SSDDecoder
from ssd_chat.engine.engine import Engine, EngineConfig
from ssd_chat.engine.events import Done
from ssd_chat.engine.params import SamplingParams


PROMPTS = ([1, 2, 3], [5, 17, 40, 2, 9], [7, 7, 8, 60, 33, 12])


def ssd(target, draft, **cfg) -> SSDDecoder:
    return SSDDecoder(Engine(EngineConfig(mode="ssd", **cfg), target, draft))


def run(decoder, prompt, **kw):
    evs = list(decoder.stream(prompt, SamplingParams(**kw)))
    assert isinstance(evs[-1], Done), evs[-1]
    return evs, evs[-1]

