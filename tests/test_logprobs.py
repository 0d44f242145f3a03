"""The target's logprobs on the event stream: every emitted token's (and the EOS that ends a reply)
in AR, SD and SSD, equal to one plain forward's over prompt + reply, under greedy and sampled
decoding with penalties; nothing read when no one asked."""

from __future__ import annotations

import pytest
import torch

from helpers.models import CharTokenizer, as_loaded, perturbed, tiny_llama
from ssd_chat.engine.sampling import host
from ssd_chat.engine.decode.ar import ARDecoder
from ssd_chat.engine.decode.logprobs import of_prompt
from ssd_chat.engine.decode.sd import SDDecoder
from ssd_chat.engine.decode.ssd import SSDDecoder
from ssd_chat.engine.engine import Engine, EngineConfig
from ssd_chat.engine.errors import ParamError
from ssd_chat.engine.events import Done, Token, from_json, to_dict
from ssd_chat.engine.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [3, 17, 9, 40, 2, 11]
TOL = 1e-6  # float64 models


def eos_pair(eos: int | None = None):
    base = tiny_llama(head_scale=3.0)
    eos_ids = {eos} if eos is not None else set()
    return (as_loaded(base, CharTokenizer(64, eos), "t", eos_ids=eos_ids),
            as_loaded(perturbed(base, 0.1), CharTokenizer(64, eos), "d", eos_ids=eos_ids))


def decoder(mode: str, target, draft):
    if mode == "ar":
        return ARDecoder(target)
    e = Engine(EngineConfig(mode=mode, k=3, fan_out="uniform:1"), target, draft)
    return SDDecoder(e) if mode == "sd" else SSDDecoder(e)


def truth(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)


def run(mode: str, target, draft, **kw) -> list:
    dec = decoder(mode, target, draft)
    try:
        return list(dec.stream(PROMPT, SamplingParams(**kw)))
    finally:
        getattr(dec, "close", lambda: None)()


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
@pytest.mark.parametrize("kw", [{"temperature": 0.0}, {"temperature": 0.9, "top_k": 20, "seed": 4, "repetition_penalty": 1.5,
                                                          "presence_penalty": 0.5}])
def test_each_tokens_logprob_is_the_targets_raw_one(mode, kw):
    target, draft = eos_pair()
    evs = run(mode, target, draft, max_new_tokens=14, logprobs=4, **kw)
    toks = [e for e in evs if isinstance(e, Token)]
    done = evs[-1]
    assert isinstance(done, Done) and [t.id for t in toks] == list(done.token_ids) and len(toks) == 14
    lp = truth(target.model, PROMPT + list(done.token_ids))
    for j, t in enumerate(toks):
        row = lp[len(PROMPT) + j - 1]
        assert abs(t.logprob - row[t.id].item()) < TOL
        top = row.topk(4)
        assert [i for i, _ in t.top_logprobs] == top.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(t.top_logprobs, top.values.tolist())) < TOL
    assert done.eos_logprob is None


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_the_eos_that_ends_a_reply_carries_its_logprob(mode):
    target, _ = eos_pair()
    ids = run("ar", target, None, max_new_tokens=20)[-1].token_ids
    n = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # with that token as EOS the reply ends there
    eos = ids[n]
    target, draft = eos_pair(eos)
    done = run(mode, target, draft, max_new_tokens=20, logprobs=2)[-1]
    assert done.reason == "eos" and len(done.token_ids) == n
    tid, value, top = done.eos_logprob
    lp = truth(target.model, PROMPT + list(done.token_ids) + [eos])
    assert tid == eos and abs(value - lp[len(PROMPT) + n - 1, eos].item()) < TOL and len(top) == 2
    assert run(mode, target, draft, max_new_tokens=20)[-1].eos_logprob is None  # not asked: not computed


def test_without_logprobs_tokens_carry_none_and_nothing_is_read():
    target, _ = eos_pair()
    with host.counting() as reads:
        evs = run("ar", target, None, max_new_tokens=6)
    assert all(e.logprob is None and e.top_logprobs is None for e in evs if isinstance(e, Token))
    assert not reads["logprobs"]
    with host.counting() as reads:
        run("ar", target, None, max_new_tokens=6, logprobs=0)
    assert reads["logprobs"] == 6  # one per AR step, only when asked


def test_prompt_logprobs_from_one_forward():
    target, _ = eos_pair()
    got = of_prompt(target, PROMPT, 3)
    lp = truth(target.model, PROMPT)
    assert got[0] is None and len(got) == len(PROMPT)
    for t in range(1, len(PROMPT)):
        value, top = got[t]
        assert abs(value - lp[t - 1, PROMPT[t]].item()) < TOL
        assert [i for i, _ in top] == lp[t - 1].topk(3).indices.tolist()


def test_logprob_events_round_trip_and_bad_counts_are_refused():
    tok = Token(5, "f", "draft", 0.1, -1.25, ((5, -1.25), (7, -2.5)))
    assert from_json(__import__("json").dumps(to_dict(tok))) == tok
    for bad in (-1, 21):
        with pytest.raises(ParamError, match="logprobs must be from 0 to 20"):
            SamplingParams(logprobs=bad)
