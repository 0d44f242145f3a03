"""AR, SD and SSD on the compact core (``--compile off|on|auto``) against the transformers path
(``--compile transformers``): the same greedy tokens, the target's distribution at T > 0, and
failures (a compile error, a model the core does not run, no memory for the cache)."""

from __future__ import annotations

import pytest
import torch

from helpers.models import CharTokenizer, as_loaded, tiny_llama
from helpers.distribution import decoder_distribution_test
from ssd_chat.engine.drafts import shipped as drafts
from ssd_chat.engine.model import cache as static_kv
from ssd_chat.engine.engine import Engine, EngineConfig
from ssd_chat.engine.events import Done, Error, Notice, Round
from ssd_chat.engine.params import SamplingParams

PROMPTS = ([1, 2, 3], [5, 17, 40, 2, 9], [7, 7, 8, 60, 33, 12])


def reply(eng: Engine, prompt: list[int], n: int = 32, **kw) -> tuple[tuple[int, ...], list]:
    evs = list(eng.stream(prompt, SamplingParams(max_new_tokens=n, **kw)))
    assert isinstance(evs[-1], Done), evs[-1]
    return evs[-1].token_ids, evs


@pytest.mark.parametrize(("mode", "k", "fan_out", "draft"), [
    ("ar", 2, None, None),
    ("sd", 1, None, None),
    ("sd", 4, None, None),
    ("sd", 3, None, "layers:1"),
    ("ssd", 1, "uniform:1", None),
    ("ssd", 3, "geometric", None),
    ("ssd", 2, "3,2,1", None),
])
def test_greedy_on_the_core_equals_the_transformers_path(pair, mode, k, fan_out, draft):
    target, d = pair
    d = drafts.derive(draft, target) if draft else d
    cfg = dict(mode=mode, k=k, fan_out=fan_out)
    with Engine(EngineConfig(compile="off", **cfg), target, d) as core, \
            Engine(EngineConfig(compile="transformers", **cfg), target, d) as ref, \
            Engine(EngineConfig(mode="ar", compile="transformers"), target) as ar:
        for prompt in PROMPTS:
            got, evs = reply(core, prompt)
            assert got == reply(ref, prompt)[0] == reply(ar, prompt)[0], (mode, k, fan_out, prompt)
            assert not [e for e in evs if isinstance(e, Notice) and "transformers" in e.message]
            if mode != "ar":
                assert any(isinstance(e, Round) and e.accepted > 0 for e in evs)  # the draft did propose
        info, ref_info = core.describe(), ref.describe()
    assert info["forward"] == "core eager" and ref_info["forward"] == "transformers"
    if mode != "ar":  # the SSD speculator's draft: as its process reported it
        assert info["draft_forward"] == "core eager" and ref_info["draft_forward"] == "transformers"


@pytest.mark.parametrize(("cfg", "sampling"), [
    pytest.param(dict(mode="sd", k=2), dict(temperature=0.9, top_k=5), id="sd-topk5"),
    pytest.param(dict(mode="ssd", k=2, fan_out="uniform:1", saguaro_c=0.3), dict(temperature=1.0, top_p=0.9), id="ssd-C0.3-topp0.9"),
])
def test_distribution_on_the_core_matches_the_target(small_pair, cfg, sampling):
    target, draft = small_pair
    with Engine(EngineConfig(compile="off", **cfg), target, draft) as eng:
        res = decoder_distribution_test(eng.stream, target, [1, 4, 2], SamplingParams(**sampling), n=3, num_samples=1000)
        info = eng.describe()
    assert res.p_value > 1e-3, res
    assert info["forward"] == "core eager" and info["draft_forward"] == "core eager"


def test_a_compile_failure_runs_eagerly_with_one_notice(pair, monkeypatch):
    target, _ = pair
    with Engine(EngineConfig(mode="ar", compile="off"), target) as eager:
        want = [reply(eager, p, 12)[0] for p in PROMPTS[:2]]

    def broken(*a, **k):
        raise RuntimeError("InductorError: no C++ compiler\nmore detail")

    monkeypatch.setattr(torch, "compile", broken)
    from ssd_chat.engine.model import aoti

    monkeypatch.setattr(aoti, "load_or_build", broken)  # CPU graphs are AOTInductor packages
    with Engine(EngineConfig(mode="ar", compile="on"), target) as eng:
        got, notices = [], []
        for p in PROMPTS[:2]:
            ids, evs = reply(eng, p, 12)
            got.append(ids)
            notices += [e.message for e in evs if isinstance(e, Notice)]
        assert eng.describe()["forward"] == "core eager"
    assert got == want
    failures = [n for n in notices if not n.endswith("(once)")]  # the progress line before the attempt is not a failure
    assert len(failures) == 1 and failures[0].startswith("compiling t failed (RuntimeError: InductorError: no C++ compiler)")
    assert "\n" not in notices[0]


