"""Row-invariant attention for CPU graphs, compiled by numba: ``out[t, h] = softmax(q[t, h] . K^T) V``
over the slots ``mask[t]`` allows.

A verify of k + 1 rows must compute the very numbers of k + 1 one-row steps, and a graph on two
threads those of one on one thread.  Here every query row is computed on its own, in an order that
depends on nothing but the row and the slots it may see: dot products and the softmax's sum in 8
lanes added in a fixed tree (:func:`_dot8`, LLVM vector code, because the loop vectoriser will not
reduce without reordering), masked slots as exact zeros (so a wider window adds nothing), and
``exp`` written out (Cephes' ``expf``), so a vector lane and a scalar tail compute alike.  Kernels
are compiled without reassociation (as in :mod:`qkernels`).

Inductor's broadcast form (``core.attend_rows``) is latency-bound on one accumulator per output:
on one thread, with a thousand tokens in the cache, it costs two to three times this.  This runs on
one thread, though, and inductor's on the graph's threads: on two threads it lost, so it is opted
into (``SSD_CHAT_ATTENTION=numba``, docs/performance-cpu.md).
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 8
# sums in program order (no reassoc) and no assumptions about infinities (the running max starts at
# -inf); contract lets a * b + c become one fma, the same choice in every kernel
_opts = dict(fastmath={"contract"}, nogil=True, boundscheck=False, cache=True)
_FLAGS = ("contract",)  # the same, for hand-written IR


def _vec_tree(builder: ir.IRBuilder, acc: ir.Value) -> ir.Value:
    """((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) of an <8 x float>."""
    i32 = ir.IntType(32)

    def half(x, n):
        lo = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(i32, n), list(range(n))))
        hi = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(i32, n), list(range(n, 2 * n))))
        return builder.fadd(lo, hi, flags=_FLAGS)

    x = half(half(acc, 4), 2)  # [a0+a4 + a2+a6, a1+a5 + a3+a7]
    return builder.fadd(builder.extract_element(x, ir.Constant(i32, 0)), builder.extract_element(x, ir.Constant(i32, 1)),
                        flags=_FLAGS)


@intrinsic
def _dot8(typingctx, q, k, n):  # pragma: no cover - compiled
    """sum(q[:n] * k[:n]) for the float32 arrays at addresses q and k, n a multiple of 8, in 8 lanes
    and a fixed tree."""
    if not all(isinstance(a, types.Integer) for a in (q, k, n)):
        return None

    def codegen(context, builder, sig, args):
        v8 = ir.VectorType(ir.FloatType(), LANES)
        vp = v8.as_pointer()
        fp = ir.FloatType().as_pointer()
        qp, kp, count = builder.inttoptr(args[0], fp), builder.inttoptr(args[1], fp), args[2]
        acc = cgutils.alloca_once_value(builder, ir.Constant(v8, [0.0] * LANES))
        chunks = builder.udiv(count, ir.Constant(count.type, LANES))
        with cgutils.for_range(builder, chunks) as loop:
            off = builder.mul(loop.index, ir.Constant(count.type, LANES))
            a = builder.load(builder.bitcast(builder.gep(qp, [off]), vp), align=4)
            b = builder.load(builder.bitcast(builder.gep(kp, [off]), vp), align=4)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(a, b, flags=_FLAGS), flags=_FLAGS), acc)
        return _vec_tree(builder, builder.load(acc))

    return types.float32(q, k, n), codegen


def _splat(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """An <8 x float> of the float ``x``."""
    v8, i32 = ir.VectorType(ir.FloatType(), LANES), ir.IntType(32)
    one = builder.insert_element(ir.Constant(v8, ir.Undefined), x, ir.Constant(i32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(i32, LANES), [0] * LANES))


def _weigh_pass(builder: ir.IRBuilder, ep, vbase, ap, count, dim, op, col, n: int, total) -> None:
    """out[col:col + 8n] = (sum over allowed slots w, in order, of e[w] * v[w, col:col + 8n]) / total:
    n vector accumulators kept in registers over the pass."""
    f32 = ir.FloatType()
    v8 = ir.VectorType(f32, LANES)
    i64 = count.type
    accs = [cgutils.alloca_once(builder, v8) for _ in range(n)]
    for a in accs:
        builder.store(ir.Constant(v8, [0.0] * LANES), a)
    with cgutils.for_range(builder, count) as slot:
        w = slot.index
        ok = builder.icmp_unsigned("!=", builder.load(builder.gep(ap, [w])), ir.Constant(ir.IntType(8), 0))
        with builder.if_then(ok, likely=True):
            splat = _splat(builder, builder.load(builder.gep(ep, [w])))
            row = builder.add(builder.mul(w, dim), col)
            for j, a in enumerate(accs):
                ptr = builder.bitcast(builder.gep(vbase, [builder.add(row, ir.Constant(i64, j * LANES))]), v8.as_pointer())
                x = builder.fmul(splat, builder.load(ptr, align=4), flags=_FLAGS)
                builder.store(builder.fadd(builder.load(a), x, flags=_FLAGS), a)
    splat = _splat(builder, total)
    for j, a in enumerate(accs):
        ptr = builder.bitcast(builder.gep(op, [builder.add(col, ir.Constant(i64, j * LANES))]), v8.as_pointer())
        builder.store(builder.fdiv(builder.load(a), splat, flags=_FLAGS), ptr, align=4)


@intrinsic
def _weigh(typingctx, e, v, allow, w_count, d, out, total):  # pragma: no cover - compiled
    """out[:d] = (sum over allowed slots w, in order, of e[w] * v[w, :d]) / total, for the float32
    arrays at the given addresses (v's rows d apart, d a multiple of 8; allow one byte a slot): 64
    outputs a pass over the slots in 8 vector accumulators, then 8 at a time."""
    if not all(isinstance(a, types.Integer) for a in (e, v, allow, w_count, d, out)) or total != types.float32:
        return None

    def codegen(context, builder, sig, args):
        fp, bp = ir.FloatType().as_pointer(), ir.IntType(8).as_pointer()
        ep, vbase, ap = builder.inttoptr(args[0], fp), builder.inttoptr(args[1], fp), builder.inttoptr(args[2], bp)
        count, dim, op, total = args[3], args[4], builder.inttoptr(args[5], fp), args[6]
        i64 = count.type
        wide = builder.udiv(dim, ir.Constant(i64, 8 * LANES))
        with cgutils.for_range(builder, wide) as blk:
            _weigh_pass(builder, ep, vbase, ap, count, dim, op, builder.mul(blk.index, ir.Constant(i64, 8 * LANES)), 8, total)
        done = builder.mul(wide, ir.Constant(i64, 8 * LANES))
        rest = builder.udiv(builder.sub(dim, done), ir.Constant(i64, LANES))
        with cgutils.for_range(builder, rest) as one:
            _weigh_pass(builder, ep, vbase, ap, count, dim, op, builder.add(done, builder.mul(one.index, ir.Constant(i64, LANES))), 1, total)
        return context.get_dummy_value()

    return types.none(e, v, allow, w_count, d, out, total), codegen


@intrinsic
def _byte(typingctx, addr):  # pragma: no cover - compiled
    """The byte at an address (a bool of the mask)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.zext(builder.load(builder.inttoptr(args[0], ir.IntType(8).as_pointer())), ir.IntType(64))

    return types.int64(addr), codegen


@njit(inline="always", **_opts)
def _exp(x):  # pragma: no cover - compiled
    """exp(x) for x <= 0 in float32 (Cephes' expf: 2**n times a polynomial of the remainder)."""
    x = max(x, np.float32(-87.0))
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = p * (r * r) + r + np.float32(1.0)
    return y * _pow2(np.int32(n))


@intrinsic
def _pow2(typingctx, n):  # pragma: no cover - compiled
    """2**n as float32 for an int32 n in [-126, 127], built in the exponent field."""
    if n != types.int32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        bits = builder.shl(builder.add(args[0], ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(n), codegen


@njit(inline="always", **_opts)
def _row(q, k, v, allow, W, D, scale, s, out):  # pragma: no cover - compiled
    """One query row at address ``q`` [D] against ``k``/``v`` [slots, D] over the ``W`` bytes of
    ``allow`` -> ``out`` [D] (addresses of float32 data); ``s`` (an array of W rounded up to 8) is
    scratch."""
    top = np.float32(-np.inf)
    for w in range(W):
        if _byte(allow + w):
            x = _dot8(q, k + 4 * D * w, D) * scale
            s[w] = x
            top = max(top, x)
    for w in range(W):
        s[w] = _exp(s[w] - top) if _byte(allow + w) else np.float32(0.0)
    for w in range(W, s.shape[0]):
        s[w] = np.float32(0.0)
    t0 = t1 = t2 = t3 = t4 = t5 = t6 = t7 = np.float32(0.0)
    for w in range(0, s.shape[0], LANES):
        t0, t1, t2, t3 = t0 + s[w], t1 + s[w + 1], t2 + s[w + 2], t3 + s[w + 3]
        t4, t5, t6, t7 = t4 + s[w + 4], t5 + s[w + 5], t6 + s[w + 6], t7 + s[w + 7]
    total = ((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 + t7))
    _weigh(s.ctypes.data, v, allow, W, D, out, total)


@njit(**_opts)
def _attend(q, k, v, allow, out, T, hq, hkv, D, C, W, scale):  # pragma: no cover - compiled
    s = np.empty((W + LANES - 1) // LANES * LANES, np.float32)
    for r in range(T * hq):
        t, h = r // hq, r % hq
        kv = 4 * D * C * (h // (hq // hkv))
        _row(q + 4 * D * r, k + kv, v + kv, allow + W * t, W, D, np.float32(scale), s, out + 4 * D * r)


def supported(head_dim: int) -> bool:
    return head_dim % LANES == 0


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` [T, Hq, D], ``k``/``v`` [Hkv, C, D] (a cache: slots past ``mask``'s width are not read),
    ``mask`` bool [T, W] -> [T, Hq, D], float32."""
    T, hq, D = q.shape
    hkv, C, _ = k.shape
    W = mask.shape[1]
    f32 = torch.float32
    if (W > C or v.shape != k.shape or mask.shape[0] != T or hq % hkv or D % LANES or q.dtype != f32 or k.dtype != f32
            or v.dtype != f32 or mask.dtype != torch.bool):
        raise ValueError(f"attend: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, mask {tuple(mask.shape)}")
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and mask.is_contiguous()):
        q, k, v, mask = q.contiguous(), k.contiguous(), v.contiguous(), mask.contiguous()
    out = torch.empty_like(q)
    _attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr(), out.data_ptr(), T, hq, hkv, D, C, W, scale)
    return out


_lib: torch.library.Library | None = None
_lock = threading.Lock()


def op() -> Callable[..., torch.Tensor]:
    """:func:`attend` as the opaque op ``ssd_chat::attend``, which a compiled graph (torch.compile or an
    AOTInductor package) calls at run time.  Registered with ``Library.impl``: a call from a package
    costs about 7 us, against about 22 for a ``custom_op`` (30 calls a forward)."""
    global _lib
    with _lock:
        if _lib is None:
            lib = torch.library.Library("ssd_chat", "FRAGMENT")
            lib.define("attend(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor")
            lib.impl("attend", attend, "CPU")
            lib.impl("attend", lambda q, k, v, mask, scale: q.new_empty(q.shape, dtype=torch.float32), "Meta")
            _lib = lib
    return torch.ops.ssd_chat.attend
