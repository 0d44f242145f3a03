"""SSD (Saguaro): exactness against AR, the speculation cache, the batched tree, events, distribution."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from helpers.models import CharTokenizer, as_loaded, tiny_llama
from helpers.distribution import decoder_distribution_test
from ssd_chat.engine.decode.ar import ARDecoder
from ssd_chat.engine.speculate.channel import Begin, Channel
from ssd_chat.engine.engine import Engine, EngineConfig
from ssd_chat.engine.errors import ParamError
from ssd_chat.engine.events import Done, Notice, Round, Token
from ssd_chat.engine.fanout import parse
from ssd_chat.engine.params import SamplingParams
from ssd_chat.engine.model.forward import Forwards
from ssd_chat.engine.speculate.speculator import Speculator
from ssd_chat.engine.decode.ssd import SSDDecoder
from helpers.decoding import PROMPTS, run, ssd

def ar_ids(target, prompt, **kw):
    return run(ARDecoder(target), prompt, **kw)[1].token_ids


@pytest.mark.parametrize(("k", "fan_out", "fallback"), [
    (1, "uniform:1", "neural"),
    (2, "geometric", "auto"),
    (3, "uniform:2", "neural"),
    (4, "3,1,1,1,2/1,1,1,1,1", "fast"),
    (6, "geometric", "neural"),
])
def test_greedy_ssd_equals_ar(pair, k, fan_out, fallback):
    target, draft = pair
    dec = ssd(target, draft, k=k, fan_out=fan_out, fallback=fallback)
    try:
        hits = misses = accepted = drafted = 0
        for prompt in PROMPTS:
            evs, done = run(dec, prompt, max_new_tokens=40)
            assert done.token_ids == ar_ids(target, prompt, max_new_tokens=40), (prompt, k, fan_out)
            assert done.reason == "length"
            assert "".join(e.text for e in evs if isinstance(e, Token)) == done.text
            rounds = [e for e in evs if isinstance(e, Round)]
            assert not rounds[0].cache_hit  # the first round always misses
            hits += sum(r.cache_hit for r in rounds)
            misses += sum(not r.cache_hit for r in rounds)
            accepted += sum(r.accepted for r in rounds)
            drafted += sum(len(r.drafted) for r in rounds)
        assert not [e for e in evs if isinstance(e, Notice)]
        # the test exercises both paths: hits and misses, accepted and rejected drafts
        assert hits > 0 and misses > len(PROMPTS)
        assert 0 < accepted < drafted
    finally:
        dec.close()


def test_copy_draft_hits_almost_always(pair):
    target, _ = pair
    dec = ssd(target, as_loaded(copy.deepcopy(target.model), CharTokenizer(64), "copy"), k=3, fan_out="uniform:1")
    try:
        evs, done = run(dec, PROMPTS[1], max_new_tokens=120)
        assert done.token_ids == ar_ids(target, PROMPTS[1], max_new_tokens=120)
        assert done.stats.cache_hit_rate > 0.95, done.stats
        assert done.stats.acceptance_rate == 1.0
    finally:
        dec.close()


def test_round_events_describe_the_cache(pair):
    """A hit round's key (previous accepted, previous bonus) is in its predicted set; a miss's is not."""
    target, draft = pair
    dec = ssd(target, draft, k=3, fan_out="uniform:2")
    try:
        evs, done = run(dec, PROMPTS[2], max_new_tokens=60)
        rounds = [e for e in evs if isinstance(e, Round)]
        assert rounds[0].fallback == "neural" and rounds[0].predicted == ()
        for prev, r in zip(rounds, rounds[1:]):
            keys = {(j, c) for j, cs in r.predicted for c in cs}
            assert len(keys) == 2 * 4 and {j for j, _ in keys} == {0, 1, 2, 3}
            assert r.cache_hit == ((prev.accepted, prev.bonus_id) in keys)
            assert (r.fallback is None) == r.cache_hit
            assert r.speculator_busy_s > 0 and r.wait_s >= 0
            # the bonus can never be the drafted token at the rejected position
            if prev.accepted < 3:
                assert prev.bonus_id != prev.drafted[prev.accepted]
        s = done.stats
        hits = [r for r in rounds if r.cache_hit]
        assert s.cache_hit_rate == pytest.approx(len(hits) / len(rounds))
        assert s.accepted_length_on_hit == pytest.approx(1 + sum(r.accepted for r in hits) / len(hits))
        assert s.sd_estimate_s is not None and s.sd_estimate_s > 0
        assert s.wait_s is not None
    finally:
        dec.close()


def test_eos_stop_strings_and_tiny_budgets_match_ar(pair):
    target, draft = pair
    prompt = PROMPTS[1]
    ar_text = run(ARDecoder(target), prompt, max_new_tokens=30)[1].token_ids
    eos = ar_text[7]  # a token AR produces at position 7: with it as EOS the reply ends there
    t_eos = as_loaded(target.model, CharTokenizer(64, eos_id=eos), "t", eos_ids={eos})
    d_eos = as_loaded(draft.model, CharTokenizer(64, eos_id=eos), "d", eos_ids={eos})
    dec = ssd(t_eos, d_eos, k=4, fan_out="uniform:1")
    try:
        for kw in ({"max_new_tokens": 30}, {"max_new_tokens": 1}, {"max_new_tokens": 2}, {"max_new_tokens": 30, "stop": ("ab",)},
                   {"max_new_tokens": 30, "ignore_eos": True}):
            ref = run(ARDecoder(t_eos), prompt, **kw)[1]
            got = run(dec, prompt, **kw)[1]
            assert (got.token_ids, got.text, got.reason) == (ref.token_ids, ref.text, ref.reason), kw
        assert run(dec, prompt, max_new_tokens=30)[1].reason == "eos"
    finally:
        dec.close()


def test_cancel_then_next_reply_is_exact(pair):
    target, draft = pair
    dec = ssd(target, draft, k=2)
    try:
        stop = threading.Event()
        evs = []
        for ev in dec.stream(PROMPTS[0], SamplingParams(max_new_tokens=200), stop):
            evs.append(ev)
            if isinstance(ev, Round) and ev.index == 1:
                stop.set()
        assert evs[-1].reason == "cancelled" and len(evs[-1].token_ids) < 200
        _, done = run(dec, PROMPTS[0], max_new_tokens=30)
        assert done.token_ids == ar_ids(target, PROMPTS[0], max_new_tokens=30)
    finally:
        dec.close()


def test_bad_fan_out_is_a_clear_error(pair):
    target, draft = pair
    for fan_out, budget, msg in (("uniform:0", None, "F >= 1"), ("1,2", None, r"k\+1"), ("uniform:2", 5, "budget"),
                                 ("zigzag", None, "unknown fan-out")):
        with pytest.raises(ParamError, match=msg):
            ssd(target, draft, k=3, fan_out=fan_out, budget=budget)


def test_channel_round_trip_is_measured(pair):
    target, draft = pair
    dec = ssd(target, draft, k=2)
    try:
        rtts = [dec.ping() for _ in range(20)]
        print(f"channel round trip: min {min(rtts) * 1e3:.3f} ms, median {sorted(rtts)[10] * 1e3:.3f} ms")
        assert all(r > 0 for r in rtts)
    finally:
        dec.close()


# --- the batched tree, in-process -------------------------------------------------------------


def _sequential(model, ids, k, settings, vocab):
    """k greedy tokens and the per-step distributions, one incremental forward at a time."""
    from ssd_chat.engine.sampling.sampling import logits_to_probs

    ids = list(ids)
    toks, qs = [], []
    for _ in range(k):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        qs.append(logits_to_probs(logits, settings.temperature or 1.0, settings.top_k, settings.top_p))
        t = int(logits.argmax())
        toks.append(t)
        ids.append(t)
    return toks, torch.stack(qs)


@pytest.mark.parametrize("compile", ["off", "transformers"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_branches_equal_sequential_drafting(pair, temperature, compile):
    """Every cached branch (j, c) holds what drafting k tokens after ctx + [bonus, d_1..d_j, c] gives:
    the tree's mask and RoPE positions are right, the flat scratch region leaves the prefix intact, and
    on a hit the adopted branch KV continues exactly like a fresh prefill.  On the compact core (off)
    and on transformers' modules."""
    target, _ = pair
    model, k = target.model, 3
    sp = Speculator(Forwards(model), k, parse("uniform:2", k), "neural", vocab=64, compile=compile)
    assert sp.runner.label == ("transformers" if compile == "transformers" else "core eager")
    settings, prompt = SamplingParams(temperature, seed=0), PROMPTS[2]
    sp.begin(Begin(tuple(prompt), settings))
    first, _ = sp.serve(1, -1, 11)  # round 1: a miss, neural fallback
    sp.build()
    assert len(sp.tree) == 2 * (k + 1)
    for (j, c), (toks, q) in sp.tree.items():
        hyp = prompt + [11, *first.tokens[:j], c]
        if temperature == 0.0:
            assert list(toks) == _sequential(model, hyp, k, settings, 64)[0], (j, c)
        else:  # sampled tokens: check each q' row is the draft's distribution after the branch's own prefix
            for i in range(k):
                ref = model(input_ids=torch.tensor([hyp + list(toks[:i])])).logits[0, -1]
                assert torch.allclose(q[i].double(), torch.softmax(ref, -1), atol=1e-6), (j, c, i)
    # serving a hit returns the branch and keeps the draft KV equal to a fresh prefill
    j, c = next(iter(sp.tree))
    reply, _ = sp.serve(2, j, c)
    assert reply.hit and reply.tokens == sp.spec
    fed: list[int] = []  # rows each forward appends: the glue after an adopted branch is its last token only
    append = sp.runner.append
    sp.runner.append = lambda ids, *a, **kw: (fed.append(len(ids)), append(ids, *a, **kw))[1]
    sp.build()
    assert fed == [1], f"the hit's branch was recomputed, not adopted (forwards of {fed} rows)"
    ids = prompt + [11, *first.tokens[:j], c, *reply.tokens]
    fresh = model(input_ids=torch.tensor([ids])).logits[0, -1]
    # the committed sequence is exactly ids (the winning branch's tree KV was adopted, not recomputed);
    # the new tree's scratch rows follow it until the next forward drops them
    assert sp.kv_ids == ids and sp.runner.length == len(ids)
    if compile == "transformers":  # a DynamicCache holds the scratch rows after the committed ones
        assert sp.runner.scratch == k * len(sp.tree)
    probe = sp.runner.append([ids[-1]]).logits[-1]  # the next step from the cached KV
    refp = model(input_ids=torch.tensor([ids + [ids[-1]]])).logits[0, -1]
    assert torch.allclose(probe, refp, atol=1e-8) and fresh.shape == refp.shape