def test_a_model_the_core_does_not_run_uses_transformers_with_one_notice(pair):
    from transformers import LlamaForCausalLM

    base = pair[0].model
    cfg = base.config.to_dict() | {"hidden_act": "gelu"}
    model = LlamaForCausalLM(type(base.config).from_dict(cfg)).to(torch.float64).eval()
    model.load_state_dict(base.state_dict())
    gelu = as_loaded(model, CharTokenizer(64), "gelu")
    assert gelu.forwards.predict("off") == "transformers"
    with Engine(EngineConfig(mode="ar", compile="off"), gelu) as eng, Engine(EngineConfig(mode="ar", compile="transformers"), gelu) as ref:
        notices = []
        for p in PROMPTS:
            ids, evs = reply(eng, p, 8)
            assert ids == reply(ref, p, 8)[0]
            notices += [e.message for e in evs if isinstance(e, Notice)]
        assert eng.describe()["forward"] == "transformers"
    assert notices == ["the target runs on transformers, not the compact core: activation 'gelu' (the core has SiLU)"]


def test_what_the_speculator_said_at_its_start_reaches_the_first_reply_once(pair):
    """The SSD speculator's draft on transformers (a GELU model): its process says why, and the frame
    hands that on in the reply's events, once."""
    from transformers import LlamaForCausalLM

    target, d = pair
    model = LlamaForCausalLM(type(d.model.config).from_dict(d.model.config.to_dict() | {"hidden_act": "gelu"}))
    model.load_state_dict(d.model.state_dict())
    draft = as_loaded(model.to(torch.float64).eval(), CharTokenizer(64), "gelu draft")
    with Engine(EngineConfig(mode="ssd", k=2, fan_out="uniform:2", compile="off"), target, draft) as eng:
        said = [[e.message for e in reply(eng, p, 8)[1] if isinstance(e, Notice)] for p in PROMPTS[:2]]
        assert eng.describe()["draft_forward"] == "transformers"
    why = "speculator: the draft runs on transformers, not the compact core: activation 'gelu' (the core has SiLU)"
    assert why in said[0] and not [m for m in said[1] if m.startswith("speculator:")]


def test_no_memory_for_the_cache_is_one_line_naming_the_model_and_size(monkeypatch):
    target = as_loaded(tiny_llama(seed=4), CharTokenizer(64), "t")  # no core yet: its cache is allocated here
    monkeypatch.setattr(static_kv, "bucket", lambda n, limit=None: 1 << 36)  # 16 TiB: refused at once
    with Engine(EngineConfig(mode="ar", compile="off"), target) as eng:
        evs = list(eng.stream(PROMPTS[0], SamplingParams(max_new_tokens=4)))
    err = evs[-1]
    assert isinstance(err, Error) and err.kind == "oom", err
    assert err.message.startswith(f"out of memory allocating the KV cache of 't': {1 << 36} tokens (") and "\n" not in err.message


@pytest.mark.slow
def test_packaged_model_on_the_core_equals_the_transformers_path(smollm2):
    from ssd_chat.engine.load import chat

    prompt, _ = chat.prompt_ids(smollm2.tokenizer, [{"role": "user", "content": "Name three planets."}])
    for mode, draft_name in (("ar", None), ("sd", "layers:6"), ("ssd", "copy")):
        draft = drafts.derive(draft_name, smollm2) if draft_name else None
        cfg = dict(mode=mode, k=2, draft=draft_name, fan_out="geometric" if mode == "ssd" else None)
        with Engine(EngineConfig(compile="off", **cfg), smollm2, draft) as core, \
                Engine(EngineConfig(compile="transformers", **cfg), smollm2, draft) as ref:
            got = reply(core, prompt, 32)[0]
            assert got == reply(ref, prompt, 32)[0], mode
            assert core.describe()["forward"] == "core eager" and ref.describe()["forward"] == "transformers"


def test_a_derived_draft_runs_on_cores_of_its_own(pair):
    """A derived draft is a shallow copy of the target's modules: its handle must not give it the
    core made for the target, nor one made for an earlier draft derived the same way."""
    target, _ = pair
    first, second = drafts.derive("layers:1", target), drafts.derive("layers:1", target)
    r0 = target.forwards.runner("draft", "off")
    r1 = first.forwards.runner("draft", "off")
    assert r1.core is not r0.core and r1.core.model is first.model
    assert second.forwards.runner("draft", "off").core.model is second.model
