"""The few-row CPU Linear fast path: same products as F.linear, stale caches rebuilt, autograd untouched;
the formulation per (shape, rows) chosen by timing on this CPU, stored and reused."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import weakref

from ssd_chat.engine import fastlinear, rowkernels


@pytest.fixture(autouse=True)
def _own_choices(tmp_path, monkeypatch):
    """Each test times (or not) into its own store and choice table."""
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fastlinear, "_choices", {})
    monkeypatch.setattr(fastlinear, "_installed", weakref.WeakSet())
    monkeypatch.setattr(fastlinear, "_retuned", set())


def _key(*shape_rows: int) -> tuple[int, ...]:
    return (torch.get_num_threads(), *shape_rows)


def _linear(in_f: int, out_f: int, bias: bool) -> nn.Linear:
    torch.manual_seed(in_f * 7 + out_f)
    m = nn.Linear(in_f, out_f, bias=bias)
    return m


@pytest.mark.parametrize("in_f,out_f", [(64, 64), (64, 24), (64, 160), (160, 64), (48, 900)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_for_every_row_count(in_f: int, out_f: int, bias: bool) -> None:
    m = _linear(in_f, out_f, bias)
    ref = nn.Linear(in_f, out_f, bias=bias)
    ref.load_state_dict(m.state_dict())
    assert fastlinear.install(m) == 1
    with torch.no_grad():
        for shape in [(1, in_f), (1, 1, in_f), (2, in_f), (1, 3, in_f), (4, in_f), (1, 5, in_f), (2, 3, in_f), (1, 7, in_f), (33, in_f)]:
            x = torch.randn(*shape)
            got, want = m(x), ref(x)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_every_path_is_taken_and_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    """The static rule: row counts 1 (cached transpose), 2-5 (W @ x.T) and more (F.linear) on a tall matrix."""
    monkeypatch.setenv("SSD_CHAT_FAST_LINEAR", "static")
    m = _linear(32, 96, True)
    w, b = m.weight.detach().clone(), m.bias.detach().clone()
    fastlinear.install(m)
    with torch.inference_mode():
        for rows in range(1, 9):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(m(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert m._ssd_t is not None and m._ssd_t.is_contiguous() and m._ssd_t.shape == (32, 96)


def test_in_place_weight_update_rebuilds_the_transpose() -> None:
    m = _linear(16, 40, False)
    fastlinear.install(m)
    x = torch.randn(1, 16)
    with torch.no_grad():
        first = m(x).clone()
        m.weight.mul_(2.0)  # e.g. a trained draft's weights copied in after building
        torch.testing.assert_close(m(x), 2 * first, rtol=1e-5, atol=1e-5)
        m.weight.copy_(torch.zeros_like(m.weight))
        assert torch.count_nonzero(m(x)) == 0


def test_gradients_flow_through_f_linear() -> None:
    m = _linear(16, 40, True)
    ref = nn.Linear(16, 40)
    ref.load_state_dict(m.state_dict())
    fastlinear.install(m)
    x = torch.randn(1, 16)
    m(x).square().sum().backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(m.weight.grad, ref.weight.grad)


def test_disabled_by_env_and_not_for_other_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSD_CHAT_FAST_LINEAR", "0")
    assert fastlinear.install(_linear(8, 8, False)) == 0
    monkeypatch.delenv("SSD_CHAT_FAST_LINEAR")
    assert fastlinear.install(_linear(8, 8, False).double()) == 0
    m = _linear(8, 8, False)
    assert fastlinear.install(m) == 1 and fastlinear.install(m) == 0  # idempotent
    fastlinear.uninstall(m)
    assert "forward" not in m.__dict__


def test_no_transpose_copy_for_big_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastlinear, "MAX_TRANSPOSE_BYTES", 100)
    m = _linear(16, 40, False)
    fastlinear.install(m)
    with torch.no_grad():
        x = torch.randn(1, 16)
        torch.testing.assert_close(m(x), F.linear(x, m.weight), rtol=1e-5, atol=1e-5)
    assert m._ssd_t is None


def test_tune_keeps_the_fastest_formulation_for_each_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    cost = {("linear", 1): 5, ("wxt", 1): 4, ("xwt", 1): 1, ("linear", 2): 3, ("wxt", 2): 2, ("xwt", 2): 9,
            ("linear", 3): 1, ("wxt", 3): 2, ("xwt", 3): 3}
    cost.update({("rows", r): 8 for r in (1, 2, 3)} | {("rows4", r): 7 for r in (1, 2, 3)})
    now = [0.0]
    run = fastlinear._run

    def timed(method, x, w, wt):
        now[0] += cost[(method, x.shape[0])]
        return run(method, x, w, wt)

    monkeypatch.setattr(fastlinear, "_run", timed)
    ws = [torch.randn(24, 16) for _ in range(3)]
    assert fastlinear.tune(ws, True, range(1, 4), clock=lambda: now[0]) == {1: "xwt", 2: "wxt", 3: "linear"}
    # without the transpose copy, x @ Wt is never a candidate
    assert fastlinear.tune(ws, False, range(1, 4), clock=lambda: now[0]) == {1: "wxt", 2: "wxt", 3: "linear"}
    # the row kernels win where they are fastest, and are no candidate without numba
    cost.update({("rows", 2): 1, ("rows4", 3): 0.5})
    assert fastlinear.tune(ws, True, range(1, 4), clock=lambda: now[0]) == {1: "xwt", 2: "rows", 3: "rows4"}
    monkeypatch.setenv("SSD_CHAT_FAST_LINEAR", "torch")  # torch's products only, for A/B runs
    assert fastlinear.tune(ws, True, range(1, 4), clock=lambda: now[0]) == {1: "xwt", 2: "wxt", 3: "linear"}
    monkeypatch.delenv("SSD_CHAT_FAST_LINEAR")
    monkeypatch.setattr(rowkernels, "available", lambda: False)
    assert fastlinear.tune(ws, True, range(1, 4), clock=lambda: now[0]) == {1: "xwt", 2: "wxt", 3: "linear"}


@pytest.mark.parametrize("method", fastlinear.METHODS)
def test_each_chosen_formulation_is_used_and_agrees(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _linear(32, 96, True)
    w, b = m.weight.detach().clone(), m.bias.detach().clone()
    fastlinear.install(m)
    fastlinear._choices.update({_key(96, 32, r): method for r in range(1, fastlinear.MAX_FAST_ROWS + 1)})
    kernel_rows = []
    matmul_t = rowkernels.matmul_t

    def spy(x, w, block):
        kernel_rows.append((x.shape[0], block))
        return matmul_t(x, w, block)

    monkeypatch.setattr(rowkernels, "matmul_t", spy)
    with torch.inference_mode():
        for rows in range(1, 9):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(m(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert (m._ssd_t is not None) == (method == "xwt")  # the transpose copy exists only when it is used
    want = {"rows": 1, "rows4": 4}.get(method)
    assert kernel_rows == ([(r, want) for r in range(1, fastlinear.MAX_FAST_ROWS + 1)] if want else [])


def test_the_chosen_kernels_are_loaded_at_install_with_the_signature_real_calls_use(monkeypatch: pytest.MonkeyPatch) -> None:
    if not rowkernels.available():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(rowkernels, "_warmed", set())
    rows = range(1, fastlinear.MAX_FAST_ROWS + 1)
    fastlinear._choices.update({_key(96, 32, r): "rows4" for r in rows})  # stored choices: nothing to time
    m = _linear(32, 96, False)
    fastlinear.install(m)
    assert rowkernels._warmed == {(r, 4) for r in rows}
    signatures = {r: list(rowkernels.kernel(r, 4).signatures) for r in rows}
    assert all(len(s) == 1 for s in signatures.values())
    with torch.inference_mode():
        for r in rows:
            m(torch.randn(r, 32))
    assert {r: list(rowkernels.kernel(r, 4).signatures) for r in rows} == signatures  # nothing new compiled or loaded


def test_a_row_kernel_choice_without_numba_falls_back_to_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _linear(32, 96, False)
    fastlinear.install(m)
    fastlinear._choices.update({_key(96, 32, r): "rows" for r in range(1, fastlinear.MAX_FAST_ROWS + 1)})
    monkeypatch.setattr(rowkernels, "available", lambda: False)
    monkeypatch.setattr(rowkernels, "matmul_t", lambda *a: pytest.fail("a row kernel ran without numba"))
    with torch.inference_mode():
        x = torch.randn(3, 32)
        torch.testing.assert_close(m(x), F.linear(x, m.weight), rtol=1e-5, atol=1e-5)


def test_choices_are_timed_once_stored_and_reused(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    tune = fastlinear.tune

    def counted(ws, allow_t, *a, **kw):
        calls.append(tuple(ws[0].shape))
        return tune(ws, allow_t, *a, **kw)

    monkeypatch.setattr(fastlinear, "tune", counted)
    model = nn.Sequential(_linear(16, 40, False), _linear(40, 16, False), _linear(16, 40, True))
    said = []
    fastlinear.install(model, announce=lambda: said.append(len(calls)))
    assert sorted(calls) == [(16, 40), (40, 16)]  # one timing per shape, not per layer
    assert said == [0]  # once, before the first timing
    store = json.loads((tmp_path / "cache" / "fastlinear.json").read_text())
    (mine,) = store.values()
    assert set(mine) == {"40x16", "16x40"}
    assert all(set(v) == {str(r) for r in range(1, fastlinear.MAX_FAST_ROWS + 1)} and set(v.values()) <= set(fastlinear.METHODS) for v in mine.values())
    assert fastlinear._choices[_key(40, 16, 3)] == mine["40x16"]["3"]
    calls.clear()
    fastlinear._choices.clear()
    fastlinear.install(nn.Sequential(_linear(16, 40, False)), announce=lambda: said.append("again"))  # a later load: read back
    assert said == [0] and calls == [] and fastlinear._choices[_key(40, 16, 1)] == mine["40x16"]["1"]
    monkeypatch.setenv("SSD_CHAT_FAST_LINEAR", "retune")
    fastlinear.install(nn.Sequential(_linear(16, 40, False)))
    assert calls == [(40, 16)]
    monkeypatch.setenv("SSD_CHAT_FAST_LINEAR", "static")
    calls.clear()
    fastlinear.install(nn.Sequential(_linear(8, 8, False)))
    assert calls == []


def test_a_corrupt_store_means_timing_again(tmp_path) -> None:
    path = tmp_path / "cache" / "fastlinear.json"
    path.parent.mkdir(parents=True)
    path.write_text("{ not json")
    m = _linear(16, 40, False)
    assert fastlinear.install(m) == 1
    assert "40x16" in next(iter(json.loads(path.read_text()).values()))
    path.write_text(json.dumps({"x": 1, fastlinear._machine_key(True): {"40x16": {"1": "bogus"}}}))
    fastlinear._choices.clear()
    fastlinear.install(_linear(16, 40, False))
    assert fastlinear._choices[_key(40, 16, 1)] in fastlinear.METHODS


def test_weights_a_module_names_are_timed_too(tmp_path) -> None:
    class Head(nn.Module):
        fast_linear_weights = ("rows",)

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("rows", torch.randn(50, 16))
            self.proj = nn.Linear(16, 16)

    fastlinear.install(Head())
    assert {_key(50, 16, r) for r in range(1, fastlinear.MAX_FAST_ROWS + 1)} <= set(fastlinear._choices)
    (mine,) = json.loads((tmp_path / "cache" / "fastlinear.json").read_text()).values()
    assert set(mine) == {"16x16", "50x16"}


def test_each_thread_count_gets_its_own_choices(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The app loads with every core and decodes pinned to fewer: prepare() times (or reads back)
    the choices for the thread count in force, and linear() uses the ones for the current count."""
    calls = []
    tune = fastlinear.tune

    def counted(ws, allow_t, *a, **kw):
        calls.append((torch.get_num_threads(), tuple(ws[0].shape)))
        return tune(ws, allow_t, *a, **kw)

    monkeypatch.setattr(fastlinear, "tune", counted)
    threads = torch.get_num_threads()
    other = 1 if threads != 1 else 2
    m = _linear(16, 40, False)
    try:
        torch.set_num_threads(other)
        fastlinear.install(m)
        torch.set_num_threads(threads)
        assert _key(40, 16, 2) not in fastlinear._choices
        fastlinear.prepare()
        fastlinear.prepare()  # nothing missing: no timing
        assert calls == [(other, (40, 16)), (threads, (40, 16))]
        assert {(other, 40, 16, 2), (threads, 40, 16, 2)} <= set(fastlinear._choices)
        assert len(json.loads((tmp_path / "cache" / "fastlinear.json").read_text())) == 2  # one entry per thread count
        fastlinear._choices[_key(40, 16, 2)] = "rows"
        fastlinear._choices[(other, 40, 16, 2)] = "wxt"
        seen = []
        monkeypatch.setattr(fastlinear, "_run", lambda method, x, w, wt: seen.append(method) or F.linear(x, w))
        with torch.inference_mode():
            m(torch.randn(2, 16))
            torch.set_num_threads(other)
            m(torch.randn(2, 16))
        assert seen == ["rows", "wxt"]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("block", rowkernels.BLOCKS)
