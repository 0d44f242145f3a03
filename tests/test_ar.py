"""The AR reference decoder: exactness against transformers, sampling, stopping, cancellation."""

from __future__ import annotations

import threading

import pytest
import torch

from helpers.models import CharTokenizer, as_loaded, tiny_llama
from helpers.distribution import decoder_distribution_test
from ssd_chat.engine.decode.ar import ARDecoder
from ssd_chat.engine.errors import ParamError
from ssd_chat.engine.events import Done, Token
from ssd_chat.engine.params import SamplingParams


def run(decoder, prompt, **kw):
    evs = list(decoder.stream(prompt, SamplingParams(**kw)))
    done = evs[-1]
    assert isinstance(done, Done), done
    return evs, done


def test_greedy_matches_transformers_generate(tiny_target):
    prompt = [3, 14, 15, 9, 2, 6]
    _, done = run(ARDecoder(tiny_target), prompt, max_new_tokens=40)
    ref = tiny_target.model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, min_new_tokens=40)
    assert list(done.token_ids) == ref[0, len(prompt):].tolist()
    assert done.reason == "length" and len(done.token_ids) == 40


def test_token_events_and_text_agree(tiny_target):
    evs, done = run(ARDecoder(tiny_target), [1, 2, 3], max_new_tokens=12)
    toks = [e for e in evs if isinstance(e, Token)]
    assert [t.id for t in toks] == list(done.token_ids)
    assert "".join(t.text for t in toks) == done.text == tiny_target.tokenizer.decode(list(done.token_ids))
    assert all(a.t_s <= b.t_s for a, b in zip(toks, toks[1:]))
    assert done.stats.new_tokens == 12 and done.stats.ttft_s == toks[0].t_s and done.stats.rounds == 0
    assert done.stats.mean_accepted_length is None and done.stats.cache_hit_rate is None


def test_seed_reproducible_and_top_k_1_is_greedy(tiny_target):
    dec = ARDecoder(tiny_target)
    _, a = run(dec, [5, 6], temperature=1.0, seed=7, max_new_tokens=20)
    _, b = run(dec, [5, 6], temperature=1.0, seed=7, max_new_tokens=20)
    _, c = run(dec, [5, 6], temperature=1.0, seed=8, max_new_tokens=20)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    _, g = run(dec, [5, 6], max_new_tokens=20)
    _, k1 = run(dec, [5, 6], temperature=1.3, top_k=1, seed=3, max_new_tokens=20)
    assert k1.token_ids == g.token_ids


def test_eos_ends_reply_and_is_not_in_text():
    model = tiny_llama(vocab_size=64, seed=0)
    greedy = list(ARDecoder(as_loaded(model, CharTokenizer(64))).stream([1, 2], SamplingParams(max_new_tokens=10)))[-1]
    eos = greedy.token_ids[4]
    first = greedy.token_ids.index(eos)
    target = as_loaded(model, CharTokenizer(64, eos_id=eos), eos_ids={eos})
    _, done = run(ARDecoder(target), [1, 2], max_new_tokens=10)
    assert done.reason == "eos" and list(done.token_ids) == list(greedy.token_ids[:first])
    _, ign = run(ARDecoder(target), [1, 2], max_new_tokens=10, ignore_eos=True)
    assert ign.token_ids == greedy.token_ids


def test_stop_string_ends_reply(tiny_target):
    _, full = run(ARDecoder(tiny_target), [1, 2, 3], max_new_tokens=30)
    stop = full.text[10:13]
    cut = full.text.find(stop)
    _, done = run(ARDecoder(tiny_target), [1, 2, 3], max_new_tokens=30, stop=(stop,))
    assert done.reason == "stop" and done.text == full.text[:cut]
    assert stop not in done.text


def test_cancellation_between_steps_keeps_partial_reply(tiny_target):
    stop = threading.Event()
    seen = []
    for ev in ARDecoder(tiny_target).stream([1, 2, 3], SamplingParams(max_new_tokens=200), stop):
        if isinstance(ev, Token):
            seen.append(ev)
            if len(seen) == 5:
                stop.set()
        last = ev
    assert isinstance(last, Done) and last.reason == "cancelled"
    assert len(seen) == 5 and list(last.token_ids) == [t.id for t in seen]
    assert last.text == "".join(t.text for t in seen)


def test_prompt_at_context_limit_is_a_clear_error():
    target = as_loaded(tiny_llama(max_pos=32), CharTokenizer(64))
    with pytest.raises(ParamError, match="context of 32"):
        list(ARDecoder(target).stream(list(range(32)), SamplingParams()))
    _, done = run(ARDecoder(target), list(range(28)), max_new_tokens=50)
    assert done.reason == "length" and len(done.token_ids) == 4  # cut at the context window


def test_sampling_distribution_matches_target():
    """AR at temperature 1 with top-p: the first 2 tokens follow the exact target distribution."""
    target = as_loaded(tiny_llama(vocab_size=8, seed=3, hidden=32), CharTokenizer(8))
    params = SamplingParams(temperature=1.0, top_p=0.9)
    res = decoder_distribution_test(ARDecoder(target).stream, target, [1, 2, 3], params, n=2, num_samples=2000)
    assert res.p_value > 1e-3, res


def test_distribution_test_catches_a_wrong_temperature():
    """The same test must fail for a decoder that samples at the wrong temperature."""
    target = as_loaded(tiny_llama(vocab_size=8, seed=3, hidden=32), CharTokenizer(8))
    dec = ARDecoder(target)

    def wrong(prompt, params):
        from dataclasses import replace

        return dec.stream(prompt, replace(params, temperature=params.temperature * 0.6))

    res = decoder_distribution_test(wrong, target, [1, 2, 3], SamplingParams(temperature=1.0), n=2, num_samples=2000)
    assert res.p_value < 1e-3, res