# --- temperature > 0: the output distribution is exactly the target's ------------------------------


DIST_CASES = [
    pytest.param(dict(k=1, fan_out="uniform:2", saguaro_c=1.0), dict(temperature=1.0), id="T1"),
    pytest.param(dict(k=2, fan_out="uniform:1", saguaro_c=0.3, fallback="auto"), dict(temperature=1.0, top_p=0.9), id="T1-C0.3-topp0.9"),
    pytest.param(dict(k=1, fan_out="2,2", saguaro_c=0.5, fallback="fast"), dict(temperature=0.8, top_k=5), id="T0.8-C0.5-topk5-fast"),
]


@pytest.mark.parametrize(("cfg", "sampling"), DIST_CASES)
def test_distribution_matches_target(small_pair, cfg, sampling):
    target, draft = small_pair
    dec = ssd(target, draft, **cfg)
    try:
        hits = []
        orig = dec.stream

        def stream(prompt, params):
            for ev in orig(prompt, params):
                if isinstance(ev, Round):
                    hits.append(ev.cache_hit)
                yield ev

        res = decoder_distribution_test(stream, target, [1, 4, 2], SamplingParams(**sampling), n=3, num_samples=1000)
        assert res.p_value > 1e-3, res
        assert 0 < sum(hits) < len(hits)  # both the cache and the fallback produced verified drafts
    finally:
        dec.close()


