"""Repetition / frequency / presence penalties: the formulas, exactness of SD and SSD with them
(greedy token for token, sampling in distribution), and that the distribution test catches a verifier
that penalizes its rows for the wrong prefixes."""

from __future__ import annotations

import pytest
import torch

from helpers.models import CharTokenizer, as_loaded, perturbed, tiny_llama
from helpers.distribution import compare, decoder_distribution_test, exact_distribution, sample_outcomes
from ssd_chat.engine.sampling import penalties as penalties_mod
from ssd_chat.engine.decode.ar import ARDecoder
from ssd_chat.engine.engine import Engine, EngineConfig
from ssd_chat.engine.errors import ParamError
from ssd_chat.engine.events import Done, Notice, Round
from ssd_chat.engine.params import SamplingParams
from ssd_chat.engine.sampling.penalties import Penalties
from ssd_chat.engine.sampling.sampling import apply_penalties
from ssd_chat.engine.decode.sd import SDDecoder
from ssd_chat.engine.decode.ssd import SSDDecoder

pytestmark = pytest.mark.usefixtures("one_thread")
P_MIN = 1e-3
PEN = dict(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.4)


# -- the formulas ---------------------------------------------------------------------------------


def test_apply_penalties_follows_ctrl_and_openai():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    seen = torch.tensor([True, True, False, False])
    counts = torch.tensor([2.0, 0.0, 0.0, 1.0])
    out = apply_penalties(logits, seen | (counts > 0), counts, repetition=2.0, frequency=0.5, presence=0.25)
    # token 0: 2/2 - 0.5*2 - 0.25; token 1: -1*2; token 2 untouched; token 3: 3/2 - 0.5 - 0.25
    assert out.tolist() == [2.0 / 2 - 1.0 - 0.25, -2.0, 0.5, 1.5 - 0.5 - 0.25]
    assert apply_penalties(torch.tensor([float("-inf")]), torch.tensor([True]), torch.tensor([1.0]), 1.5, 1.0, -1.0).tolist() == [float("-inf")]


def test_rows_penalize_each_row_for_its_own_prefix():
    """Row r of a verification is penalized exactly as a fresh history ending in chain[:start + r] would be."""
    torch.manual_seed(0)
    prompt, reply, chain = [1, 2, 2], [3, 4, 3], [5, 3, 6, 1]
    pen = Penalties(1.3, 0.7, 0.2, prompt)
    pen.add(reply[:1])
    pen.add(reply[1:])
    logits = torch.randn(3, 8)
    got = pen.rows(logits, chain, start=1)
    for r in range(3):
        ref = Penalties(1.3, 0.7, 0.2, prompt, reply + chain[: 1 + r]).apply(logits[r])
        assert torch.equal(got[r], ref), r
    assert Penalties().rows(logits, chain) is logits  # off: untouched (greedy stays bit-identical)


@pytest.mark.parametrize("bad", [dict(repetition_penalty=0.0), dict(repetition_penalty=float("inf")), dict(repetition_penalty=float("nan")),
                                 dict(frequency_penalty=2.5), dict(presence_penalty=-2.1), dict(frequency_penalty=float("nan"))])
def test_out_of_range_penalties_are_param_errors(bad):
    with pytest.raises(ParamError, match="penalty"):
        SamplingParams(**bad)


# -- greedy: AR as transformers, SD and SSD as AR ---------------------------------------------------


def ids(stream, prompt, **kw):
    done = list(stream(list(prompt), SamplingParams(**kw)))[-1]
    assert isinstance(done, Done), done
    return done.token_ids


def test_greedy_ar_with_a_repetition_penalty_matches_transformers(tiny_target):
    prompt = [3, 14, 15, 9, 2, 6]
    got = ids(ARDecoder(tiny_target).stream, prompt, max_new_tokens=30, repetition_penalty=1.5)
    ref = tiny_target.model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, min_new_tokens=30, repetition_penalty=1.5)
    assert list(got) == ref[0, len(prompt):].tolist()
    assert got != ids(ARDecoder(tiny_target).stream, prompt, max_new_tokens=30)  # the penalty changed the reply


