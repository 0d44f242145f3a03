"""A GGUF target in its own precision (engine/load/precision.py): when it applies, its label, the swap,
and the drafts that follow it (layers:N and copy share its GGUF linears, int8 is a Q8_0 copy, a
trained draft keeps the target's blocks and Q8_0 blocks for its own layers)."""

from __future__ import annotations

import torch
import pytest
from torch import nn

from ssd_chat.engine.drafts import folder as draft_folder, gguf as gguf_drafts, model as draft_model
from ssd_chat.engine.load import gguf_header, precision
from ssd_chat.engine.load.models import LoadedModel, ModelSpec, Placement
from ssd_chat.engine.cpu.quant import GGUFLinear
from ssd_chat.train.folder import save

from helpers.models import CharTokenizer
from helpers.gguf import load_gguf, write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = [1, 5, 9, 2, 77, 31, 4, 60]


@pytest.fixture
def target(gguf_path, tmp_path) -> LoadedModel:
    return LoadedModel(name="tiny-gguf", spec=ModelSpec("tiny-gguf", "gguf", str(gguf_path)), model=load_gguf(gguf_path),
                       tokenizer=CharTokenizer(96), placement=Placement(torch.device("cpu"), torch.float32),
                       folder=tmp_path / "converted")


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([IDS])).logits[0]


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-4) -> bool:
    return (a - b).abs().max().item() <= rel * b.abs().max().item()


def test_header_file_type(gguf_path, tmp_path):
    assert gguf_header.file_type(gguf_path) == "Q4_1"
    assert gguf_header.file_type(write_tiny_gguf(tmp_path / "none.gguf", layers=1)) is None  # the header does not say
    (tmp_path / "x.gguf").write_bytes(b"GGUF\x03\x00")  # truncated
    assert gguf_header.file_type(tmp_path / "x.gguf") is None
    assert gguf_header.file_type(tmp_path / "missing.gguf") is None


@pytest.mark.parametrize(("kind", "device", "dtype", "want"), [
    ("gguf", "cpu", None, True), ("gguf", "cpu", "auto", True), ("gguf", "cpu", " AUTO", True),
    ("gguf", "cpu", "float32", False), ("gguf", "cpu", "bfloat16", False), ("gguf", "cuda", None, False),
    ("folder", "cpu", None, False), ("hub", "cpu", "auto", False),
])
def test_only_a_gguf_on_cpu_without_a_dtype(kind, device, dtype, want):
    assert precision.wanted(kind, device, dtype) is want


def test_the_target_computes_from_its_blocks_and_says_so(target):
    ref = _logits(target.model)
    assert precision.of(target) == "float32" and precision.where(target) == "cpu float32"
    from ssd_chat.bench.machine import weight_bytes

    params, streamed = precision.num_params(target), weight_bytes(target.model)
    precision.to_gguf(target)
    blocks = sum(m.nbytes for m in set(precision.state(target).modules.values()))
    assert blocks <= weight_bytes(target.model) < blocks + 0.02 * streamed  # the bench's memory bound: blocks, not floats
    assert precision.num_params(target) == params  # the blocks' weights count, the tied head once
    lins = {n: m for n, m in target.model.named_modules() if isinstance(m, (nn.Linear, GGUFLinear))}
    assert len(lins) == 3 * 7 + 1 and all(isinstance(m, GGUFLinear) for m in lins.values())
    assert precision.of(target) == "gguf Q4_1" and precision.where(target) == "cpu gguf Q4_1"
    got = _logits(target.model)
    assert _close(got, ref) and torch.equal(got.argmax(-1), ref.argmax(-1))
    with precision.float_view(target):
        assert type(target.model.model.layers[0].mlp.up_proj) is nn.Linear
        assert torch.equal(_logits(target.model), ref)
    assert isinstance(target.model.model.layers[0].mlp.up_proj, GGUFLinear)


def test_the_label_falls_back_to_the_kind_most_weights_have(gguf_path, tmp_path):
    path = write_tiny_gguf(tmp_path / "plain.gguf", layers=1)
    lm = LoadedModel(name="p", spec=ModelSpec("p", "gguf", str(path)), model=load_gguf(path), tokenizer=CharTokenizer(96),
                     placement=Placement(torch.device("cpu"), torch.float32), folder=tmp_path / "c")
    precision.to_gguf(lm)
    assert precision.of(lm) == "gguf Q4_1"  # q, o, gate and down are Q4_1: most of the weights


