"""numba kernels for GGUF block products on CPU: ``y = x @ W.T`` with ``W`` kept in its blocks.

Layout (built by :mod:`quant`).  Outputs are grouped in tiles of 64, inputs in GGUF's blocks of
32.  For tile ``t`` and block ``b``:

* Q4 (Q4_0 and Q4_1): ``q[t, b, k, j]`` (uint8, ``[tiles, blocks, 32, 32]``) holds input k of
  output j in its low nibble and of output j + 32 in its high one: 0.5 byte per weight, read
  as 32 contiguous bytes per input.  Scales ``d[t, b, j]`` and offsets ``m[t, b, j]`` are the
  file's float16 bits (uint16 ``[tiles, blocks, 64]``).  Q4_0's ``d * (q - 8)`` is stored as
  ``q`` with the offset ``m = -8 d``.
* Q8_0: ``q[t, b, k, j]`` (int8, ``[tiles, blocks, 32, 64]``) and ``d`` as above.

Each weight is computed as the file defines it, ``d * q + m`` with ``d * q`` exact in float32,
so it equals what ``gguf.dequantize`` (what transformers loads) gives, bit for bit.  Float16 is
widened by LLVM's ``fpext`` (one instruction where the CPU has F16C), also exact.

The products.  A tile's weights are dequantized once per group of up to four rows and kept in
registers; each row adds four inputs per pass, ``a + (x0 w0 + x1 w1 + x2 w2 + x3 w3)``.  The
kernels are compiled without reassociation, so the sums happen in that order: a row's result
is the same whatever the other rows are and however many there are (a verification of k + 1
tokens computes the very products of k + 1 one-token steps), and the same at any thread count
(threads split the tiles; one thread computes a tile).  Q4 rows go in groups of 4, then 2, then 1;
Q8_0 rows (the output head, which a verify of k + 1 <= 5 rows reads once) in groups of up to 5.
The compiled target calls these kernels through an opaque op (``quant.gguf_mm``) at run time, so
a change here needs no new AOTInductor package.
"""

from __future__ import annotations

import os

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

# numba's OpenMP layer leaves its threads spin-waiting between products, where torch's own OpenMP
# threads and other processes need the cores: under load, two-thread products took 2-5x longer
# than with the workqueue layer (threads that sleep).  A user's NUMBA_THREADING_LAYER wins.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"

TILE = 64
BLOCK = 32
# no "reassoc": sums in program order (what makes rows and thread counts independent); contract lets
# a * b + c become one fma, the same choice in every kernel
FASTMATH = {"contract", "nnan", "ninf", "nsz", "arcp"}
_opts = dict(fastmath=FASTMATH, nogil=True, boundscheck=False, cache=True)


@intrinsic
def _half(typingctx, h):  # pragma: no cover - compiled
    """float16 bits (uint16) -> float32, exactly (LLVM's fpext: vcvtph2ps where the CPU has F16C)."""
    if h != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(h), codegen


@njit(inline="always", **_opts)
def _widen(h, out):  # pragma: no cover - compiled
    for j in range(out.shape[0]):
        out[j] = _half(h[j])


@njit(inline="always", **_opts)
def _nib(byte, dl, ml, dh, mh):  # pragma: no cover - compiled
    # low nibble -> output j, high -> j + 32; in float, where the vectoriser keeps byte lanes wide
    f = np.float32(byte)
    h = np.floor(f * np.float32(0.0625))
    lo = f - np.float32(16.0) * h
    return dl * lo + ml, dh * h + mh


@njit(inline="always", **_opts)
def _add4(a, j, x0, x1, x2, x3, w0, w1, w2, w3):  # pragma: no cover - compiled
    a[j] = a[j] + (x0 * w0 + x1 * w1 + x2 * w2 + x3 * w3)


# --- Q4: rows r0.. of x into acc[r0..] for tile t; RB rows per call ------------------------------


