"""GGUF-precision weights for a target and its drafts (engine/load/gguf_weights.py) and the tile cache
of gguf_map: drafts share the target's blocks, their own weights become Q8_0 blocks, a warm start
reads the cache instead of parsing the GGUF."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from ssd_chat.engine.drafts import gguf as gguf_drafts, shipped as drafts, model as draft_model
from ssd_chat.engine.load import gguf_weights as fast_weights
from ssd_chat.engine.cpu import quant
from ssd_chat.engine.load import gguf_map
from ssd_chat.engine.model.core import Core
from ssd_chat.engine.load.models import LoadedModel, ModelSpec, Placement
from ssd_chat.engine.cpu.quant import GGUFLinear

from helpers.models import CharTokenizer
from helpers.gguf import load_gguf, write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def target(gguf_path, tmp_path) -> LoadedModel:
    model = load_gguf(gguf_path)
    return LoadedModel(name="tiny-gguf", spec=ModelSpec("tiny-gguf", "gguf", str(gguf_path)), model=model,
                       tokenizer=CharTokenizer(96), placement=Placement(torch.device("cpu"), torch.float32),
                       folder=tmp_path / "converted")


def _logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


IDS = [1, 5, 9, 2, 77, 31, 4, 60]


def test_gguf_target_needs_a_gguf_on_cpu(target):
    with pytest.raises(Exception, match="is not a GGUF model"):
        fast_weights.gguf_target(dataclasses.replace(target, spec=ModelSpec("x", "folder", "/x")))
    mods = fast_weights.gguf_target(target)
    assert len(mods) == 3 * 7 + 1 and mods["lm_head"].kind == "Q8_0"


def test_layers_draft_shares_the_targets_blocks(target):
    draft = drafts.derive("layers:2", target)
    mods = fast_weights.gguf_target(target)
    dmods = gguf_drafts.fast_draft(draft.model, mods)
    assert dmods["lm_head"] is mods["lm_head"]
    assert dmods["model.layers.1.mlp.down_proj"] is mods["model.layers.1.mlp.down_proj"]
    assert not any(n.startswith("model.layers.2") for n in dmods)  # the draft has two layers
    ref = _logits(draft.model, IDS)
    quant.swap_modules(target.model, mods)
    quant.swap_modules(draft.model, dmods)
    got = _logits(draft.model, IDS)
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max()  # the same weights, other sum order


def test_trained_draft_gets_q8_blocks_for_its_own_layers_and_the_heads_own_rows(target):
    """A trained draft's shape: target layer 0 shared, a new layer (its own float weights), a
    reduced head over some vocabulary rows of the tied Q8_0 head."""
    vocab = torch.tensor([0, 3, 5, 17, 40, 95])
    draft = draft_model.build(target.model, draft_model.DraftShape(1, (2,)), vocab)
    with torch.no_grad():
        draft.lm_head.bias.copy_(torch.linspace(-1, 1, len(vocab)))
        for p in draft.model.layers[1].parameters():  # "trained": not a copy of target layer 2 anymore
            p.add_(0.01 * torch.randn_like(p))
    mods = fast_weights.gguf_target(target)
    dmods = gguf_drafts.fast_draft(draft, mods)
    assert dmods["model.layers.0.self_attn.q_proj"] is mods["model.layers.0.self_attn.q_proj"]
    own = dmods["model.layers.1.mlp.gate_proj"]
    assert isinstance(own, GGUFLinear) and own.kind == "Q8_0" and own not in mods.values()
    rows = dmods["lm_head.proj"]  # the reduced head keeps its trained bias and calls its rows as GGUF blocks
    assert isinstance(rows, GGUFLinear) and "lm_head" not in dmods
    assert torch.equal(rows.dequantized(), mods["lm_head"].dequantized()[vocab])  # the file's own blocks
    ref = _logits(draft, IDS)
    quant.swap_modules(target.model, mods)
    quant.swap_modules(draft, dmods)
    got = _logits(draft, IDS)
    keep = torch.isfinite(ref)
    assert torch.equal(keep, torch.isfinite(got)) and keep.sum() == len(IDS) * len(vocab)
    assert (got[keep] - ref[keep]).abs().max() < 0.05 * ref[keep].abs().max()  # Q8_0 rounding of the new layer
    core = Core(draft, "draft")  # the core runs it: the reduced head is called, not read
    assert torch.equal(core.append(IDS).logits.argmax(-1), got.argmax(-1))


def test_q8_copy_requantizes_every_layer_and_shares_the_rest(target):
    mods = fast_weights.gguf_target(target)
    q8 = fast_weights.q8_copy(target.model, mods)
    lins = {n: m for n, m in q8.named_modules() if isinstance(m, GGUFLinear)}
    assert len(lins) == 3 * 7 + 1 and {m.kind for m in lins.values()} == {"Q8_0"}
    assert lins["lm_head"] is mods["lm_head"]  # the file's Q8_0 head as it is
    assert q8.model.embed_tokens.weight is target.model.model.embed_tokens.weight
    assert type(target.model.model.layers[0].mlp.up_proj) is nn.Linear  # the target is untouched
    ref, got = _logits(target.model, IDS), _logits(q8, IDS)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert int(got[-1].argmax()) == int(ref[-1].argmax())


# --- the tile cache -------------------------------------------------------------------------------


def test_a_warm_start_reads_the_cache_instead_of_the_gguf(target, monkeypatch):
    cold = gguf_map.gguf_linears(target.model, target.spec.source, cache=target.folder)
    assert (target.folder / gguf_map.CACHE_FILE).is_file()

    def no_parse(*a, **k):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf_map, "_from_gguf", no_parse)
    warm = gguf_map.gguf_linears(target.model, target.spec.source, cache=target.folder, check_rows=10**6)
    assert set(warm) == set(cold)
    x = torch.randn(3, 64)
    for n, m in cold.items():
        assert warm[n].kind == m.kind and torch.equal(warm[n].dequantized(), m.dequantized()), n
        if m.in_features == 64:
            assert torch.equal(warm[n](x), m(x)), n


def test_a_bad_or_foreign_cache_is_rebuilt(target, gguf_path, tmp_path):
    target.folder.mkdir(parents=True)
    path = target.folder / gguf_map.CACHE_FILE
    path.write_bytes(b"not safetensors")
    mods = gguf_map.gguf_linears(target.model, gguf_path, cache=target.folder)
    assert len(mods) == 3 * 7 + 1 and path.stat().st_size > 1000
    other = load_gguf(write_tiny_gguf(tmp_path / "two.gguf", layers=2, seed=1))  # another model, same cache folder
    with pytest.raises(quant.QuantError, match="do not decode to the model's weights"):
        gguf_map.gguf_linears(other, gguf_path, cache=target.folder)  # its cache entries were checked, then the GGUF


def test_a_cache_that_cannot_be_written_only_costs_the_parse(target, gguf_path, monkeypatch):
    def read_only(*a, **k):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(gguf_map.os, "replace", read_only)
    assert len(gguf_map.gguf_linears(target.model, gguf_path, cache=target.folder)) == 3 * 7 + 1
    assert not (target.folder / gguf_map.CACHE_FILE).exists() and not list(target.folder.iterdir())  # no temp file left