def test_the_speculator_is_sent_the_replys_own_sampling_params(pair, monkeypatch):
    """The reply's SamplingParams travel to the speculator as they are (no settings type copied field by
    field); what else it needs (Saguaro's C, the prompt's length) travels beside them in Begin."""
    target, draft = pair
    sent, orig = [], Channel.send
    monkeypatch.setattr(Channel, "send", lambda self, msg: (sent.append(msg), orig(self, msg))[1])
    params = SamplingParams(0.7, 0.9, 20, 5, max_new_tokens=6, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.1)
    dec = ssd(target, draft, k=2, saguaro_c=0.5)
    try:
        assert isinstance(list(dec.stream(PROMPTS[1], params))[-1], Done)
    finally:
        dec.close()
    begin = next(m for m in sent if isinstance(m, Begin))
    assert (begin.params, begin.saguaro_c, begin.prompt_len, begin.prompt_ids) == (params, 0.5, len(PROMPTS[1]), tuple(PROMPTS[1]))


def test_distribution_test_catches_a_wrong_proposal(small_pair, monkeypatch):
    """The same test fails when the verifier uses a q' other than the one the drafts came from
    (here: the unreshaped q while the draft sampled Saguaro's q' with C = 0.1).  Every miss drafts with the model
    (``fallback="neural"``): ``auto`` chooses by timing, and the fast fallback's point masses carry no q', so on a
    loaded machine most rounds could miss the bug (p = 0.35 once)."""
    target, _ = small_pair
    unrelated = as_loaded(tiny_llama(vocab_size=8, seed=11, head_scale=1.5), CharTokenizer(8), "other")
    dec = ssd(target, unrelated, k=2, fan_out="uniform:2", saguaro_c=0.1, fallback="neural")
    orig = Channel.q_rows

    def wrong(self, reply):
        q = orig(self, reply)
        return None if q is None else torch.full_like(q, 1 / q.shape[-1])

    monkeypatch.setattr(Channel, "q_rows", wrong)
    try:
        res = decoder_distribution_test(dec.stream, target, [1, 4, 2], SamplingParams(temperature=1.0), n=2, num_samples=600)
        assert res.p_value < 1e-3, res
    finally:
        dec.close()