@njit(**_opts)
def _q4_r1(x, q, d, m, acc, r0, t, dv, mv):  # pragma: no cover - compiled
    a = acc[r0]
    for b in range(q.shape[1]):
        _widen(d[t, b], dv)
        _widen(m[t, b], mv)
        for k in range(0, BLOCK, 4):
            kx = b * BLOCK + k
            q0, q1, q2, q3 = q[t, b, k], q[t, b, k + 1], q[t, b, k + 2], q[t, b, k + 3]
            x0, x1, x2, x3 = x[r0, kx], x[r0, kx + 1], x[r0, kx + 2], x[r0, kx + 3]
            for j in range(32):
                dl, ml, dh, mh = dv[j], mv[j], dv[j + 32], mv[j + 32]
                l0, h0 = _nib(q0[j], dl, ml, dh, mh)
                l1, h1 = _nib(q1[j], dl, ml, dh, mh)
                l2, h2 = _nib(q2[j], dl, ml, dh, mh)
                l3, h3 = _nib(q3[j], dl, ml, dh, mh)
                _add4(a, j, x0, x1, x2, x3, l0, l1, l2, l3)
                _add4(a, j + 32, x0, x1, x2, x3, h0, h1, h2, h3)


@njit(**_opts)
def _q4_r2(x, q, d, m, acc, r0, t, dv, mv):  # pragma: no cover - compiled
    a, c = acc[r0], acc[r0 + 1]
    for b in range(q.shape[1]):
        _widen(d[t, b], dv)
        _widen(m[t, b], mv)
        for k in range(0, BLOCK, 4):
            kx = b * BLOCK + k
            q0, q1, q2, q3 = q[t, b, k], q[t, b, k + 1], q[t, b, k + 2], q[t, b, k + 3]
            x0, x1, x2, x3 = x[r0, kx], x[r0, kx + 1], x[r0, kx + 2], x[r0, kx + 3]
            y0, y1, y2, y3 = x[r0 + 1, kx], x[r0 + 1, kx + 1], x[r0 + 1, kx + 2], x[r0 + 1, kx + 3]
            for j in range(32):
                dl, ml, dh, mh = dv[j], mv[j], dv[j + 32], mv[j + 32]
                l0, h0 = _nib(q0[j], dl, ml, dh, mh)
                l1, h1 = _nib(q1[j], dl, ml, dh, mh)
                l2, h2 = _nib(q2[j], dl, ml, dh, mh)
                l3, h3 = _nib(q3[j], dl, ml, dh, mh)
                _add4(a, j, x0, x1, x2, x3, l0, l1, l2, l3)
                _add4(a, j + 32, x0, x1, x2, x3, h0, h1, h2, h3)
                _add4(c, j, y0, y1, y2, y3, l0, l1, l2, l3)
                _add4(c, j + 32, y0, y1, y2, y3, h0, h1, h2, h3)


