"""GGUF-quantized linears (engine/cpu/quant.py): block decoding bit-exact against gguf's own
dequantization, products against F.linear with the dequantized weight, the mapping onto a model
that transformers loaded from a GGUF (q/k row permutation included), clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ssd_chat.engine.load import gguf_map
from ssd_chat.engine.cpu import quant
from ssd_chat.engine.cpu.quant import GGUFLinear, QuantError
from helpers.gguf import blocks, gguf_weight, KINDS, load_gguf, write_tiny_gguf


@pytest.fixture(autouse=True)
def _float32_kernels():
    """These tests are about the numba kernels' float32 products (test_int4.py: the int4 path)."""
    old, quant.INT4[0] = quant.INT4[0], False
    yield
    quant.INT4[0] = old


EPS = torch.finfo(torch.float32).eps


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_decode_bit_identical_to_gguf(kind):
    raw = blocks(70, 96, kind, np.random.default_rng(1))
    mod = GGUFLinear(raw, kind, 96)
    want = gguf_weight(raw, kind)
    assert want.shape == (70, 96)
    assert torch.equal(mod.dequantized(), want)  # 70 rows: one full tile and one padded


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # Two float32 dot products of the same n terms in different orders differ by at most
    # about 2 * n * u * sum|x_i w_i| (u = eps / 2 per rounding): n * eps * (|x| @ |w|.T).
    return w.shape[1] * EPS * (x.abs() @ w.abs().t()) + 1e-30


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, quant.KERNEL_MAX_ROWS])
def test_kernel_matches_f_linear(kind, rows):
    raw = blocks(130, 160, kind, np.random.default_rng(rows))
    mod = GGUFLinear(raw, kind, 160)
    w = gguf_weight(raw, kind)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    y, ref = mod(x), F.linear(x, w)
    assert y.shape == ref.shape == (rows, 130)
    assert bool(((y - ref).abs() <= _bound(x, w)).all())
    assert not torch.equal(w, torch.zeros_like(w))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_row_does_not_depend_on_the_other_rows(kind):
    """Up to KERNEL_MAX_ROWS rows, each row is summed the same way whatever rows come with it:
    a verification of k + 1 tokens gets bit for bit the products of k + 1 one-token steps
    (float32 F.linear does not promise that: its one-row and many-row paths differ)."""
    mod = GGUFLinear(blocks(200, 576, kind, np.random.default_rng(7)), kind, 576)
    x = torch.randn(quant.KERNEL_MAX_ROWS, 576)
    full = mod(x)
    for r in range(1, quant.KERNEL_MAX_ROWS + 1):
        assert torch.equal(mod(x[:r]), full[:r])
        assert torch.equal(mod(x[r - 1:r]), full[r - 1:r])


@pytest.mark.parametrize("threads", [1, 2])
def test_head_rows_equal_the_one_row_product(threads):
    """The Q8_0 output head reads its weights once for a verify of up to 5 rows (one kernel per row
    count): each of its rows must be the 1-row, 1-thread product bit for bit, at 1 and 2 threads.
    A kernel that summed a row in another order would change the last bits of some logits."""
    out_f = quant.PARALLEL_MIN_OUT + 3 * quant.TILE + 5  # big enough for threads, a padded last tile
    mod = GGUFLinear(blocks(out_f, 576, "Q8_0", np.random.default_rng(11)), "Q8_0", 576)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.cat([mod(x[i:i + 1]) for i in range(5)])
        torch.set_num_threads(threads)
        for r in range(1, 6):
            assert torch.equal(mod(x[:r]), one[:r]), r
            assert torch.equal(mod(x[5 - r:]), one[5 - r:]), r
    finally:
        torch.set_num_threads(before)


