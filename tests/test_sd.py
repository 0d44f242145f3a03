"""Speculative decoding: greedy equals AR token for token; sampling is distributed exactly as the target."""

from __future__ import annotations

import threading

import pytest
import torch

from helpers.models import CharTokenizer, as_loaded, perturbed, tiny_llama
from helpers.distribution import compare, exact_distribution, sample_outcomes
from ssd_chat.engine.drafts import shipped as drafts
from ssd_chat.engine.model import runner as kv
from ssd_chat.engine.decode import sd
from ssd_chat.engine.decode.ar import ARDecoder
from ssd_chat.engine.engine import Engine, EngineConfig
from ssd_chat.engine.errors import ParamError
from ssd_chat.engine.events import Done, Error, Round, Token
from ssd_chat.engine.params import SamplingParams
from ssd_chat.engine.sampling.sampling import sample

P_VALUE_MIN = 1e-3  # significance of the distribution tests (fixed seeds: the outcome is reproducible)
PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(autouse=True)
def _one_thread(request):
    """Tiny models run far faster on one thread (thread hand-offs dominate); SmolLM2 keeps the default."""
    if "slow" in request.keywords:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- models --------------------------------------------------------------------------


def untied_llama(vocab_size: int = 64, seed: int = 0, head_seed: int = 100, **kw) -> torch.nn.Module:
    """A tiny Llama with its own random output head: varied greedy text instead of a repeated token."""
    model = tiny_llama(vocab_size=vocab_size, seed=seed, **kw)
    gen = torch.Generator().manual_seed(head_seed)
    w = model.lm_head.weight
    model.lm_head.weight = torch.nn.Parameter(torch.randn(w.shape, generator=gen, dtype=w.dtype))
    model.config.tie_word_embeddings = False
    return model


@pytest.fixture(scope="module")
def untied_pair():
    """(target, draft) with mixed acceptance (~45 % greedy)."""
    target = untied_llama()
    return as_loaded(target, CharTokenizer(64), "t"), as_loaded(perturbed(target, 0.2), CharTokenizer(64), "d")


def sd_engine(target, draft, k: int = 4) -> Engine:
    return Engine(EngineConfig(mode="sd", k=k), target, draft)


def run(stream, prompt=PROMPT, **params):
    events = list(stream(list(prompt), SamplingParams(**params)))
    assert isinstance(events[-1], Done), events[-1]
    return events


def done(events) -> Done:
    return events[-1]


# -- greedy == AR ------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_greedy_sd_equals_ar_mixed_acceptance(untied_pair, k):
    target, draft = untied_pair
    ar = done(run(ARDecoder(target).stream, max_new_tokens=40))
    events = run(sd_engine(target, draft, k).stream, max_new_tokens=40)
    res = done(events)
    assert res.token_ids == ar.token_ids and res.text == ar.text and res.reason == ar.reason == "length"
    # the test exercised both accepts and rejects
    assert 0.1 < res.stats.acceptance_rate < 0.9, res.stats
    rounds = [e for e in events if isinstance(e, Round)]
    assert all(len(r.drafted) <= k for r in rounds) and max(len(r.drafted) for r in rounds) == k


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_greedy_sd_equals_ar_conftest_models(tiny_target, tiny_draft, k):
    ar = done(run(ARDecoder(tiny_target).stream, prompt=[7, 30, 2, 41], max_new_tokens=24))
    res = done(run(sd_engine(tiny_target, tiny_draft, k).stream, prompt=[7, 30, 2, 41], max_new_tokens=24))
    assert res.token_ids == ar.token_ids


def test_greedy_sd_equals_ar_with_a_wider_draft_head(untied_pair):
    """A same-tokenizer draft whose head has extra (padding) rows: its logits are cut to the target's."""
    target, _ = untied_pair
    wide = untied_llama(vocab_size=80, seed=0)  # different model, 16 extra logits
    ar = done(run(ARDecoder(target).stream, max_new_tokens=16))
    res = done(run(sd_engine(target, as_loaded(wide, CharTokenizer(80)), 3).stream, max_new_tokens=16))
    assert res.token_ids == ar.token_ids


def test_fit_vocab_pads_with_impossible_tokens_and_cuts():
    x = torch.tensor([[1.0, 2.0]])
    assert sd.fit_vocab(x, 2) is x
    assert sd.fit_vocab(x, 3).tolist() == [[1.0, 2.0, float("-inf")]]
    assert sd.fit_vocab(torch.tensor([1.0, 2.0, 3.0]), 2).tolist() == [1.0, 2.0]