@njit(**_opts)
def _q4_r4(x, q, d, m, acc, r0, t, dv, mv):  # pragma: no cover - compiled
    a, c, e, g = acc[r0], acc[r0 + 1], acc[r0 + 2], acc[r0 + 3]
    for b in range(q.shape[1]):
        _widen(d[t, b], dv)
        _widen(m[t, b], mv)
        for k in range(0, BLOCK, 4):
            kx = b * BLOCK + k
            q0, q1, q2, q3 = q[t, b, k], q[t, b, k + 1], q[t, b, k + 2], q[t, b, k + 3]
            x0, x1, x2, x3 = x[r0, kx], x[r0, kx + 1], x[r0, kx + 2], x[r0, kx + 3]
            y0, y1, y2, y3 = x[r0 + 1, kx], x[r0 + 1, kx + 1], x[r0 + 1, kx + 2], x[r0 + 1, kx + 3]
            u0, u1, u2, u3 = x[r0 + 2, kx], x[r0 + 2, kx + 1], x[r0 + 2, kx + 2], x[r0 + 2, kx + 3]
            v0, v1, v2, v3 = x[r0 + 3, kx], x[r0 + 3, kx + 1], x[r0 + 3, kx + 2], x[r0 + 3, kx + 3]
            for j in range(32):
                dl, ml, dh, mh = dv[j], mv[j], dv[j + 32], mv[j + 32]
                l0, h0 = _nib(q0[j], dl, ml, dh, mh)
                l1, h1 = _nib(q1[j], dl, ml, dh, mh)
                l2, h2 = _nib(q2[j], dl, ml, dh, mh)
                l3, h3 = _nib(q3[j], dl, ml, dh, mh)
                _add4(a, j, x0, x1, x2, x3, l0, l1, l2, l3)
                _add4(a, j + 32, x0, x1, x2, x3, h0, h1, h2, h3)
                _add4(c, j, y0, y1, y2, y3, l0, l1, l2, l3)
                _add4(c, j + 32, y0, y1, y2, y3, h0, h1, h2, h3)
                _add4(e, j, u0, u1, u2, u3, l0, l1, l2, l3)
                _add4(e, j + 32, u0, u1, u2, u3, h0, h1, h2, h3)
                _add4(g, j, v0, v1, v2, v3, l0, l1, l2, l3)
                _add4(g, j + 32, v0, v1, v2, v3, h0, h1, h2, h3)


# --- Q8_0 ---------------------------------------------------------------------------------------


@njit(**_opts)
def _q8_r1(x, q, d, m, acc, r0, t, dv, mv):  # pragma: no cover - compiled
    a = acc[r0]
    for b in range(q.shape[1]):
        _widen(d[t, b], dv)
        for k in range(0, BLOCK, 4):
            kx = b * BLOCK + k
            q0, q1, q2, q3 = q[t, b, k], q[t, b, k + 1], q[t, b, k + 2], q[t, b, k + 3]
            x0, x1, x2, x3 = x[r0, kx], x[r0, kx + 1], x[r0, kx + 2], x[r0, kx + 3]
            for j in range(TILE):
                s = dv[j]
                _add4(a, j, x0, x1, x2, x3, s * np.float32(q0[j]), s * np.float32(q1[j]),
                      s * np.float32(q2[j]), s * np.float32(q3[j]))


@njit(**_opts)
def _q8_r2(x, q, d, m, acc, r0, t, dv, mv):  # pragma: no cover - compiled
    a, c = acc[r0], acc[r0 + 1]
    for b in range(q.shape[1]):
        _widen(d[t, b], dv)
        for k in range(0, BLOCK, 4):
            kx = b * BLOCK + k
            q0, q1, q2, q3 = q[t, b, k], q[t, b, k + 1], q[t, b, k + 2], q[t, b, k + 3]
            x0, x1, x2, x3 = x[r0, kx], x[r0, kx + 1], x[r0, kx + 2], x[r0, kx + 3]
            y0, y1, y2, y3 = x[r0 + 1, kx], x[r0 + 1, kx + 1], x[r0 + 1, kx + 2], x[r0 + 1, kx + 3]
            for j in range(TILE):
                s = dv[j]
                w0, w1, w2, w3 = s * np.float32(q0[j]), s * np.float32(q1[j]), s * np.float32(q2[j]), s * np.float32(q3[j])
                _add4(a, j, x0, x1, x2, x3, w0, w1, w2, w3)
                _add4(c, j, y0, y1, y2, y3, w0, w1, w2, w3)