def test_result_does_not_depend_on_the_thread_count():
    """A verifier and a speculator running on different numbers of cores must compute the same
    logits bit for bit (a kernel that splits sums across threads would break this)."""
    raw = blocks(256, 128, "Q4_1", np.random.default_rng(6))
    mod = GGUFLinear(raw, "Q4_1", 128)
    x = torch.randn(3, 128)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = mod(x)
        torch.set_num_threads(2)
        two = mod(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("env, layer", [(None, "workqueue"), ("omp", "omp")])
def test_kernels_use_sleeping_threads_unless_the_user_chose(env, layer):
    """numba's OpenMP threads spin between products and take the cores torch and the other
    process need; the kernels pick the workqueue layer unless NUMBA_THREADING_LAYER says otherwise."""
    import os
    import subprocess
    import sys

    e = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    if env:
        e["NUMBA_THREADING_LAYER"] = env
    code = "import numba; from ssd_chat.engine.cpu import qkernels; print(numba.config.THREADING_LAYER)"
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True).stdout
    assert out.strip() == layer


def test_many_rows_use_f_linear_on_the_same_weights():
    raw = blocks(64, 64, "Q4_1", np.random.default_rng(2))
    mod = GGUFLinear(raw, "Q4_1", 64)
    x = torch.randn(quant.KERNEL_MAX_ROWS + 7, 64)
    assert torch.equal(mod(x), F.linear(x, gguf_weight(raw, "Q4_1")))


def test_batch_shape_bias_and_dtype():
    rng = np.random.default_rng(3)
    raw = blocks(40, 64, "Q8_0", rng)
    bias = torch.randn(40)
    mod = GGUFLinear(raw, "Q8_0", 64, bias=bias)
    w = gguf_weight(raw, "Q8_0")
    x = torch.randn(2, 3, 64)
    y = mod(x)
    assert y.shape == (2, 3, 40)
    assert torch.allclose(y, F.linear(x, w, bias), atol=1e-5)
    assert torch.equal(mod(x.requires_grad_()), y)  # inference only: an input that requires grad is fine
    yb = mod(x.detach().to(torch.bfloat16))
    assert yb.dtype == torch.bfloat16
    assert mod(torch.zeros(0, 64)).shape == (0, 40)


def test_row_order_is_applied_to_every_array():
    raw = blocks(64, 64, "Q4_1", np.random.default_rng(4))
    order = np.random.default_rng(5).permutation(64)
    assert torch.equal(GGUFLinear(raw, "Q4_1", 64, row_order=order).dequantized(), gguf_weight(raw, "Q4_1")[order])


def test_decode_errors_are_clear():
    with pytest.raises(QuantError, match=r"Q4_K is not supported \(supported: Q4_0, Q4_1, Q8_0\)"):
        quant.split_blocks(np.zeros((2, 144), np.uint8), "Q4_K")
    with pytest.raises(QuantError, match="not whole 20-byte blocks"):
        quant.split_blocks(np.zeros((2, 30), np.uint8), "Q4_1")
    with pytest.raises(QuantError, match="64 inputs per row, the layer 96"):
        GGUFLinear(blocks(4, 64, "Q8_0", np.random.default_rng(0)), "Q8_0", 96)


# --- a tiny llama GGUF that transformers itself loads ---------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return path, load_gguf(path)


def test_tiny_gguf_maps_every_linear_bit_identically(tiny_gguf):
    path, model = tiny_gguf
    mods = gguf_map.gguf_linears(model, path, check_rows=10**6)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(mods) == linears  # 2 x 7 projections and the head tied to the Q8_0 embedding
    assert mods["lm_head"].kind == "Q8_0" and mods["model.layers.0.self_attn.k_proj"].kind == "Q4_0"
    subs = dict(model.named_modules())
    for name, mod in mods.items():
        assert torch.equal(mod.dequantized(), subs[name].weight), name


def test_q_and_k_rows_follow_transformers_permutation(tiny_gguf, monkeypatch):
    """Without the row order transformers gives llama q/k projections the check must fail:
    the permutation is real here (4 query heads, 2 key heads), not an identity."""
    path, model = tiny_gguf
    monkeypatch.setattr(gguf_map, "_row_order", lambda *a, **k: None)
    with pytest.raises(QuantError, match="q_proj: the GGUF blocks do not decode to the model's weights"):
        gguf_map.gguf_linears(model, path, check_rows=64)


