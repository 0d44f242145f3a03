"""The few-row CPU Linear fast path: FastLinear modules computing the same products as F.linear,
stale transposes rebuilt, autograd untouched; the formulation per (threads, shape, rows) chosen
by timing on this CPU, stored and reused; numba's row kernels optional."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ssd_chat.engine.cpu import fastlinear, rowkernels
from ssd_chat.engine.cpu.fastlinear import FastLinear, FastPath


@pytest.fixture
def path(tmp_path, monkeypatch):
    """A fast path of its own, timing into its own store."""
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    return FastPath(store=tmp_path / "fastlinear.json")


def _key(*shape_rows: int) -> tuple[int, ...]:
    return (torch.get_num_threads(), *shape_rows)


def _linear(in_f: int, out_f: int, bias: bool) -> nn.Linear:
    torch.manual_seed(in_f * 7 + out_f)
    return nn.Linear(in_f, out_f, bias=bias)


def _wrap(path: FastPath, linear: nn.Linear) -> FastLinear:
    """One Linear served on its own (``install`` replaces the ones inside a model)."""
    fast = FastLinear(linear, path, linear.weight.numel() * linear.weight.element_size() <= fastlinear.MAX_TRANSPOSE_BYTES)
    path._layers.add(fast)
    path.prepare()
    return fast


@pytest.mark.parametrize("in_f,out_f", [(64, 64), (64, 24), (64, 160), (160, 64), (48, 900)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_for_every_row_count(path, in_f: int, out_f: int, bias: bool) -> None:
    ref = _linear(in_f, out_f, bias)
    m = _wrap(path, copy.deepcopy(ref))
    with torch.no_grad():
        for shape in [(1, in_f), (1, 1, in_f), (2, in_f), (1, 3, in_f), (4, in_f), (1, 5, in_f), (2, 3, in_f), (1, 7, in_f), (33, in_f)]:
            x = torch.randn(*shape)
            got, want = m(x), ref(x)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_install_replaces_linears_and_keeps_shared_weights_shared(path) -> None:
    emb = nn.Embedding(10, 16)
    head = nn.Linear(16, 10, bias=False)
    head.weight = emb.weight  # tied
    inner = nn.Linear(16, 16)
    model = nn.ModuleDict({"emb": emb, "a": inner, "b": inner, "head": head, "other": nn.Linear(4, 4).double()})
    assert path.install(model) == 2  # the shared Linear once, the tied head; not the float64 one
    assert isinstance(model["a"], FastLinear) and model["a"] is model["b"]
    assert model["head"].weight is emb.weight and model["a"].weight is inner.weight
    assert type(model["other"]) is nn.Linear
    assert path.install(model) == 0  # idempotent
    copied = copy.deepcopy(model)
    assert copied["a"].path is path and copied["a"].weight is not inner.weight
    fastlinear.restore(copied)
    assert type(copied["a"]) is nn.Linear and copied["a"] is copied["b"]


def test_every_path_is_taken_and_agrees_without_timing(tmp_path) -> None:
    """The static rule: row counts 1 (cached transpose), 2-5 (W @ x.T) and more (F.linear) on a tall matrix."""
    ref = _linear(32, 96, True)
    m = _wrap(FastPath(store=tmp_path / "s.json", timed=False), copy.deepcopy(ref))
    with torch.inference_mode():
        for rows in range(1, 9):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(m(x), ref(x), rtol=1e-5, atol=1e-5)
    assert m._t is not None and m._t.is_contiguous() and m._t.shape == (32, 96)
    assert not (tmp_path / "s.json").exists()  # nothing timed


def test_in_place_weight_update_rebuilds_the_transpose(path) -> None:
    m = _wrap(path, _linear(16, 40, False))
    path.choices.update({_key(40, 16, 1): "xwt"})
    x = torch.randn(1, 16)
    with torch.no_grad():
        first = m(x).clone()
        m.weight.mul_(2.0)  # e.g. a trained draft's weights copied in after building
        torch.testing.assert_close(m(x), 2 * first, rtol=1e-5, atol=1e-5)
        m.weight.copy_(torch.zeros_like(m.weight))
        assert torch.count_nonzero(m(x)) == 0


def test_gradients_flow_through_f_linear(path) -> None:
    ref = _linear(16, 40, True)
    m = _wrap(path, copy.deepcopy(ref))
    x = torch.randn(1, 16)
    m(x).square().sum().backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(m.weight.grad, ref.weight.grad)


def test_disabled_by_env_and_not_for_other_dtypes(path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSD_CHAT_FAST_LINEAR", "0")
    assert path.install(nn.Sequential(_linear(8, 8, False))) == 0
    monkeypatch.delenv("SSD_CHAT_FAST_LINEAR")
    assert path.install(nn.Sequential(_linear(8, 8, False).double())) == 0
    assert path.install(nn.Sequential(_linear(8, 8, False))) == 1


def test_no_transpose_copy_for_big_models(path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastlinear, "MAX_TRANSPOSE_BYTES", 100)
    model = nn.Sequential(_linear(16, 40, False))
    path.install(model)
    m = model[0]
    path.choices.update({_key(40, 16, 1): "xwt"})
    with torch.no_grad():
        x = torch.randn(1, 16)
        torch.testing.assert_close(m(x), F.linear(x, m.weight), rtol=1e-5, atol=1e-5)
    assert m._t is None and "xwt" not in path._methods(False)


def test_tune_keeps_the_fastest_formulation_for_each_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    cost = {("linear", 1): 5, ("wxt", 1): 4, ("xwt", 1): 1, ("linear", 2): 3, ("wxt", 2): 2, ("xwt", 2): 9,
            ("linear", 3): 1, ("wxt", 3): 2, ("xwt", 3): 3}
    cost.update({("rows", r): 8 for r in (1, 2, 3)} | {("rows4", r): 7 for r in (1, 2, 3)})
    now = [0.0]
    run = fastlinear.run

    def timed(method, x, w, wt):
        now[0] += cost[(method, x.shape[0])]
        return run(method, x, w, wt)

    monkeypatch.setattr(fastlinear, "run", timed)
    ws = [torch.randn(24, 16) for _ in range(3)]
    clock = lambda: now[0]  # noqa: E731
    assert fastlinear.tune(ws, ["linear", "wxt", "xwt"], range(1, 4), clock=clock) == {1: "xwt", 2: "wxt", 3: "linear"}
    # without the transpose copy, x @ Wt is never a candidate
    assert fastlinear.tune(ws, ["linear", "wxt"], range(1, 4), clock=clock) == {1: "wxt", 2: "wxt", 3: "linear"}
    # the row kernels win where they are fastest
    cost.update({("rows", 2): 1, ("rows4", 3): 0.5})
    if rowkernels.available():
        assert fastlinear.tune(ws, list(fastlinear.METHODS), range(1, 4), clock=clock) == {1: "xwt", 2: "rows", 3: "rows4"}
    # and are no candidate without numba, or with SSD_CHAT_FAST_LINEAR=torch (A/B runs)
    assert "rows" not in FastPath(kernels=False)._methods(True)
    monkeypatch.setenv("SSD_CHAT_FAST_LINEAR", "torch")
    assert FastPath()._methods(True) == ["linear", "wxt", "xwt"]
    monkeypatch.delenv("SSD_CHAT_FAST_LINEAR")
    monkeypatch.setattr(rowkernels, "available", lambda: False)
    assert FastPath()._methods(True) == ["linear", "wxt", "xwt"]


@pytest.mark.parametrize("method", fastlinear.METHODS)
def test_each_chosen_formulation_is_used_and_agrees(path, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if method in fastlinear.KERNEL_BLOCK and not rowkernels.available():
        pytest.skip("numba is not installed")
    ref = _linear(32, 96, True)
    m = _wrap(path, copy.deepcopy(ref))
    path.choices.update({_key(96, 32, r): method for r in range(1, fastlinear.MAX_FAST_ROWS + 1)})
    kernel_rows = []
    matmul_t = rowkernels.matmul_t

    def spy(x, w, block):
        kernel_rows.append((x.shape[0], block))
        return matmul_t(x, w, block)

    monkeypatch.setattr(rowkernels, "matmul_t", spy)
    with torch.inference_mode():
        for rows in range(1, 9):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(m(x), ref(x), rtol=1e-5, atol=1e-5)
    assert (m._t is not None) == (method == "xwt")  # the transpose copy exists only when it is used
    want = fastlinear.KERNEL_BLOCK.get(method)
    assert kernel_rows == ([(r, want) for r in range(1, fastlinear.MAX_FAST_ROWS + 1)] if want else [])


def test_the_chosen_kernels_are_loaded_at_install_with_the_signature_real_calls_use(path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not rowkernels.available():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(rowkernels, "_warmed", set())
    rows = range(1, fastlinear.MAX_FAST_ROWS + 1)
    path.choices.update({_key(96, 32, r): "rows4" for r in rows})  # known choices: nothing to time
    m = _wrap(path, _linear(32, 96, False))
    assert rowkernels._warmed == {(r, 4) for r in rows}
    signatures = {r: list(rowkernels.kernel(r, 4).signatures) for r in rows}
    assert all(len(s) == 1 for s in signatures.values())
    with torch.inference_mode():
        for r in rows:
            m(torch.randn(r, 32))
    assert {r: list(rowkernels.kernel(r, 4).signatures) for r in rows} == signatures  # nothing new compiled or loaded


def test_a_row_kernel_choice_without_numba_falls_back_to_f_linear(path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _wrap(path, _linear(32, 96, False))
    path.choices.update({_key(96, 32, r): "rows" for r in range(1, fastlinear.MAX_FAST_ROWS + 1)})
    monkeypatch.setattr(rowkernels, "available", lambda: False)
    monkeypatch.setattr(rowkernels, "matmul_t", lambda *a: pytest.fail("a row kernel ran without numba"))
    with torch.inference_mode():
        x = torch.randn(3, 32)
        torch.testing.assert_close(m(x), F.linear(x, m.weight), rtol=1e-5, atol=1e-5)


def test_choices_are_timed_once_stored_and_reused(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    tune = fastlinear.tune

    def counted(ws, *a, **kw):
        calls.append(tuple(ws[0].shape))
        return tune(ws, *a, **kw)

    monkeypatch.setattr(fastlinear, "tune", counted)
    store = tmp_path / "fastlinear.json"
    model = nn.Sequential(_linear(16, 40, False), _linear(40, 16, False), _linear(16, 40, True))
    said = []
    path = FastPath(store=store)
    path.install(model, announce=lambda: said.append(len(calls)))
    assert sorted(calls) == [(16, 40), (40, 16)]  # one timing per shape, not per layer
    assert said == [0]  # once, before the first timing
    (mine,) = json.loads(store.read_text()).values()
    assert set(mine) == {"40x16", "16x40"}
    assert all(set(v) == {str(r) for r in range(1, fastlinear.MAX_FAST_ROWS + 1)} and set(v.values()) <= set(fastlinear.METHODS) for v in mine.values())
    assert path.choices[_key(40, 16, 3)] == mine["40x16"]["3"]
    calls.clear()
    again = FastPath(store=store)  # a later load (another process): read back
    again.install(nn.Sequential(_linear(16, 40, False)), announce=lambda: said.append("again"))
    assert said == [0] and calls == [] and again.choices[_key(40, 16, 1)] == mine["40x16"]["1"]


def test_a_corrupt_store_means_timing_again(tmp_path) -> None:
    store = tmp_path / "fastlinear.json"
    store.write_text("{ not json")
    path = FastPath(store=store)
    assert path.install(nn.Sequential(_linear(16, 40, False))) == 1
    assert "40x16" in next(iter(json.loads(store.read_text()).values()))
    key = next(iter(json.loads(store.read_text())))
    store.write_text(json.dumps({"x": 1, key: {"40x16": {"1": "bogus"}}}))
    again = FastPath(store=store)
    again.install(nn.Sequential(_linear(16, 40, False)))
    assert again.choices[_key(40, 16, 1)] in fastlinear.METHODS


def test_a_trained_drafts_reduced_head_is_served_too(path) -> None:
    from ssd_chat.engine.drafts.model import ReducedHead

    head = ReducedHead(torch.randn(50, 16), torch.arange(0, 100, 2), 100)
    h = torch.randn(3, 16)
    with torch.inference_mode():
        want = head(h)
        path.install(head)
        assert isinstance(head.proj, FastLinear) and head.rows is head.proj.weight
        assert {_key(50, 16, r) for r in range(1, fastlinear.MAX_FAST_ROWS + 1)} <= set(path.choices)
        torch.testing.assert_close(head(h), want, rtol=1e-5, atol=1e-5)
    assert torch.isinf(want).sum(-1).eq(50).all()


def test_the_int8_draft_of_an_installed_target_is_quantized(path) -> None:
    """torch's quantization swaps exactly-typed nn.Linear modules: the int8 copy puts them back first."""
    from helpers.models import CharTokenizer, as_loaded, tiny_llama
    from ssd_chat.engine.drafts import shipped as drafts

    model = tiny_llama(dtype=torch.float32)
    assert path.install(model) > 0
    draft = drafts.derive("int8", as_loaded(model, CharTokenizer(64), "t"))
    kinds = {type(m).__module__ for m in draft.model.modules() if "Linear" in type(m).__name__}
    assert kinds and all("quantized" in k for k in kinds), kinds