@njit(**_opts)
def _q8_r3(x, q, d, m, acc, r0, t, dv, mv):  # pragma: no cover - compiled
    a, c, e = acc[r0], acc[r0 + 1], acc[r0 + 2]
    for b in range(q.shape[1]):
        _widen(d[t, b], dv)
        for k in range(0, BLOCK, 4):
            kx = b * BLOCK + k
            q0, q1, q2, q3 = q[t, b, k], q[t, b, k + 1], q[t, b, k + 2], q[t, b, k + 3]
            x0, x1, x2, x3 = x[r0, kx], x[r0, kx + 1], x[r0, kx + 2], x[r0, kx + 3]
            y0, y1, y2, y3 = x[r0 + 1, kx], x[r0 + 1, kx + 1], x[r0 + 1, kx + 2], x[r0 + 1, kx + 3]
            u0, u1, u2, u3 = x[r0 + 2, kx], x[r0 + 2, kx + 1], x[r0 + 2, kx + 2], x[r0 + 2, kx + 3]
            for j in range(TILE):
                s = dv[j]
                w0, w1, w2, w3 = s * np.float32(q0[j]), s * np.float32(q1[j]), s * np.float32(q2[j]), s * np.float32(q3[j])
                _add4(a, j, x0, x1, x2, x3, w0, w1, w2, w3)
                _add4(c, j, y0, y1, y2, y3, w0, w1, w2, w3)
                _add4(e, j, u0, u1, u2, u3, w0, w1, w2, w3)


@njit(**_opts)
def _q8_r4(x, q, d, m, acc, r0, t, dv, mv):  # pragma: no cover - compiled
    a, c, e, g = acc[r0], acc[r0 + 1], acc[r0 + 2], acc[r0 + 3]
    for b in range(q.shape[1]):
        _widen(d[t, b], dv)
        for k in range(0, BLOCK, 4):
            kx = b * BLOCK + k
            q0, q1, q2, q3 = q[t, b, k], q[t, b, k + 1], q[t, b, k + 2], q[t, b, k + 3]
            x0, x1, x2, x3 = x[r0, kx], x[r0, kx + 1], x[r0, kx + 2], x[r0, kx + 3]
            y0, y1, y2, y3 = x[r0 + 1, kx], x[r0 + 1, kx + 1], x[r0 + 1, kx + 2], x[r0 + 1, kx + 3]
            u0, u1, u2, u3 = x[r0 + 2, kx], x[r0 + 2, kx + 1], x[r0 + 2, kx + 2], x[r0 + 2, kx + 3]
            v0, v1, v2, v3 = x[r0 + 3, kx], x[r0 + 3, kx + 1], x[r0 + 3, kx + 2], x[r0 + 3, kx + 3]
            for j in range(TILE):
                s = dv[j]
                w0, w1, w2, w3 = s * np.float32(q0[j]), s * np.float32(q1[j]), s * np.float32(q2[j]), s * np.float32(q3[j])
                _add4(a, j, x0, x1, x2, x3, w0, w1, w2, w3)
                _add4(c, j, y0, y1, y2, y3, w0, w1, w2, w3)
                _add4(e, j, u0, u1, u2, u3, w0, w1, w2, w3)
                _add4(g, j, v0, v1, v2, v3, w0, w1, w2, w3)


@njit(**_opts)
def _q8_r5(x, q, d, m, acc, r0, t, dv, mv):  # pragma: no cover - compiled
    a, c, e, g, h = acc[r0], acc[r0 + 1], acc[r0 + 2], acc[r0 + 3], acc[r0 + 4]
    for b in range(q.shape[1]):
        _widen(d[t, b], dv)
        for k in range(0, BLOCK, 4):
            kx = b * BLOCK + k
            q0, q1, q2, q3 = q[t, b, k], q[t, b, k + 1], q[t, b, k + 2], q[t, b, k + 3]
            x0, x1, x2, x3 = x[r0, kx], x[r0, kx + 1], x[r0, kx + 2], x[r0, kx + 3]
            y0, y1, y2, y3 = x[r0 + 1, kx], x[r0 + 1, kx + 1], x[r0 + 1, kx + 2], x[r0 + 1, kx + 3]
            u0, u1, u2, u3 = x[r0 + 2, kx], x[r0 + 2, kx + 1], x[r0 + 2, kx + 2], x[r0 + 2, kx + 3]
            v0, v1, v2, v3 = x[r0 + 3, kx], x[r0 + 3, kx + 1], x[r0 + 3, kx + 2], x[r0 + 3, kx + 3]
            z0, z1, z2, z3 = x[r0 + 4, kx], x[r0 + 4, kx + 1], x[r0 + 4, kx + 2], x[r0 + 4, kx + 3]
            for j in range(TILE):
                s = dv[j]
                w0, w1, w2, w3 = s * np.float32(q0[j]), s * np.float32(q1[j]), s * np.float32(q2[j]), s * np.float32(q3[j])
                _add4(a, j, x0, x1, x2, x3, w0, w1, w2, w3)
                _add4(c, j, y0, y1, y2, y3, w0, w1, w2, w3)
                _add4(e, j, u0, u1, u2, u3, w0, w1, w2, w3)
                _add4(g, j, v0, v1, v2, v3, w0, w1, w2, w3)
                _add4(h, j, z0, z1, z2, z3, w0, w1, w2, w3)


