"""At the chat defaults a draft proposes from the very distribution the target samples: the same
repetition penalty (over the committed tokens and the round's uncommitted ones), temperature, top-k
and top-p.  A draft that is a copy of the target is then accepted at every position, in SD and in
SSD (hits and fallbacks).  Anything the draft's q misses (no penalty, another temperature, no
truncation) would reject some of its tokens (docs/performance-cpu.md, "Acceptance at the default
sampling")."""

from __future__ import annotations

import copy

import pytest

from helpers.models import CharTokenizer, as_loaded, tiny_llama
from ssd_chat.engine.decode.sd import SDDecoder
from ssd_chat.engine.decode.ssd import SSDDecoder
from ssd_chat.engine.engine import Engine, EngineConfig
from ssd_chat.engine.events import Done, Round
from ssd_chat.engine.params import SamplingParams

# the defaults, top-k scaled to the 64-token test vocabulary; a strong penalty so that it matters
DEFAULTS = dict(temperature=0.8, top_k=10, top_p=0.9, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def twins():
    base = tiny_llama(head_scale=3.0)
    return as_loaded(base, CharTokenizer(64), "t"), as_loaded(copy.deepcopy(base), CharTokenizer(64), "copy")


def rounds(decoder, prompt, seed):
    evs = list(decoder.stream(prompt, SamplingParams(max_new_tokens=48, seed=seed, **DEFAULTS)))
    assert isinstance(evs[-1], Done), evs[-1]
    return [e for e in evs if isinstance(e, Round)]


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_a_copy_draft_is_accepted_at_every_position_at_the_defaults(twins, mode):
    target, draft = twins
    # SSD's fast fallback (n-gram point masses, accepted with probability p) is another proposal: left out
    ssd = {"fan_out": "uniform:2", "fallback": "neural"} if mode == "ssd" else {}
    engine = Engine(EngineConfig(mode=mode, k=3, **ssd), target, draft)
    dec = (SDDecoder if mode == "sd" else SSDDecoder)(engine)
    try:
        got = [r for seed, prompt in enumerate(([1, 2, 3], [5, 17, 40, 2, 9], [7, 7, 8, 60, 33, 12])) for r in rounds(dec, prompt, seed)]
    finally:
        if hasattr(dec, "close"):
            dec.close()
    full = [r for r in got if len(r.drafted) == 3]
    assert len(full) > 20
    assert [r.accepted for r in full] == [3] * len(full)
    if mode == "ssd":  # both paths ran: the tree's drafts (hits) and the fallback's (misses)
        assert any(r.cache_hit for r in full) and any(not r.cache_hit for r in full)
