"""The compact core over GGUF-precision linears (quant.GGUFLinear) and row-independent attention
(core.attend_rows): close to the float32 core, and a verify of k + 1 rows, a tree step and any thread count
computing bit for bit what one-row forwards compute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ssd_chat.engine.model import compile as core_compile
from ssd_chat.engine.load import gguf_map
from ssd_chat.engine.cpu import quant
from ssd_chat.engine.model.core import Core

from helpers.gguf import load_gguf, write_tiny_gguf


@pytest.fixture(autouse=True)
def _float32_kernels():
    """These tests are about the numba kernels' float32 products (test_int4.py: the int4 path)."""
    old, quant.INT4[0] = quant.INT4[0], False
    yield
    quant.INT4[0] = old


PROMPT = [3, 17, 42, 5, 9, 61, 0, 33, 12, 7, 88, 21]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny llama GGUF (Q4_1, Q4_0 and Q8_0 layers, a head tied to the Q8_0 embedding) as
    transformers loads it (float32), and its GGUF linears."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", layers=2, seed=3)
    model = load_gguf(path)
    return model, gguf_map.gguf_linears(model, path, check_rows=10**6)


@pytest.fixture
def swapped(tiny):
    model, mods = tiny
    old = quant.swap_modules(model, mods)
    yield model
    quant.swap_modules(model, old)


def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


def test_core_forward_through_gguf_linears_matches_the_float32_core(tiny):
    model, mods = tiny
    ref = Core(model, "fp32").append(PROMPT + [1, 2, 3]).logits
    old = quant.swap_modules(model, mods)
    try:
        core = Core(model, "gguf", row_attention=True)
        assert all(isinstance(core.layers[0].mods[n], quant.GGUFLinear) for n in ("q", "k", "v", "o", "gate", "up", "down"))
        assert isinstance(core.head, quant.GGUFLinear) and core.head.kind == "Q8_0"
        core.append(PROMPT, logits="none")  # a prompt: F.linear on the same weights
        got = torch.cat([core.append([t]).logits for t in (1, 2, 3)])  # one-row kernel steps
    finally:
        quant.swap_modules(model, old)
    scale = ref.abs().max().item()
    assert (got - ref[-3:]).abs().max().item() < 1e-4 * scale
    assert torch.equal(got.argmax(-1), ref[-3:].argmax(-1))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_verify_equals_one_row_steps_bit_for_bit(swapped, threads):
    before = _threads(threads)
    try:
        core = Core(swapped, "gguf", row_attention=True)
        core.append(PROMPT, logits="none")
        L = core.kv.length
        block = [4, 40, 77, 2]  # k + 1 = 4 rows
        verify = core.append(block).logits
        core.kv.truncate(L)
        singles = torch.cat([core.append([t]).logits for t in block])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(verify, singles)


def test_a_tree_step_equals_each_branch_alone_bit_for_bit(swapped):
    """SSD's tree step: B branches at depth 0 in one call, each row seeing the prefix and itself."""
    core = Core(swapped, "gguf", row_attention=True)
    core.append(PROMPT, logits="none")
    L = core.kv.length
    ids = [5, 6, 7, 8, 9, 10]
    tree = core.tree(ids, [L] * 6, [L + b for b in range(6)], [[] for _ in ids]).logits
    for b, t in enumerate(ids):
        one = core.tree([t], [L], [L + b], [[]]).logits
        assert torch.equal(one[0], tree[b]), b


def test_results_do_not_depend_on_the_thread_count(swapped):
    out = {}
    for n in (1, 2):
        before = _threads(n)
        try:
            core = Core(swapped, "gguf", row_attention=True)
            out[n] = torch.cat([core.append(PROMPT, logits="last").logits, core.append([4, 40, 77]).logits,
                                core.append([9]).logits])
        finally:
            torch.set_num_threads(before)
    assert torch.equal(out[1], out[2])


def test_without_row_attention_the_core_still_agrees_closely(swapped):
    a = Core(swapped, "sdpa", row_attention=False).append(PROMPT + [4, 40]).logits
    b = Core(swapped, "rows", row_attention=True).append(PROMPT).logits
    assert (a[: len(PROMPT)] - b).abs().max().item() < 1e-4 * b.abs().max().item()


def test_a_compiled_graph_calls_the_kernels_as_a_custom_op(swapped, monkeypatch):
    """dynamo traces GGUFLinear whole (fullgraph): the product is the ssd_chat::gguf_mm op, and the graph
    computes what the eager core computes (backend "eager": tracing without inductor's C++ build)."""
    seen = []

    def compile_eager(fn, cuda):
        def backend(gm, example_inputs):
            seen.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
            return gm.forward

        return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)

    monkeypatch.setattr(core_compile, "_compile", compile_eager)
    comp = Core(swapped, "comp", compile="on", rows=(1, 3))
    eager = Core(swapped, "eager")
    for c in (comp, eager):
        c.append(PROMPT, logits="none")
    got, ref = comp.append([4, 40, 77]).logits, eager.append([4, 40, 77]).logits
    one, ref1 = comp.append([9]).logits, eager.append([9]).logits
    assert not comp.compiler.failed and seen and any("ssd_chat.gguf_mm" in " ".join(s) for s in seen)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one, ref1, rtol=1e-5, atol=1e-5)


def test_the_op_and_the_module_compute_the_same_product(tiny):
    _, mods = tiny
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "lm_head"):
        m = mods[name]
        x = torch.randn(3, m.in_features)
        op = torch.ops.ssd_chat.gguf_mm(x, m.q, m.d, m.d if m.m is None else m.m, m.out_features)
        assert torch.equal(op, m(x)), name


@pytest.mark.slow
def test_inductor_compiles_the_gguf_core(swapped):
    """Real inductor (a C++ build per row shape, slow on a small CPU) on the tiny GGUF model."""
    notices: list[str] = []
    comp = Core(swapped, "comp", compile="on", rows=(1,), notify=notices.append)
    eager = Core(swapped, "eager")
    toks, logits = [int(comp.append(PROMPT, logits="last").logits.argmax())], []
    for _ in range(6):
        logits.append(comp.append([toks[-1]]).logits[-1])
        toks.append(int(logits[-1].argmax()))
    eager.append(PROMPT, logits="none")
    ref = torch.stack([eager.append([t]).logits[-1] for t in toks[:-1]])
    # the graph attends with core.attend_rows, eager with SDPA: the same numbers up to the order of sums
    assert not notices and (torch.stack(logits) - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    assert np.isfinite(comp.compiler.compile_s[1])