# --- the packaged SmolLM2 with derived drafts ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("draft_name", "min_hit", "max_hit"), [("copy", 0.95, 1.0), ("int8", 0.3, 1.0), ("layers:6", 0.0, 0.5)])
def test_smollm2_greedy_ssd_equals_ar(smollm2, draft_name, min_hit, max_hit):
    from ssd_chat.engine.load import chat
    from ssd_chat.engine.drafts import shipped as drafts

    draft = drafts.derive(draft_name, smollm2)
    k = 1 if draft_name == "copy" else 2
    dec = SSDDecoder(Engine(EngineConfig(mode="ssd", k=k, draft=draft_name, fan_out="geometric", budget=3 * (k + 1)), smollm2, draft))
    try:
        prompt, _ = chat.prompt_ids(smollm2.tokenizer, [{"role": "user", "content": "List three facts about the moon."}])
        n = 64 if draft_name == "copy" else 32  # copy: 32 rounds of 2 tokens; the first (always a miss) leaves 0.97
        _, done = run(dec, prompt, max_new_tokens=n, ignore_eos=True)
        assert done.token_ids == ar_ids(smollm2, prompt, max_new_tokens=n, ignore_eos=True)
        s = done.stats
        print(f"{draft_name}: hit rate {s.cache_hit_rate:.2f}, acceptance {s.acceptance_rate:.2f}, rounds {s.rounds}")
        assert min_hit <= s.cache_hit_rate <= max_hit, s
    finally:
        dec.close()


# --- placement ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cores", "draft_device", "want"), [
    ({0, 1}, "auto", ((0,), (1,), False)),
    ({0, 1, 2, 3}, "cpu", ((0, 1), (2, 3), False)),
    ({0, 1, 2, 3}, "cpu:3", ((0, 1, 2), (3,), False)),
    ({0}, "auto", (None, None, True)),
])
def test_cpu_placement_gives_each_process_its_own_cores(monkeypatch, cores, draft_device, want):
    from ssd_chat.engine.load import models
    from ssd_chat.engine.speculate import plan as ssd_mod

    monkeypatch.setattr(ssd_mod.os, "sched_getaffinity", lambda pid: set(cores))
    monkeypatch.setattr(models.os, "sched_getaffinity", lambda pid: set(cores))
    p = ssd_mod.plan(EngineConfig(mode="ssd", draft_device=draft_device), torch.device("cpu"), None)
    assert (p.target_cores, p.draft_cores, p.shared) == want
    if p.draft_cores:
        assert p.draft_threads == len(p.draft_cores) and p.target_threads == len(p.target_cores)


