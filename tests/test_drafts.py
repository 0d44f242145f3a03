"""Drafts derived from the target: copy, int8 (CPU), layers:N."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.models import CharTokenizer, as_loaded, tiny_llama
from ssd_chat.engine.drafts import shipped as drafts
from ssd_chat.engine.model import runner as kv
from ssd_chat.engine.decode.ar import ARDecoder
from ssd_chat.engine.engine import Engine, EngineConfig
from ssd_chat.engine.errors import ModelError
from ssd_chat.engine.events import Done
from ssd_chat.engine.load.models import Placement
from ssd_chat.engine.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


IDS = torch.tensor([[3, 17, 42, 8, 25, 60, 1, 9]])


@pytest.fixture
def target():
    return as_loaded(tiny_llama(seed=0, layers=3), CharTokenizer(64), "tiny3", eos_ids={63})


def _logits(model, ids=IDS):
    with torch.inference_mode():
        return model(input_ids=ids).logits[0].double()


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_is_derived():
    assert drafts.is_derived("copy") and drafts.is_derived("int8") and drafts.is_derived("layers:6")
    for name in ("layers:", "layers:x", "int4", "smollm2-135m", "Copy"):
        assert not drafts.is_derived(name)


def test_shipped_aliases_name_the_packaged_models_drafts(target):
    assert drafts.is_derived("trained") and drafts.is_derived("features")
    shipped = drafts.shipped_drafts()
    assert ("layers" in {k for _, t, k in shipped if t == "smollm2-135m-gguf"})
    for alias in drafts.SHIPPED:  # a target nothing was trained for: one clear line, nothing loaded
        with pytest.raises(ModelError, match=f"no '{alias}' draft ships for target 'tiny3'.*draft train"):
            drafts.derive(alias, target)


def test_the_default_draft_is_the_trained_one_shipped_for_the_target_else_int8():
    from ssd_chat.engine.load import models
    from ssd_chat.engine.engine import default_draft

    assert default_draft(models.PACKAGED) == "trained"  # assets/drafts/smollm2-135m-instruct
    assert default_draft("tiny3") == "int8" and default_draft("HuggingFaceTB/SmolLM2-360M-Instruct") == "int8"


def test_switching_from_ar_derives_the_default_draft_and_stays_exact(target):
    from ssd_chat.engine.errors import ParamError

    engine = Engine(EngineConfig(target=target.name, mode="ar", k=3), target, None)
    params = SamplingParams(max_new_tokens=24)
    ar = [e for e in engine.stream([1, 2, 3, 4], params) if isinstance(e, Done)][0].token_ids
    engine.reconfigure(mode="sd")
    assert engine.draft is not None and engine.draft.name == "int8"  # nothing ships for tiny3
    sd = [e for e in engine.stream([1, 2, 3, 4], params) if isinstance(e, Done)][0]
    assert sd.token_ids == ar and sd.stats.mode == "sd"
    named = Engine(EngineConfig(target=target.name, draft="someone/a-draft", mode="ar"), target, None)
    with pytest.raises(ParamError, match="restart with --mode ssd --draft someone/a-draft"):
        named.reconfigure(mode="ssd")  # a separate model is not loaded mid-session
    assert named.draft is None and named.config.mode == "ar"


def test_unknown_derived_name_is_a_model_error(target):
    with pytest.raises(ModelError, match="unknown derived draft"):
        drafts.derive("layers:two", target)


def test_derived_draft_shares_tokenizer_and_eos(target):
    d = drafts.derive("copy", target)
    assert d.tokenizer is target.tokenizer and d.eos_ids == target.eos_ids and d.name == "copy"
    assert d.device == target.device


# -- copy ----------------------------------------------------------------------------


def test_copy_is_identical_but_independent(target):
    d = drafts.derive("copy", target)
    assert torch.equal(_logits(d.model), _logits(target.model))
    before = _logits(target.model)
    with torch.no_grad():
        for p in d.model.parameters():
            p.mul_(0.5)
    assert torch.equal(_logits(target.model), before)  # the target's weights were not touched
    assert not torch.equal(_logits(d.model), before)


# -- int8 ----------------------------------------------------------------------------


def test_int8_quantizes_the_linears_and_keeps_the_target_intact(target):
    from torch.ao.nn.quantized.dynamic import Linear as QLinear

    snap = _snapshot(target.model)
    tied = target.model.lm_head.weight is target.model.model.embed_tokens.weight
    d = drafts.derive("int8", target)
    qlinears = [m for m in d.model.modules() if isinstance(m, QLinear)]
    # 3 layers x (q, k, v, o, gate, up, down) + the head
    assert len(qlinears) == 3 * 7 + 1
    assert not any(isinstance(m, torch.nn.Linear) and not isinstance(m, QLinear) for m in d.model.modules())
    # the target is still a float64 model with its embeddings tied, weights unchanged
    assert (target.model.lm_head.weight is target.model.model.embed_tokens.weight) == tied
    assert all(torch.equal(p, snap[n]) for n, p in target.model.named_parameters())
    assert isinstance(target.model.lm_head, torch.nn.Linear) and not isinstance(target.model.lm_head, QLinear)


def test_int8_is_close_to_the_target(target):
    d = drafts.derive("int8", target)
    a, b = _logits(d.model), _logits(target.model)
    assert a.shape == b.shape
    assert not torch.equal(a, b)  # really quantized
    corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
    assert corr > 0.95, corr
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75


def test_int8_runs_incrementally_with_a_kv_cache(target):
    """The draft is used one token at a time with a cache: that must work for the quantized model."""
    d = drafts.derive("int8", target)
    cache = kv.new_cache(d.model)
    kv.forward(d.model, IDS[0, :5], cache)
    step = kv.forward(d.model, IDS[0, 5:6], cache)[-1]
    assert kv.length(cache) == 6 and step.shape == (64,) and torch.isfinite(step).all()


def test_int8_off_cpu_is_a_clear_error(target):
    fake_gpu = dataclasses.replace(target, placement=Placement(torch.device("cuda", 0), torch.float16))
    with pytest.raises(ModelError, match="CPU only"):
        drafts.derive("int8", fake_gpu)


def test_sd_with_int8_draft_equals_ar(target):
    ar = list(ARDecoder(target).stream([1, 2, 3, 4], SamplingParams(max_new_tokens=24)))[-1]
    res = list(Engine(EngineConfig(mode="sd", k=3), target, drafts.derive("int8", target)).stream([1, 2, 3, 4], SamplingParams(max_new_tokens=24)))[-1]
    assert isinstance(res, Done) and res.token_ids == ar.token_ids


# -- layers:N ------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3])
def test_first_layers_computes_the_truncated_network(target, n):
    d = drafts.derive(f"layers:{n}", target)
    assert len(d.model.model.layers) == n and d.model.config.num_hidden_layers == n
    with torch.inference_mode():
        hidden = target.model(input_ids=IDS, output_hidden_states=True).hidden_states
        inner = target.model.model
        # hidden_states[n] is the residual stream after layer n; the last entry is already normed
        h = hidden[n] if n < 3 else hidden[-1]
        expected = target.model.lm_head(inner.norm(h) if n < 3 else h)[0].double()
    assert torch.allclose(_logits(d.model), expected, atol=1e-9)


def test_first_layers_shares_weights_and_leaves_the_target_whole(target):
    before = _logits(target.model)
    d = drafts.derive("layers:1", target)
    assert d.model.model.layers[0] is target.model.model.layers[0]
    assert d.model.model.embed_tokens is target.model.model.embed_tokens and d.model.lm_head is target.model.lm_head
    assert len(target.model.model.layers) == 3 and target.model.config.num_hidden_layers == 3
    assert torch.equal(_logits(target.model), before)
    # and the draft really is shorter: different logits
    assert not torch.allclose(_logits(d.model), before)


def test_first_layers_runs_with_its_own_cache(target):
    d = drafts.derive("layers:2", target)
    cache = kv.new_cache(d.model)
    full = _logits(d.model)
    kv.forward(d.model, IDS[0, :6], cache)
    rest = kv.forward(d.model, IDS[0, 6:], cache)
    assert len(cache.layers) == 2
    assert torch.allclose(rest.double(), full[6:], atol=1e-9)


@pytest.mark.parametrize("name", ["layers:0", "layers:4", "layers:99"])
def test_first_layers_out_of_range(target, name):
    with pytest.raises(ModelError, match="out of range: the target has 3 layers"):
        drafts.derive(name, target)


def test_first_layers_needs_a_layer_stack():
    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)

    fake = as_loaded(Flat(), CharTokenizer(2), "flat")
    with pytest.raises(ModelError, match="model.layers"):
        drafts.derive("layers:1", fake)


def test_sd_with_a_layers_draft_equals_ar(target):
    ar = list(ARDecoder(target).stream([5, 6, 7], SamplingParams(max_new_tokens=24)))[-1]
    for n in (1, 2):
        eng = Engine(EngineConfig(mode="sd", k=2), target, drafts.derive(f"layers:{n}", target))
        assert list(eng.stream([5, 6, 7], SamplingParams(max_new_tokens=24)))[-1].token_ids == ar.token_ids


def test_a_trained_draft_is_named_as_the_draft_it_is_from_its_manifest(target, tmp_path):
    """Not by its folder's name alone (the shipped `smollm2-135m-instruct` read as the target): what it is
    comes from its manifest, for a draft trained here as for the shipped ones, and the panel, `ask --json`,
    bench and serve all take the loaded draft's name."""
    from ssd_chat.engine.drafts import model as draft_model
    from ssd_chat.train.folder import save

    draft = draft_model.build(target.model, draft_model.DraftShape(1, (2,)), torch.tensor([0, 3, 5, 17]))
    folder = save(draft, tmp_path / "mine", target.name, target.model)
    loaded = drafts.derive(str(folder), target)
    assert loaded.name == "mine (1 shared layer + 1 own, 4-token head)" == drafts.label(str(folder), "tiny3")
    assert drafts.label("trained", "smollm2-135m-gguf") == "trained (2 shared layers + 2 own, 8192-token head)"
    assert drafts.label("features", "smollm2-135m-gguf").startswith("features (1 own layer on the target's hidden states")
    assert drafts.label("int8", "tiny3") == "int8"
