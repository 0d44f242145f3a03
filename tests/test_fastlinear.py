"""The few-row CPU Linear fast path: same products as F.linear, stale caches rebuilt, autograd untouched;
the formulation per (shape, rows) chosen by timing on this CPU, stored and reused."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ssd_chat.engine import fastlinear


@pytest.fixture(autouse=True)
def _own_choices(tmp_path, monkeypatch):
    """Each test times (or not) into its own store and choice table."""
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fastlinear, "_choices", {})


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


@pytest.mark.parametrize("method", fastlinear.METHODS)
def test_each_chosen_formulation_is_used_and_agrees(method: str) -> None:
    m = _linear(32, 96, True)
    w, b = m.weight.detach().clone(), m.bias.detach().clone()
    fastlinear.install(m)
    fastlinear._choices.update({(96, 32, r): method for r in range(1, fastlinear.MAX_FAST_ROWS + 1)})
    with torch.inference_mode():
        for rows in range(1, 9):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(m(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert (m._ssd_t is not None) == (method == "xwt")  # the transpose copy exists only when it is used


def test_choices_are_timed_once_stored_and_reused(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    tune = fastlinear.tune

    def counted(ws, allow_t, *a, **kw):
        calls.append(tuple(ws[0].shape))
        return tune(ws, allow_t, *a, **kw)

    monkeypatch.setattr(fastlinear, "tune", counted)
    model = nn.Sequential(_linear(16, 40, False), _linear(40, 16, False), _linear(16, 40, True))
    fastlinear.install(model)
    assert sorted(calls) == [(16, 40), (40, 16)]  # one timing per shape, not per layer
    store = json.loads((tmp_path / "cache" / "fastlinear.json").read_text())
    (mine,) = store.values()
    assert set(mine) == {"40x16", "16x40"}
    assert all(set(v) == {"1", "2", "3", "4", "5"} and set(v.values()) <= set(fastlinear.METHODS) for v in mine.values())
    assert fastlinear._choices[(40, 16, 3)] == mine["40x16"]["3"]
    calls.clear()
    fastlinear._choices.clear()
    fastlinear.install(nn.Sequential(_linear(16, 40, False)))  # a later load (another process): read back, not timed
    assert calls == [] and fastlinear._choices[(40, 16, 1)] == mine["40x16"]["1"]
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
    assert fastlinear._choices[(40, 16, 1)] in fastlinear.METHODS


def test_weights_a_module_names_are_timed_too(tmp_path) -> None:
    class Head(nn.Module):
        fast_linear_weights = ("rows",)

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("rows", torch.randn(50, 16))
            self.proj = nn.Linear(16, 16)

    fastlinear.install(Head())
    assert {(50, 16, r) for r in range(1, fastlinear.MAX_FAST_ROWS + 1)} <= set(fastlinear._choices)
    (mine,) = json.loads((tmp_path / "cache" / "fastlinear.json").read_text()).values()
    assert set(mine) == {"16x16", "50x16"}