def test_bad_draft_device_is_a_clear_error(pair):
    from ssd_chat.engine.errors import DeviceError

    with pytest.raises(DeviceError, match="cores"):
        ssd(*pair, k=2, draft_device="cpu:99")

def test_a_request_the_tree_cannot_answer_stops_the_tree(pair):
    """A miss arriving while the speculator drafts its tree stops the tree (the fallback starts at once);
    a hit, a ping or nothing lets it finish; a new reply stops it."""
    from ssd_chat.engine.speculate.channel import Ping, Spec
    from ssd_chat.engine.speculate.process import stops_tree

    target, draft = pair
    k = 3
    sp = Speculator(draft.forwards, k, parse("uniform:2", k), "neural", vocab=64)
    sp.begin(Begin(tuple(PROMPTS[2]), SamplingParams(seed=0)))
    sp.serve(1, -1, 11)
    sp.build()
    assert len(sp.tree) == 2 * (k + 1)
    hit = next(iter(sp.tree))
    miss = next((j, c) for j in range(k + 1) for c in range(64) if (j, c) not in sp.tree)
    for msg, stops in ((Spec(2, *hit, 0.0), False), (Spec(2, *miss, 0.0), True), (Ping(2), False),
                       (Begin((1, 2), SamplingParams(seed=0)), True)):
        sp.build(lambda msg=msg: stops_tree(msg, sp.building))
        assert (sp.tree == {}) == stops, msg
        assert sp.building == frozenset(sp.tree) or stops


@pytest.mark.parametrize("others", [0, 1])
def test_the_prompt_runs_on_ar_threads_before_the_verifier_is_pinned(pair, monkeypatch, others):
    """The bulk of SSD's TTFT, the prompt's eager forward, runs on the threads the caller (AR) computes
    with, unpinned and before the speculator is asked to prefill, when no other process runs (else on
    the verifier's share, where a busy core cannot stall it); the last prompt row and the rounds run
    on the verifier's pinned share.  Greedy tokens equal AR's either way."""
    import dataclasses
    import os

    from ssd_chat.engine import threads as threads_mod
    from ssd_chat.engine.model import runner as kv
    from ssd_chat.engine.speculate import proposers

    target, draft = pair
    dec = ssd(target, draft, k=2)
    calls = []
    for cls in (kv.CoreRunner, kv.Runner):
        def append(self, ids, *a, _orig=cls.append, **kw):
            calls.append(("forward", len(ids), kw.get("logits", "all"), torch.get_num_threads(), os.sched_getaffinity(0)))
            return _orig(self, ids, *a, **kw)
        monkeypatch.setattr(cls, "append", append)
    begin = proposers.RemoteProposer.begin
    monkeypatch.setattr(proposers.RemoteProposer, "begin", lambda self, *a: (calls.append(("begin",)), begin(self, *a))[1])
    monkeypatch.setattr(threads_mod, "others_running", lambda: others)
    mine = os.sched_getaffinity(0)
    dec.plan = dataclasses.replace(dec.plan, target_cores=(min(mine),), target_threads=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, done = run(dec, PROMPTS[2], max_new_tokens=20)
    finally:
        torch.set_num_threads(threads)
        dec.close()
    verifier = (1, {min(mine)})
    assert calls[0] == ("forward", len(PROMPTS[2]) - 1, "none", *((2, mine) if others == 0 else verifier))
    assert calls[1] == ("begin",)
    assert all(c[3:] == verifier for c in calls[2:]), calls  # the last prompt row and the rounds: the verifier's
    assert done.token_ids == ar_ids(target, PROMPTS[2], max_new_tokens=20)


def test_others_running_reads_the_machines_runnable_threads(monkeypatch):
    """The least of a few reads of /proc/loadavg's running count, less the caller; None if unreadable."""
    import io

    from ssd_chat.engine import threads

    reads = iter(["0.50 0.40 0.30 4/120 999\n", "0.50 0.40 0.30 3/120 999\n", "0.50 0.40 0.30 5/121 999\n"])
    monkeypatch.setattr(threads, "open", lambda path: io.StringIO(next(reads)), raising=False)
    assert threads.others_running() == 2
    monkeypatch.setattr(threads, "open", lambda path: io.StringIO("garbage"), raising=False)
    assert threads.others_running() is None
    monkeypatch.undo()
    n = threads.others_running()  # this machine's, for real (Linux)
    assert n is None or n >= 0