# --- drivers: every tile, rows in groups (Q4: 4, 2, 1; Q8_0: up to 5) -----------------------------


@njit(inline="always", **_opts)
def _groups(rows, r0):  # pragma: no cover - compiled
    left = rows - r0
    return 4 if left >= 4 else 2 if left >= 2 else 1


@njit(inline="always", **_opts)
def _tile_q4(x, q, d, m, y, t):  # pragma: no cover - compiled
    rows = x.shape[0]
    acc = np.zeros((rows, TILE), np.float32)
    dv, mv = np.empty(TILE, np.float32), np.empty(TILE, np.float32)
    r0 = 0
    while r0 < rows:
        n = _groups(rows, r0)
        if n == 4:
            _q4_r4(x, q, d, m, acc, r0, t, dv, mv)
        elif n == 2:
            _q4_r2(x, q, d, m, acc, r0, t, dv, mv)
        else:
            _q4_r1(x, q, d, m, acc, r0, t, dv, mv)
        r0 += n
    y[:, t * TILE:(t + 1) * TILE] = acc


@njit(inline="always", **_opts)
def _tile_q8(x, q, d, y, t):  # pragma: no cover - compiled
    rows = x.shape[0]
    acc = np.zeros((rows, TILE), np.float32)
    dv = np.empty(TILE, np.float32)
    r0 = 0
    while r0 < rows:  # a verify of up to 5 rows in one pass over the weights
        n = min(rows - r0, 5)
        if n == 5:
            _q8_r5(x, q, d, d, acc, r0, t, dv, dv)
        elif n == 4:
            _q8_r4(x, q, d, d, acc, r0, t, dv, dv)
        elif n == 3:
            _q8_r3(x, q, d, d, acc, r0, t, dv, dv)
        elif n == 2:
            _q8_r2(x, q, d, d, acc, r0, t, dv, dv)
        else:
            _q8_r1(x, q, d, d, acc, r0, t, dv, dv)
        r0 += n
    y[:, t * TILE:(t + 1) * TILE] = acc


# y [R, tiles*64] = x [R, K] @ W.T.  Serial: one thread.  Parallel: tiles over numba's threads
# (numba.set_num_threads); a tile's arithmetic is the same code either way.


@njit(**_opts)
def q4_serial(x, q, d, m, y):  # pragma: no cover - compiled
    for t in range(q.shape[0]):
        _tile_q4(x, q, d, m, y, t)


@njit(parallel=True, **_opts)
def q4_parallel(x, q, d, m, y):  # pragma: no cover - compiled
    for t in prange(q.shape[0]):
        _tile_q4(x, q, d, m, y, t)


@njit(**_opts)
def q8_serial(x, q, d, y):  # pragma: no cover - compiled
    for t in range(q.shape[0]):
        _tile_q8(x, q, d, y, t)


@njit(parallel=True, **_opts)
def q8_parallel(x, q, d, y):  # pragma: no cover - compiled
    for t in prange(q.shape[0]):
        _tile_q8(x, q, d, y, t)

