"""Attention for a few rows on CPU in which each row's result depends only on that row.

torch's scaled_dot_product_attention blocks its work by the number of query rows, so a row of a
3-row call can differ in the last bits from the same row computed alone.  With products that
are row-independent too (:mod:`qkernels`), this makes a whole core forward of k + 1 rows
compute, bit for bit, what k + 1 one-row forwards compute: a verification then agrees with AR
decoding by construction, not only up to rounding.

Each (row, query head) visits the slots its mask row allows in increasing order: a score is one
dot product over the head dimension (the same compiled code for every row), the maximum, the
sum of exponentials and the weighted sum of values are accumulated in slot order.  Slots the
mask excludes are skipped, not added as zeros, so a row sees the same operations whatever the
mask width.  K and V of a head are read once for all rows.  Threads (when torch runs several)
split the KV heads; a head is computed by one thread, the same code either way.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

MAX_ROWS = 16  # more rows (a prompt): SDPA, which is much faster for long blocks of queries
_opts = dict(nogil=True, boundscheck=False, cache=True)


@njit(fastmath=True, **_opts)
def _dot(a, b):  # pragma: no cover - compiled; its own function: vectorised (reassociated) here only, the same code for every score
    s = np.float32(0.0)
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


@njit(fastmath={"contract", "nsz", "arcp"}, inline="always", **_opts)
def _head(q, k, v, mask, scale, out, h, groups, s, m, tot):  # pragma: no cover - compiled
    # q [T, Hq, D], k/v [Hkv, C, D], mask [T, W], out [T, Hq, D]; s [T*groups, W] scratch
    rows, width = mask.shape[0], mask.shape[1]
    n = rows * groups
    for j in range(n):
        m[j] = -np.inf
        tot[j] = np.float32(0.0)
    for w in range(width):
        kw = k[h, w]
        for r in range(rows):
            if mask[r, w]:
                for g in range(groups):
                    j = r * groups + g
                    sc = _dot(q[r, h * groups + g], kw) * scale
                    s[j, w] = sc
                    if sc > m[j]:
                        m[j] = sc
    for r in range(rows):
        for g in range(groups):
            j = r * groups + g
            o = out[r, h * groups + g]
            o[:] = 0
            for w in range(width):
                if mask[r, w]:
                    e = np.float32(np.exp(s[j, w] - m[j]))
                    tot[j] += e
                    vw = v[h, w]
                    for i in range(o.shape[0]):
                        o[i] += e * vw[i]
            inv = np.float32(1.0) / tot[j]
            for i in range(o.shape[0]):
                o[i] *= inv


@njit(**_opts)
def _attend_serial(q, k, v, mask, scale, out):  # pragma: no cover - compiled
    groups = q.shape[1] // k.shape[0]
    n = mask.shape[0] * groups
    s = np.empty((n, mask.shape[1]), np.float32)
    m, tot = np.empty(n, np.float32), np.empty(n, np.float32)
    for h in range(k.shape[0]):
        _head(q, k, v, mask, scale, out, h, groups, s, m, tot)


@njit(parallel=True, **_opts)
def _attend_parallel(q, k, v, mask, scale, out):  # pragma: no cover - compiled
    groups = q.shape[1] // k.shape[0]
    n = mask.shape[0] * groups
    for h in prange(k.shape[0]):
        s = np.empty((n, mask.shape[1]), np.float32)
        m, tot = np.empty(n, np.float32), np.empty(n, np.float32)
        _head(q, k, v, mask, scale, out, h, groups, s, m, tot)


def usable(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`attend` serves this call (CPU, float32, a few rows, not inside a compiled graph)."""
    return (q.shape[0] <= MAX_ROWS and q.device.type == "cpu" and q.dtype == torch.float32 and k.dtype == torch.float32
            and not torch.compiler.is_compiling())


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` [T, Hq, D], caches ``k``/``v`` [Hkv, C, D] (C >= W), ``mask`` bool [T, W] -> [T, Hq, D]:
    softmax(q k^T * scale) v over the allowed slots, query head h reading KV head h // (Hq / Hkv).
    Every row must allow at least one slot."""
    out = torch.empty(q.shape, dtype=torch.float32)
    args = (q.contiguous().numpy(), k.numpy(), v.numpy(), mask.contiguous().numpy(), np.float32(scale), out.numpy())
    from .quant import _threads  # numba's thread count, set by the products of the same forward

    threads = min(torch.get_num_threads(), k.shape[0])
    if threads > 1:
        import numba

        if _threads[0] != threads:
            numba.set_num_threads(threads)
            _threads[0] = threads
        _attend_parallel(*args)
    else:
        _attend_serial(*args)
    return out
