"""Faster few-row ``nn.Linear`` on CPU: decode steps, verification and draft trees.

Decoding multiplies every weight matrix by a handful of rows (1 for an AR step, k+1 for
a verification, a few tree nodes for the speculator).  PyTorch's CPU ``F.linear`` computes
``x @ W.T`` through MKL's GEMM with a transposed operand, and for 2-5 rows that path is two
to three times slower than one row: it reorganises the whole weight for every call.  The
same products computed the other way round are memory-bound, as they should be.  Measured
on this project's 2-core Zen 4 VM, one thread, the SmolLM2-135M linears of one forward
(30 layers + the 49152-row head):

    rows                 1      2      3      4      5      8
    F.linear           44.3   71.7   91.0   64.7   71.1   72.4  ms
    W @ x.T (then .T)  44.7   27.8   44.3   43.1   56.1   77.1  ms
    x @ W.T contiguous 32.9   48.1   60.2   65.5   74.7   80.3  ms

So: one row multiplies a cached contiguous transpose of the weight (``x @ Wt``); 2-5 rows
use ``(W @ x.T).T``, except for wide-input matrices (``in >= 1024`` and ``in >= 2 * out``,
the MLP's down projection) beyond two rows, where ``F.linear`` is as fast; everything else, and anything that needs
gradients, is plain ``F.linear``.  The results are the same products in a different
summation order, equal to ``F.linear`` up to float rounding (what GEMV vs GEMM already
differ by), so greedy exactness tests run through this path unchanged.

The transpose cache costs one extra copy of the linear weights; it is made lazily (on the
first one-row call), keyed on the weight's storage and version counter so an in-place
update (loading a trained draft, an optimizer step) rebuilds it, and it is skipped for
models whose linear weights exceed ``MAX_TRANSPOSE_BYTES``.  ``SSD_CHAT_FAST_LINEAR=0``
turns the whole thing off (for A/B measurements).
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MAX_TRANSPOSE_BYTES = 2 << 30  # 2 GiB of linear weights: a ~500M-parameter model in fp32
MAX_FAST_ROWS = 5
_DTYPES = (torch.float32,)


def enabled() -> bool:
    return os.environ.get("SSD_CHAT_FAST_LINEAR", "1").strip().lower() not in ("0", "false", "no", "off")


def cached_transpose(owner: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """The contiguous transpose of ``w``, kept on ``owner`` and rebuilt when ``w``'s storage
    or version counter changes (an in-place update, a copy loaded into it)."""
    key = (w.data_ptr(), w._version)
    if owner.__dict__.get("_ssd_t_key") != key:
        owner._ssd_t = w.detach().t().contiguous()
        owner._ssd_t_key = key
    return owner._ssd_t


def _transposed(self: nn.Linear) -> torch.Tensor | None:
    return cached_transpose(self, self.weight) if self._ssd_allow_t else None


def _wide_input(out_f: int, in_f: int) -> bool:
    """A down-projection-like matrix (long rows): from 3 rows on, F.linear is as fast as W @ x.T."""
    return in_f >= 1024 and in_f >= 2 * out_f


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, wt: Any = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` by the fastest formulation for the number of rows of ``x``.
    ``wt``: the contiguous transpose of ``w`` (or a callable returning it, or None), used for
    one row."""
    if (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)) or x.dtype != w.dtype or x.device != w.device \
            or w.device.type != "cpu":
        return F.linear(x, w, bias)
    out_f, in_f = w.shape
    rows = x.numel() // in_f if in_f else 0
    y = None
    if rows == 1:
        t = wt() if callable(wt) else wt
        if t is not None:
            y = torch.mm(x.reshape(1, in_f), t)
    elif 2 <= rows <= MAX_FAST_ROWS and (rows == 2 or not _wide_input(out_f, in_f)):
        y = torch.mm(w, x.reshape(rows, in_f).t()).t()
    if y is None:
        return F.linear(x, w, bias)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], out_f)


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias, lambda: _transposed(self))


def install(model: nn.Module) -> int:
    """Give every plain float32 CPU ``nn.Linear`` in ``model`` the few-row fast path.
    Returns how many layers were changed (0 when disabled, on GPU, or for other dtypes)."""
    if not enabled():
        return 0
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype in _DTYPES]
    if not linears:
        return 0
    seen: set[int] = set()
    total = 0
    for m in linears:
        if m.weight.data_ptr() not in seen:
            seen.add(m.weight.data_ptr())
            total += m.weight.numel() * m.weight.element_size()
    allow_t = total <= MAX_TRANSPOSE_BYTES
    n = 0
    for m in linears:
        if getattr(m, "_ssd_fast", False):
            continue
        m._ssd_fast = True
        m._ssd_allow_t = allow_t
        m._ssd_t = None
        m._ssd_t_key: Any = None
        m.forward = types.MethodType(_forward, m)
        n += 1
    return n


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install` (and drop the transpose caches)."""
    for m in model.modules():
        if getattr(m, "_ssd_fast", False):
            del m.forward
            for a in ("_ssd_fast", "_ssd_allow_t", "_ssd_t", "_ssd_t_key"):
                m.__dict__.pop(a, None)