def test_swapped_model_computes_like_the_dequantized_one(tiny_gguf):
    path, model = tiny_gguf
    ids = torch.tensor([[1, 5, 9, 2, 77, 31, 4]])
    with torch.inference_mode():
        ref = model(ids).logits
        old = quant.swap_modules(model, gguf_map.gguf_linears(model, path))
        try:
            assert isinstance(model.model.layers[1].mlp.down_proj, GGUFLinear)
            got = model(ids).logits
            one = model(ids[:, :1]).logits  # the one-row kernel path
        finally:
            back = quant.swap_modules(model, old)
        assert isinstance(back["lm_head"], GGUFLinear) and type(model.lm_head) is torch.nn.Linear
        assert torch.equal(model(ids).logits, ref)
    assert (got - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    assert (one[0, 0] - ref[0, 0]).abs().max().item() < 1e-4 * ref.abs().max().item()


def test_unsupported_type_is_a_clear_error(tmp_path):
    path = write_tiny_gguf(tmp_path / "k.gguf", {**KINDS, "ffn_down": "Q4_K"}, layers=1)
    model = load_gguf(path)
    with pytest.raises(QuantError, match=r"not supported for blk\.0\.ffn_down\.weight \(Q4_K\) \(supported: Q4_0, Q4_1, Q8_0\)"):
        gguf_map.gguf_linears(model, path)
    mods = gguf_map.gguf_linears(model, path, keep_unsupported=True)
    assert "model.layers.0.mlp.down_proj" not in mods and "model.layers.0.mlp.up_proj" in mods


def test_a_different_checkpoint_is_refused(tiny_gguf, tmp_path):
    _, model = tiny_gguf
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)
    with pytest.raises(QuantError, match="do not decode to the model's weights"):
        gguf_map.gguf_linears(model, other)
    with pytest.raises(QuantError, match="could not read GGUF file"):
        gguf_map.gguf_linears(model, tmp_path / "missing.gguf")


# --- the packaged SmolLM2-135M-Instruct (Q4_1 layers, Q8_0 tied head) -----------------------------


@pytest.mark.slow
def test_packaged_model_greedy_agreement(smollm2, record_property):
    """Same weights bit for bit, float32 sums in another order: logits stay within float32
    rounding of the dequantized model and greedy decoding agrees (reported, not assumed, for
    the continuation: a near-tie may legitimately flip a token)."""
    from ssd_chat.engine.load import models

    model, tok = smollm2.model, smollm2.tokenizer
    mods = gguf_map.gguf_linears(model, models.packaged_gguf())
    assert len(mods) == 30 * 7 + 1 and mods["lm_head"].kind == "Q8_0"
    assert {m.kind for n, m in mods.items() if n != "lm_head"} == {"Q4_1"}
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at"]
    agree = total = 0
    worst = 0.0
    kw = {"max_new_tokens": 16, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([tok(p)["input_ids"]])
            ref = model.generate(ids, **kw)
            old = quant.swap_modules(model, mods)
            try:
                got = model.generate(ids, **kw)  # the prompt through F.linear, every later step through the kernel
            finally:
                quant.swap_modules(model, old)
            same = (got.sequences[0, ids.shape[1]:] == ref.sequences[0, ids.shape[1]:]).int().cumprod(0)
            n = int(same.sum())  # tokens before the first difference
            agree, total = agree + n, total + same.numel()
            for a, b in list(zip(got.logits, ref.logits))[: n + 1]:  # steps fed the same tokens (a few rows, then one)
                worst = max(worst, (a - b).abs().max().item())
            assert n >= 1, p
    record_property("greedy_agreement", f"{agree}/{total}")
    record_property("logits_max_abs_diff", worst)
    print(f"greedy agreement {agree}/{total}, logits max abs diff {worst:.2e}")
    assert worst < 2e-3  # measured about 1e-4 on logits of magnitude ~20