def test_each_thread_count_gets_its_own_choices(path, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The app loads with every core and decodes pinned to fewer: prepare(threads) times (or reads
    back) the choices for that thread count, and the forward uses the ones for the current count."""
    calls = []
    tune = fastlinear.tune

    def counted(ws, *a, **kw):
        calls.append((torch.get_num_threads(), tuple(ws[0].shape)))
        return tune(ws, *a, **kw)

    monkeypatch.setattr(fastlinear, "tune", counted)
    threads = torch.get_num_threads()
    other = 1 if threads != 1 else 2
    m = _wrap(path, _linear(16, 40, False))
    assert calls == [(threads, (40, 16))] and _key(40, 16, 2) in path.choices
    path.prepare(other)
    path.prepare(other)  # nothing missing: no timing
    assert torch.get_num_threads() == threads  # timed with `other` threads, then put back
    assert calls == [(threads, (40, 16)), (other, (40, 16))]
    assert {(other, 40, 16, 2), (threads, 40, 16, 2)} <= set(path.choices)
    assert len(json.loads((tmp_path / "fastlinear.json").read_text())) == 2  # one entry per thread count
    path.choices[_key(40, 16, 2)] = "wxt"
    path.choices[(other, 40, 16, 2)] = "linear"
    seen = []
    monkeypatch.setattr(fastlinear, "run", lambda method, x, w, wt: seen.append(method) or F.linear(x, w))
    try:
        with torch.inference_mode():
            m(torch.randn(2, 16))
            torch.set_num_threads(other)
            m(torch.randn(2, 16))  # "linear" is plain F.linear: not through run()
    finally:
        torch.set_num_threads(threads)
    assert seen == ["wxt"]


def test_without_numba_everything_runs_on_torchs_products(tmp_path) -> None:
    """numba is an optional extra: in a process where it cannot be imported, the row kernels are no
    candidate and an installed model computes the same products with torch's formulations."""
    script = textwrap.dedent("""
        import sys
        sys.modules["numba"] = None  # `import numba` raises ImportError, as when it is not installed
        import torch
        from torch import nn
        from ssd_chat.engine.cpu import fastlinear, rowkernels
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 96), nn.Linear(96, 32))
        ref = [nn.Linear(32, 96), nn.Linear(96, 32)]
        for r, m in zip(ref, model):
            r.load_state_dict(m.state_dict())
        path = fastlinear.FastPath()
        assert path.install(model) == 2 and not rowkernels.available()
        assert set(path.choices.values()) <= {"linear", "wxt", "xwt"}, path.choices
        with torch.inference_mode():
            for rows in range(1, 9):
                x = torch.randn(rows, 32)
                torch.testing.assert_close(model(x), ref[1](ref[0](x)), rtol=1e-5, atol=1e-5)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "SSD_CHAT_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("block", rowkernels.BLOCKS)
@pytest.mark.parametrize("out_f", [1, 4, 7, 130])
def test_row_kernels_match_f_linear(block: int, out_f: int) -> None:
    if not rowkernels.available():
        pytest.skip("numba is not installed")
    torch.manual_seed(out_f)
    w = torch.randn(out_f, 37)
    for rows in range(1, rowkernels.MAX_ROWS + 1):
        x = torch.randn(rows, 37)
        torch.testing.assert_close(rowkernels.matmul_t(x, w, block), F.linear(x, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError):
        rowkernels.matmul_t(torch.randn(rowkernels.MAX_ROWS + 1, 37), w, block)


def _fresh_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rowkernels, "_module", None)
    monkeypatch.setattr(rowkernels, "_failed", None)
    monkeypatch.setattr(rowkernels, "_kernels", {})


def test_row_kernel_source_is_written_once_to_the_cache_dir(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("numba")
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    _fresh_kernels(monkeypatch)
    assert rowkernels.available()
    (src,) = (tmp_path / "cache" / "kernels").glob("rowkernels_*.py")
    assert src.read_text() == rowkernels.source()
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    torch.testing.assert_close(rowkernels.matmul_t(x, w, 4), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_without_a_writable_cache_dir_torchs_products_serve(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(blocker / "sub"))  # cannot be created
    _fresh_kernels(monkeypatch)
    assert not rowkernels.available()
    path = FastPath(store=tmp_path / "fastlinear.json")
    ref = _linear(8, 5, False)
    m = _wrap(path, copy.deepcopy(ref))
    assert set(path.choices.values()) <= {"linear", "wxt", "xwt"}
    x = torch.randn(2, 8)
    with torch.inference_mode():
        torch.testing.assert_close(m(x), ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", sorted(fastlinear.KERNEL_BLOCK))
def test_an_exported_graph_takes_torchs_product_where_the_row_kernels_were_chosen(path, method: str) -> None:
    """An AOTInductor package (the CPU graphs, engine/model/aoti.py) cannot call a Python custom op:
    under ``torch.export`` the chosen row kernels give way to the static rule; a compiled or eager call
    keeps them."""
    if not rowkernels.available():
        pytest.skip("numba is not installed")
    ref = _linear(32, 96, True)
    m = _wrap(path, copy.deepcopy(ref))
    path.choices.update({_key(96, 32, r): method for r in range(1, fastlinear.MAX_FAST_ROWS + 1)})
    call = path.traceable(m, 2)

    class Graph(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return call(x)

    x = torch.randn(2, 32)
    with torch.inference_mode():
        ep = torch.export.export(Graph(), (x,), strict=False)
        targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert not any("row_matmul" in t for t in targets), targets
        torch.testing.assert_close(ep.module()(x), ref(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(call(x), ref(x), rtol=1e-5, atol=1e-5)  # outside an export: the kernels