PROMPTS = ([1, 2, 3], [5, 17, 40, 2, 9])


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_sd_with_penalties_equals_ar(pair, k):
    target, draft = pair
    dec = SDDecoder(Engine(EngineConfig(mode="sd", k=k), target, draft))
    for prompt in PROMPTS:
        ref = ids(ARDecoder(target).stream, prompt, max_new_tokens=40, **PEN)
        assert ref != ids(ARDecoder(target).stream, prompt, max_new_tokens=40)
        evs = list(dec.stream(list(prompt), SamplingParams(max_new_tokens=40, **PEN)))
        assert evs[-1].token_ids == ref, (prompt, k)
        rounds = [e for e in evs if isinstance(e, Round)]
        assert 0 < sum(r.accepted for r in rounds) < sum(len(r.drafted) for r in rounds)


@pytest.mark.parametrize(("k", "fan_out", "fallback"), [(2, "geometric", "neural"), (3, "uniform:2", "auto"), (4, "3,1,1,1,2", "fast")])
def test_greedy_ssd_with_penalties_equals_ar(pair, k, fan_out, fallback):
    target, draft = pair
    dec = SSDDecoder(Engine(EngineConfig(mode="ssd", k=k, fan_out=fan_out, fallback=fallback), target, draft))
    try:
        hits = 0
        for prompt in PROMPTS:
            evs = list(dec.stream(list(prompt), SamplingParams(max_new_tokens=40, **PEN)))
            assert evs[-1].token_ids == ids(ARDecoder(target).stream, prompt, max_new_tokens=40, **PEN), (prompt, k)
            hits += sum(bool(e.cache_hit) for e in evs if isinstance(e, Round))
            assert not [e for e in evs if isinstance(e, Notice)]  # the speculator served every round
        assert hits > 0  # drafts from the penalized tree were verified
    finally:
        dec.close()


def test_speculator_tree_branches_are_penalized_for_their_own_prefix(pair):
    """Each greedy branch (j, c) drafts what penalized greedy drafting after its own prefix gives."""
    from ssd_chat.engine.speculate.channel import Begin
    from ssd_chat.engine.fanout import parse
    from ssd_chat.engine.speculate.speculator import Speculator

    _, draft = pair
    k, prompt = 3, [7, 7, 8, 60, 33, 12]
    sp = Speculator(draft.forwards, k, parse("uniform:2", k), "neural", vocab=64)
    sp.begin(Begin(tuple(prompt), SamplingParams(seed=0, repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.4), prompt_len=len(prompt)))
    first, _ = sp.serve(1, -1, 11)
    sp.build()
    for (j, c), (toks, _q) in sp.tree.items():
        hyp = prompt + [11, *first.tokens[:j], c]
        seq, want = list(hyp), []
        for _ in range(k):
            logits = draft.model(input_ids=torch.tensor([seq])).logits[0, -1]
            pen = Penalties(1.4, 0.6, 0.4, prompt, seq[len(prompt):])
            t = int(pen.apply(logits).argmax())
            want.append(t)
            seq.append(t)
        assert list(toks) == want, (j, c)


# -- sampling: distributed exactly as the penalized target ---------------------------------------------


@pytest.fixture(scope="module")
def sharp_small_pair():
    """Vocabulary 8, a sharp head (large logits: the penalties move much mass), a draft that agrees part of the time."""
    base = tiny_llama(vocab_size=8, seed=3, head_scale=3.0)
    return as_loaded(base, CharTokenizer(8), "t8"), as_loaded(perturbed(base, 0.3), CharTokenizer(8), "d8")


SPROMPT = [1, 4, 2]


def repeats(outcome):
    """Which neighbouring tokens are equal: what a penalty for the wrong prefix gets wrong first."""
    return tuple(a == b for a, b in zip(outcome, outcome[1:]))
STRONG = dict(temperature=1.0, repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=1.0)


def test_ar_samples_the_penalized_distribution(sharp_small_pair):
    target, _ = sharp_small_pair
    params = SamplingParams(**STRONG)
    res = decoder_distribution_test(ARDecoder(target).stream, target, SPROMPT, params, n=3, num_samples=1000)
    assert res.p_value > P_MIN, res
    plain = exact_distribution(target, SPROMPT, 3, SamplingParams(temperature=1.0))
    assert compare(sample_outcomes(ARDecoder(target).stream, SPROMPT, params, 3, 1000), plain).p_value < P_MIN  # the penalty matters


def _sd(target, draft, k=3):
    return SDDecoder(Engine(EngineConfig(mode="sd", k=k), target, draft))


def _ssd(target, draft, **cfg):
    return SSDDecoder(Engine(EngineConfig(mode="ssd", **cfg), target, draft))


@pytest.mark.parametrize("sampling", [STRONG, dict(temperature=0.8, top_k=5, repetition_penalty=0.7, frequency_penalty=-0.5)],
                         ids=["strong", "encouraging-topk5"])