# -- events, metrics, KV discipline ----------------------------------------------------


def test_round_and_token_events_add_up(untied_pair):
    target, draft = untied_pair
    events = run(sd_engine(target, draft, 4).stream, max_new_tokens=30)
    res, rounds, tokens = done(events), [e for e in events if isinstance(e, Round)], [e for e in events if isinstance(e, Token)]
    assert [r.index for r in rounds] == list(range(len(rounds)))
    assert sum(r.emitted for r in rounds) == len(tokens) == len(res.token_ids) == 30
    assert [t.id for t in tokens] == list(res.token_ids)
    assert "".join(t.text for t in tokens) == res.text == target.tokenizer.decode(list(res.token_ids))
    # per round: accepted drafts are the first tokens emitted, tagged "draft"; then the target's bonus
    it = iter(events)
    for ev in it:
        if isinstance(ev, Token):
            block = [ev]
            for nxt in it:
                if isinstance(nxt, Round):
                    break
                block.append(nxt)
            r = nxt
            assert [t.source for t in block] == ["draft"] * r.accepted + ["target"]
            assert [t.id for t in block] == [*r.drafted[: r.accepted], r.bonus_id]
            assert r.draft_s >= 0 and r.verify_s > 0
    # metrics with the field's definitions
    drafted = sum(len(r.drafted) for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    assert res.stats.rounds == len(rounds)
    assert res.stats.acceptance_rate == pytest.approx(accepted / drafted)
    assert res.stats.mean_accepted_length == pytest.approx(1 + accepted / len(rounds))
    assert res.stats.mean_accepted_length == pytest.approx(len(tokens) / len(rounds))  # bonus included
    per_pos = res.stats.per_position_acceptance
    for i, rate in enumerate(per_pos):
        at_i = [r for r in rounds if len(r.drafted) > i]
        assert rate == pytest.approx(sum(r.accepted > i for r in at_i) / len(at_i))
    # acceptances past position i can only fall (rates need not: a budget-clamped last round drafts fewer)
    counts = [sum(r.accepted > i for r in rounds) for i in range(len(per_pos))]
    assert counts == sorted(counts, reverse=True)


class _Counting(torch.nn.Module):
    """Wraps a causal LM and records how many tokens each forward feeds, and its last logits."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.fed: list[int] = []
        self.last_logits: list[torch.Tensor] = []

    def forward(self, input_ids, **kw):
        self.fed.append(int(input_ids.shape[-1]))
        out = self.inner(input_ids=input_ids, **kw)
        self.last_logits.append(out.logits[0, -1].detach().clone())
        return out

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()


def test_no_accepted_token_is_recomputed(untied_pair):
    target, draft = untied_pair
    t = as_loaded(_Counting(target.model), target.tokenizer, "t")
    d = as_loaded(_Counting(draft.model), draft.tokenizer, "d")
    events = run(sd_engine(t, d, 4).stream, max_new_tokens=30)
    rounds = [e for e in events if isinstance(e, Round)]
    # target: the prompt minus its last token once, then [last, d1..dk] per round, nothing else
    assert t.model.fed == [len(PROMPT) - 1] + [len(r.drafted) + 1 for r in rounds]
    # draft: prompt minus last once; per drafting round one catch-up forward of exactly the tokens
    # it has not seen (1, or 2 after an all-accepted round), then k-1 single steps
    expected, seen, num_seq = [len(PROMPT) - 1], len(PROMPT) - 1, len(PROMPT)
    for r in rounds:
        if r.drafted:
            expected += [num_seq - seen] + [1] * (len(r.drafted) - 1)
            seen = num_seq + len(r.drafted) - 1
        seen = min(seen, num_seq + r.accepted)
        num_seq += r.accepted + 1
    assert d.model.fed == expected
    assert set(expected[1:]) <= {1, 2} and 2 in expected


@pytest.mark.parametrize("k", [1, 3, 6])
def test_draft_sees_exactly_the_true_prefix(untied_pair, k):
    """The draft cache never holds stale or missing tokens: the logits behind every proposal equal
    what the draft computes from scratch (no cache) for the accepted prefix plus the drafts so far."""
    target, draft = untied_pair
    d = as_loaded(_Counting(draft.model), draft.tokenizer, "d")
    events = run(sd_engine(target, d, k).stream, max_new_tokens=30)
    rounds = [e for e in events if isinstance(e, Round)]
    proposal_logits = iter(d.model.last_logits[1:])  # [0] is the prefill
    seq = list(PROMPT)
    with torch.inference_mode():
        for r in rounds:
            ctx = list(seq)
            for i, tok in enumerate(r.drafted):
                expected = draft.model(input_ids=torch.tensor([ctx])).logits[0, -1]
                assert torch.allclose(next(proposal_logits), expected, atol=1e-9), (r.index, i)
                ctx.append(tok)
            seq += [*r.drafted[: r.accepted], r.bonus_id]
    assert next(proposal_logits, None) is None
    assert any(r.accepted == len(r.drafted) for r in rounds) and any(r.accepted < len(r.drafted) for r in rounds)


def test_engine_picks_sd_and_needs_a_draft(untied_pair):
    target, draft = untied_pair
    eng = sd_engine(target, draft, 2)
    assert isinstance(eng.decoder(), sd.SDDecoder) and eng.decoder().k == 2
    with pytest.raises(ParamError, match="draft"):
        sd.SDDecoder(Engine(EngineConfig(mode="sd"), target, None))


# -- budgets, EOS, stop strings, context, cancellation, errors -----------------------


@pytest.mark.parametrize("max_new", [1, 2, 3, 5])
def test_k_larger_than_the_remaining_budget(untied_pair, max_new):
    target, draft = untied_pair
    ar = done(run(ARDecoder(target).stream, max_new_tokens=max_new))
    events = run(sd_engine(target, draft, 6).stream, max_new_tokens=max_new)
    res = done(events)
    assert res.token_ids == ar.token_ids and len(res.token_ids) == max_new and res.reason == "length"
    emitted = 0
    for r in (e for e in events if isinstance(e, Round)):
        assert len(r.drafted) + 1 <= max_new - emitted  # never drafts past the budget
        emitted += r.emitted


def test_copy_draft_proposes_eos_which_ends_the_reply(untied_pair):
    target, _ = untied_pair
    ar_free = done(run(ARDecoder(target).stream, max_new_tokens=20))
    eos = ar_free.token_ids[9]
    first = ar_free.token_ids.index(eos)  # the reply ends at EOS's first occurrence
    tgt = as_loaded(target.model, target.tokenizer, "t", eos_ids={eos})
    ar = done(run(ARDecoder(tgt).stream, max_new_tokens=20))
    # a copy draft accepts everything: rounds cover k+1 positions, the last one the bonus; pick k so EOS is drafted
    k = next(k for k in (4, 3, 5, 6) if first % (k + 1) != k)
    eng = Engine(EngineConfig(mode="sd", k=k), tgt, drafts.derive("copy", tgt))
    events = run(eng.stream, max_new_tokens=20)
    res = done(events)
    assert res.reason == ar.reason == "eos" and res.token_ids == ar.token_ids == ar_free.token_ids[:first]
    assert all(isinstance(e, Round) or e.id != eos for e in events[:-1])  # no Token for EOS
    last = [e for e in events if isinstance(e, Round)][-1]
    assert eos in last.drafted[: last.accepted] and last.bonus_id is None  # ended before the bonus
    assert sum(r.emitted for r in events if isinstance(r, Round)) == len(res.token_ids)


def test_eos_with_a_mixed_draft_matches_ar(untied_pair):
    target, draft = untied_pair
    ar_free = done(run(ARDecoder(target).stream, max_new_tokens=30))
    eos = ar_free.token_ids[17]
    tgt, dft = (as_loaded(m.model, m.tokenizer, m.name, eos_ids={eos}) for m in untied_pair)
    ar = done(run(ARDecoder(tgt).stream, max_new_tokens=30))
    res = done(run(sd_engine(tgt, dft, 5).stream, max_new_tokens=30))
    assert res.reason == "eos" and res.token_ids == ar.token_ids
    assert done(run(sd_engine(tgt, dft, 5).stream, max_new_tokens=30, ignore_eos=True)).token_ids == ar_free.token_ids


@pytest.mark.parametrize("span", [(1, 3), (4, 6), (9, 10)])
def test_stop_string_inside_and_across_blocks(untied_pair, span):
    target, _ = untied_pair
    full = done(run(ARDecoder(target).stream, max_new_tokens=30))
    stop = full.text[span[0] : span[1]]
    ar = done(run(ARDecoder(target).stream, max_new_tokens=30, stop=(stop,)))
    eng = Engine(EngineConfig(mode="sd", k=4), target, drafts.derive("copy", target))  # blocks of 5 tokens
    events = run(eng.stream, max_new_tokens=30, stop=(stop,))
    res = done(events)
    assert res.reason == ar.reason == "stop"
    assert (res.text, res.token_ids) == (ar.text, ar.token_ids)
    assert stop not in res.text and full.text.startswith(res.text + stop)
    assert "".join(e.text for e in events if isinstance(e, Token)) == res.text


def test_prompt_at_the_context_limit():
    tok = CharTokenizer(16)
    model = untied_llama(vocab_size=16, max_pos=32)
    target, draft = as_loaded(model, tok, "t"), as_loaded(perturbed(model, 0.2), tok, "d")
    eng = sd_engine(target, draft, 4)
    with pytest.raises(ParamError, match="context of 32 tokens"):
        list(eng.stream([1] * 32, SamplingParams(max_new_tokens=8)))
    # one position left: exactly one token, as AR
    for n_prompt in (31, 29, 20):
        prompt = [(3 * i) % 16 for i in range(n_prompt)]
        ar = done(run(ARDecoder(target).stream, prompt=prompt, max_new_tokens=100))
        res = done(run(eng.stream, prompt=prompt, max_new_tokens=100))
        assert len(res.token_ids) == 32 - n_prompt and res.token_ids == ar.token_ids


def test_a_draft_with_a_shorter_context_is_named_in_the_error(untied_pair):
    target, _ = untied_pair
    short = untied_llama(max_pos=16)
    eng = sd_engine(target, as_loaded(short, CharTokenizer(64), "short-draft"), 4)
    with pytest.raises(ParamError, match="short-draft"):
        list(eng.stream(list(range(20)), SamplingParams(max_new_tokens=8)))


def test_empty_prompt_is_a_clear_error(untied_pair):
    with pytest.raises(ParamError, match="empty"):
        list(sd_engine(*untied_pair).stream([], SamplingParams()))


def test_single_token_prompt(untied_pair):
    target, draft = untied_pair
    ar = done(run(ARDecoder(target).stream, prompt=[9], max_new_tokens=12))
    assert done(run(sd_engine(target, draft, 3).stream, prompt=[9], max_new_tokens=12)).token_ids == ar.token_ids


def test_cancellation_mid_reply_keeps_a_consistent_partial_reply(untied_pair):
    target, draft = untied_pair
    full = done(run(ARDecoder(target).stream, max_new_tokens=40))
    flag = threading.Event()
    events = []
    for ev in sd_engine(target, draft, 4).stream(list(PROMPT), SamplingParams(max_new_tokens=40), flag):
        events.append(ev)
        if sum(isinstance(e, Token) for e in events) >= 7:
            flag.set()
    res = done(events)
    tokens = [e for e in events if isinstance(e, Token)]
    assert res.reason == "cancelled"
    assert 7 <= len(res.token_ids) < 40
    assert res.token_ids == full.token_ids[: len(res.token_ids)]
    assert [t.id for t in tokens] == list(res.token_ids)
    assert res.text == "".join(t.text for t in tokens) == target.tokenizer.decode(list(res.token_ids))
    # the round in flight finished: the reply stops on a round boundary
    assert sum(r.emitted for r in events if isinstance(r, Round)) == len(res.token_ids)


def test_stop_flag_set_before_start_emits_nothing(untied_pair):
    flag = threading.Event()
    flag.set()
    events = list(sd_engine(*untied_pair).stream(list(PROMPT), SamplingParams(), flag))
    assert len(events) == 1 and events[0].reason == "cancelled" and events[0].token_ids == ()


def test_a_failure_mid_reply_is_an_error_event_with_the_partial_reply(untied_pair, monkeypatch):
    target, draft = untied_pair
    full = done(run(ARDecoder(target).stream, max_new_tokens=30))
    calls = {"n": 0}

    def flaky(real):
        def append(self, ids, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] > 12:
                raise RuntimeError("device fell over")
            return real(self, ids, *args, **kwargs)
        return append

    for cls in (kv.Runner, kv.CoreRunner):  # whichever forward runs the models
        monkeypatch.setattr(cls, "append", flaky(cls.append))
    events = list(sd_engine(target, draft, 3).stream(list(PROMPT), SamplingParams(max_new_tokens=30)))
    err = events[-1]
    assert isinstance(err, Error) and "device fell over" in err.message and err.kind == "runtime"
    assert 0 < len(err.token_ids) < 30 and err.token_ids == full.token_ids[: len(err.token_ids)]
    assert err.text == target.tokenizer.decode(list(err.token_ids))


# -- distribution at temperature > 0 ---------------------------------------------------

V_SMALL, N_FIRST, NUM_SAMPLES = 8, 3, 1200


@pytest.fixture(scope="module")
def unrelated_small_pair():
    """Vocabulary 8, draft an unrelated model (so the residual carries much of the mass)."""
    tok = CharTokenizer(V_SMALL)
    target = as_loaded(tiny_llama(vocab_size=V_SMALL, seed=0, hidden=32), tok, "t8")
    draft = as_loaded(tiny_llama(vocab_size=V_SMALL, seed=3, hidden=32, layers=1), tok, "d8")
    return target, draft


def _distribution(target, draft, params, k=4, seed0=0):
    exact = exact_distribution(target, [1, 2, 3], N_FIRST, params)
    counts = sample_outcomes(sd_engine(target, draft, k).stream, [1, 2, 3], params, N_FIRST, NUM_SAMPLES, seed0)
    return compare(counts, exact)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.8, top_k=3)],
    ids=["t1", "top_p0.9", "top_k3"],
)
def test_sd_samples_the_exact_target_distribution(unrelated_small_pair, params):
    result = _distribution(*unrelated_small_pair, params)
    assert result.p_value > P_VALUE_MIN, result


def _bonus_from_p(draft_ids, q, p, gen):
    """outcome.sampled() with a deliberate bug: the bonus after a rejection comes from p, not norm(max(0, p - q))."""
    k = draft_ids.shape[0]
    n = torch.tensor(0)
    if k:
        rows = torch.arange(k)
        ok = torch.rand(k, generator=gen) * q[rows, draft_ids] <= p[rows, draft_ids]
        n = ok.long().cumprod(0).sum()
    return n, sample(p[n], gen)


def test_the_distribution_test_catches_a_wrong_residual(unrelated_small_pair, monkeypatch):
    monkeypatch.setattr(sd.outcome, "sampled", _bonus_from_p)
    result = _distribution(*unrelated_small_pair, SamplingParams(temperature=1.0))
    assert result.p_value < P_VALUE_MIN, result


def test_the_distribution_test_catches_drafts_sampled_without_top_k(unrelated_small_pair, monkeypatch):
    """Drafts drawn from the untransformed q while verify is told the top-k q: not exact."""
    from ssd_chat.engine.drafts import drafter
    from ssd_chat.engine.sampling.sampling import sample

    real = drafter.draw_draft  # what SD's draft rule (drafter.plain_choice) draws with

    def uniform_draws(logits, temperature, top_k, top_p, gen, *args):
        _, q = real(logits, temperature, top_k, top_p, gen, *args)
        return sample(torch.full_like(q, 1.0 / q.shape[-1]), gen), q

    monkeypatch.setattr(drafter, "draw_draft", uniform_draws)
    result = _distribution(*unrelated_small_pair, SamplingParams(temperature=0.8, top_k=3))
    assert result.p_value < P_VALUE_MIN, result


# -- the packaged SmolLM2 --------------------------------------------------------------

SMOL_PROMPTS = ["Write one sentence about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def smol_ar(smollm2):
    """Greedy AR replies (32 tokens) for SMOL_PROMPTS: the reference."""
    from ssd_chat.engine.load import chat

    prompts = [chat.prompt_ids(smollm2.tokenizer, [{"role": "user", "content": p}])[0] for p in SMOL_PROMPTS]
    return prompts, [done(run(ARDecoder(smollm2).stream, prompt=p, max_new_tokens=32)) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("draft_name, k, lo, hi", [("copy", 4, 1.0, 1.0), ("int8", 4, 0.3, 0.99), ("layers:6", 2, 0.0, 0.3)])
def test_smollm2_greedy_sd_equals_ar(smollm2, smol_ar, draft_name, k, lo, hi):
    prompts, refs = smol_ar
    eng = Engine(EngineConfig(mode="sd", k=k, draft=draft_name), smollm2, drafts.derive(draft_name, smollm2))
    drafted = accepted = 0
    for prompt, ref in zip(prompts, refs):
        events = run(eng.stream, prompt=prompt, max_new_tokens=32)
        res = done(events)
        assert res.token_ids == ref.token_ids and res.text == ref.text
        for r in (e for e in events if isinstance(e, Round)):
            drafted, accepted = drafted + len(r.drafted), accepted + r.accepted
    assert lo <= accepted / drafted <= hi, (draft_name, accepted, drafted)