@pytest.mark.parametrize("out_f", [1, 4, 7, 130])
def test_row_kernels_match_f_linear(block: int, out_f: int) -> None:
    torch.manual_seed(out_f)
    w = torch.randn(out_f, 37)
    for rows in range(1, rowkernels.MAX_ROWS + 1):
        x = torch.randn(rows, 37)
        torch.testing.assert_close(rowkernels.matmul_t(x, w, block), F.linear(x, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError):
        rowkernels.matmul_t(torch.randn(rowkernels.MAX_ROWS + 1, 37), w, block)


def test_row_kernel_source_is_written_once_to_the_cache_dir(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rowkernels, "_module", None)
    monkeypatch.setattr(rowkernels, "_failed", None)
    monkeypatch.setattr(rowkernels, "_kernels", {})
    assert rowkernels.available()
    (src,) = (tmp_path / "cache" / "kernels").glob("rowkernels_*.py")
    assert src.read_text() == rowkernels.source()
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    torch.testing.assert_close(rowkernels.matmul_t(x, w, 4), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_row_kernels_compile_without_a_writable_cache_dir(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(blocker / "sub"))  # cannot be created
    monkeypatch.setattr(rowkernels, "_module", None)
    monkeypatch.setattr(rowkernels, "_failed", None)
    monkeypatch.setattr(rowkernels, "_kernels", {})
    x, w = torch.randn(2, 8), torch.randn(5, 8)
    torch.testing.assert_close(rowkernels.matmul_t(x, w, 1), F.linear(x, w), rtol=1e-5, atol=1e-5)