def test_sd_samples_the_penalized_distribution(sharp_small_pair, sampling):
    res = decoder_distribution_test(_sd(*sharp_small_pair).stream, sharp_small_pair[0], SPROMPT, SamplingParams(**sampling), n=3, num_samples=1200)
    assert res.p_value > P_MIN, res


@pytest.mark.parametrize("cfg", [dict(k=2, fan_out="uniform:2", saguaro_c=1.0), dict(k=2, fan_out="2,1,1", saguaro_c=0.5, fallback="fast")],
                         ids=["C1", "C0.5-fast"])
def test_ssd_samples_the_penalized_distribution(sharp_small_pair, cfg):
    dec = _ssd(*sharp_small_pair, **cfg)
    try:
        hits = []

        def stream(prompt, params):
            for ev in dec.stream(prompt, params):
                if isinstance(ev, Round):
                    hits.append(ev.cache_hit)
                yield ev

        params = SamplingParams(**STRONG)
        counts = sample_outcomes(stream, SPROMPT, params, 3, 1000)
        exact = exact_distribution(sharp_small_pair[0], SPROMPT, 3, params)
        for key in (None, repeats):  # the full test, and the statistic the planted bug below is caught by
            res = compare(counts, exact, key=key)
            assert res.p_value > P_MIN, res
        assert 0 < sum(hits) < len(hits)
    finally:
        dec.close()


# -- planted bugs: the verifier's rows penalized for the wrong prefix are rejected --------------------

REAL_ROWS = Penalties.rows


def _same_prefix(self, logits, chain=(), start=0):
    """Bug: every row penalized as the first one (the drafts before it ignored)."""
    return torch.cat([REAL_ROWS(self, logits[r:r + 1], chain, start) for r in range(logits.shape[0])])


def _off_by_one(self, logits, chain=(), start=0):
    """Bug: row r penalized as if it followed chain[:start + r + 1] (its own token counted)."""
    if logits.shape[0] == 1:
        return REAL_ROWS(self, logits, chain, start)
    return REAL_ROWS(self, logits, list(chain) + [0], start + 1)


def _chain_same_prefix(pen, logits, chain):
    """The same bug on SD's device-side rows (engine/decode/outcome.py ``chain_rows``)."""
    return pen.apply(logits) if pen.active else logits


def _chain_off_by_one(pen, logits, chain):
    if not pen.active:
        return logits
    k = chain.shape[0]
    toks = torch.cat([chain.long(), chain.new_zeros(1).long()])[None].expand(k + 1, k + 1)
    valid = torch.arange(k + 1)[None] <= torch.arange(k + 1)[:, None]  # row r counts chain[:r + 1]
    return pen.apply(logits, None, toks, valid)


@pytest.mark.parametrize("bug,chain_bug", [(_same_prefix, _chain_same_prefix), (_off_by_one, _chain_off_by_one)],
                         ids=["same-prefix", "off-by-one"])
def test_sd_distribution_test_catches_rows_penalized_for_the_wrong_prefix(sharp_small_pair, monkeypatch, bug, chain_bug):
    from ssd_chat.engine.decode import sd as sd_mod

    monkeypatch.setattr(Penalties, "rows", bug)
    monkeypatch.setattr(sd_mod, "chain_rows", chain_bug)  # SD's verify penalizes its rows on the device
    res = decoder_distribution_test(_sd(*sharp_small_pair).stream, sharp_small_pair[0], SPROMPT, SamplingParams(**STRONG), n=3, num_samples=1200)
    assert res.p_value < P_MIN, res


def test_ssd_distribution_test_catches_rows_penalized_for_the_wrong_prefix(sharp_small_pair, monkeypatch):
    """SSD's first token comes from the prefill, so only the third of three tokens can come from a
    verification row past the first: the test reads the statistic that row decides (are neighbours
    equal?), whose exact distribution follows from the full one.  The bug is the verifier's (this
    process); the speculator may or may not share it, which only changes acceptance."""
    monkeypatch.setattr(penalties_mod.Penalties, "rows", _same_prefix)
    target, draft = sharp_small_pair
    dec = _ssd(target, draft, k=2, fan_out="uniform:2", saguaro_c=1.0)
    try:
        params = SamplingParams(**STRONG)
        counts = sample_outcomes(dec.stream, SPROMPT, params, 3, 1000)
        res = compare(counts, exact_distribution(target, SPROMPT, 3, params), key=repeats)
        assert res.p_value < P_MIN, res
    finally:
        dec.close()
