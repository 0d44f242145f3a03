"""The few-row CPU Linear fast path: same products as F.linear, stale caches rebuilt, autograd untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ssd_chat.engine import fastlinear


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


def test_every_path_is_taken_and_agrees() -> None:
    """Row counts 1 (cached transpose), 2-5 (W @ x.T) and more (F.linear) on a tall matrix."""
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
