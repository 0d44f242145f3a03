"""The numba attention of CPU graphs (engine/cpu/attend.py, ``SSD_CHAT_ATTENTION=numba``): it is attention,
and a row's result depends on nothing but that row: not on the other rows of a verify, on a window padded
wider, or on the thread count.  That is what lets greedy SD and SSD equal AR token for token on the
compiled CPU core (the compiled core itself: tests/test_int4.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ssd_chat.engine.cpu import attend
from ssd_chat.engine.model.core import attend_op, attend_rows


def _inputs(hkv: int, hq: int, d: int, slots: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, hq, d, generator=g)
    k, v = torch.randn(hkv, slots, d, generator=g), torch.randn(hkv, slots, d, generator=g)
    return q, k, v


def _reference(q, k, v, mask, scale):
    rows, hq, d = q.shape
    hkv, W = k.shape[0], mask.shape[1]
    qf = q.transpose(0, 1).reshape(hkv, hq // hkv, rows, d)
    o = F.scaled_dot_product_attention(qf.double(), k[:, None, :W].double(), v[:, None, :W].double(),
                                       attn_mask=mask[None].expand(hkv, hq // hkv, rows, W), scale=scale)
    return o.reshape(hq, rows, d).transpose(0, 1).float()


@pytest.mark.parametrize("hkv,hq,d", [(3, 9, 64), (2, 6, 16), (2, 4, 72), (1, 2, 128), (2, 2, 8)])
def test_it_is_attention_over_the_allowed_slots(hkv, hq, d):
    q, k, v = _inputs(hkv, hq, d, slots=120, rows=3)
    mask = torch.zeros(3, 100, dtype=torch.bool)
    for i in range(3):
        mask[i, :96 + i] = True
    mask[1, 7] = False  # a hole, as a tree mask has
    got = attend.attend(q, k, v, mask, 0.125)
    assert torch.allclose(got, _reference(q, k, v, mask, 0.125), atol=2e-6)
    assert torch.allclose(got, attend_rows(q, k[:, :100], v[:, :100], mask, 0.125), atol=2e-6)


def test_slots_past_the_window_are_never_read():
    q, k, v = _inputs(2, 4, 16, slots=64, rows=2)
    mask = torch.ones(2, 20, dtype=torch.bool)
    before = attend.attend(q, k, v, mask, 0.25)
    k[:, 20:], v[:, 20:] = float("nan"), float("inf")
    assert torch.equal(attend.attend(q, k, v, mask, 0.25), before)


@pytest.mark.parametrize("d", [64, 16])
def test_a_row_is_the_same_alone_in_a_verify_in_a_wider_window_and_on_two_threads(d):
    """Every row of a 3-row verify at positions p..p+2 equals the one-row step at its position, bit for
    bit, whatever the padding of the window (crossing the 16-slot steps) and the thread count."""
    threads = torch.get_num_threads()
    q, k, v = _inputs(3, 9, d, slots=1200, rows=3, seed=d)
    differ = 0
    try:
        for p in (5, 14, 15, 16, 250, 253, 254, 255, 256, 700, 1000, 1040):
            steps = {}
            for th in (1, 2):
                torch.set_num_threads(th)
                for pad in (0, 16, 48):
                    W = (p + 3 + 15) // 16 * 16 + pad
                    mask = torch.zeros(3, W, dtype=torch.bool)
                    for i in range(3):
                        mask[i, :p + 1 + i] = True
                    verify = attend.attend(q, k, v, mask, 0.125)
                    for i in range(3):
                        one = attend.attend(q[i:i + 1], k, v, mask[i:i + 1, :(p + 1 + i + 15) // 16 * 16], 0.125)
                        steps.setdefault(i, one)
                        differ += not torch.equal(verify[i:i + 1], one)
                        differ += not torch.equal(steps[i], one)
    finally:
        torch.set_num_threads(threads)
    assert differ == 0


def test_a_compiled_graph_calls_it_and_computes_the_same_numbers(monkeypatch):
    assert attend_op(16, torch.float32) is None  # not the default (inductor's attention)
    monkeypatch.setenv("SSD_CHAT_ATTENTION", "numba")
    op = attend_op(16, torch.float32)
    assert op is not None and attend_op(16, torch.bfloat16) is None and attend_op(12, torch.float32) is None
    q, k, v = _inputs(2, 4, 16, slots=64, rows=3)
    mask = torch.ones(3, 48, dtype=torch.bool)
    graph = torch.compile(lambda q, k, v, mask: op(q, k, v, mask, 0.25) * 2, dynamic=False, fullgraph=True)
    assert torch.equal(graph(q, k, v, mask), attend.attend(q, k, v, mask, 0.25) * 2)