def test_layers_and_copy_drafts_share_the_targets_gguf_linears(target):
    precision.to_gguf(target)
    mods = precision.state(target).modules
    for name in ("layers:2", "copy"):
        d = gguf_drafts.derive(name, target)
        assert d.model.lm_head is mods["lm_head"], name
        assert d.model.model.layers[1].mlp.down_proj is mods["model.layers.1.mlp.down_proj"], name
        assert precision.of(d) == "gguf Q4_1", name
    assert torch.equal(_logits(gguf_drafts.derive("copy", target).model), _logits(target.model))


def test_the_float_paths_int8_draft_is_labelled_as_such():
    import warnings

    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = quantize_dynamic(nn.Sequential(nn.Linear(32, 32)), {nn.Linear}, dtype=torch.qint8)
    lm = LoadedModel("int8", ModelSpec("int8", "derived", "int8"), model, None, Placement(torch.device("cpu"), torch.float32))
    assert precision.of(lm) == "int8 dynamic" and precision.where(lm) == "cpu int8 dynamic"


def test_int8_is_a_q8_copy_on_the_same_kernels(target):
    ref = _logits(target.model)
    precision.to_gguf(target)
    d = gguf_drafts.derive("int8", target)
    lins = [m for m in d.model.modules() if isinstance(m, (nn.Linear, GGUFLinear))]
    assert len(lins) == 3 * 7 + 1 and all(isinstance(m, GGUFLinear) and m.kind == "Q8_0" for m in lins)
    assert d.model.lm_head is precision.state(target).modules["lm_head"]  # the head is Q8_0 in the file already
    assert d.model.model.embed_tokens.weight is target.model.model.embed_tokens.weight  # shared, not copied
    assert precision.of(d) == "gguf Q8_0"
    assert _close(_logits(d.model), ref, 0.05)  # a re-quantized copy: close, not equal


def test_a_trained_draft_keeps_the_targets_blocks_and_q8_own_layers(target, tmp_path):
    vocab = torch.tensor([0, 3, 5, 17, 40, 95])
    draft = draft_model.build(target.model, draft_model.DraftShape(1, (2,)), vocab)
    with torch.no_grad():
        for p in draft.model.layers[1].parameters():
            p.add_(0.01 * torch.randn_like(p))
    folder = tmp_path / "draft"
    save(draft, folder, target.name, target.model)
    ref = _logits(draft_folder.load_draft_folder(str(folder), target).model)
    precision.to_gguf(target)  # the hash of the shared float weights is checked on the float view
    d = gguf_drafts.derive(str(folder), target)
    assert d.model.model.layers[0].self_attn.q_proj is precision.state(target).modules["model.layers.0.self_attn.q_proj"]
    own = d.model.model.layers[1].mlp.gate_proj
    assert isinstance(own, GGUFLinear) and own.kind == "Q8_0"
    assert isinstance(target.model.model.layers[0].self_attn.q_proj, GGUFLinear)  # the float view was undone
    got = _logits(d.model)
    keep = torch.isfinite(ref)
    assert torch.equal(keep, torch.isfinite(got)) and _close(got[keep], ref[keep], 0.05)


def test_precision_load_does_not_time_the_float_linears_it_replaces(gguf_path, monkeypatch):
    """models.load_model installs the CPU fast path on every float32 linear (0.75 s of a warm start on the
    packaged model); a GGUF target in its own precision replaces them, so its load skips that."""
    from ssd_chat.engine.cpu import fastlinear
    from ssd_chat.engine.load import models

    seen = []

    def fake_load(name, placement, *a, **k):
        lm = LoadedModel(name="tiny-gguf", spec=ModelSpec("tiny-gguf", "gguf", str(gguf_path)), model=load_gguf(gguf_path),
                         tokenizer=CharTokenizer(96), placement=placement)
        seen.append(fastlinear.FastPath(timed=False).install(lm.model))  # what models.load_model's install does
        return lm

    monkeypatch.setattr(models, "load_model", fake_load)
    lm = precision.load_with_precision(str(gguf_path), models.parse_placement("cpu", "auto"), None)
    assert seen == [0] and precision.of(lm) == "gguf Q4_1"
    lm = precision.load_with_precision(str(gguf_path), models.parse_placement("cpu", "float32"), "float32")
    assert seen[1] == 3 * 7 + 1 and precision.of(lm) == "float32"
