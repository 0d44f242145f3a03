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
use ``(W @ x.T).T`` (copied back to row-major: the transposed view, handed on to the residual
add, the norm and the next layer, cost a 2-3-row forward more than the copy), except for wide-input matrices (``in >= 1024`` and ``in >= 2 * out``,
the MLP's down projection) beyond two rows, where ``F.linear`` is as fast; everything else, and anything that needs
gradients, is plain ``F.linear``.  The results are the same products in a different
summation order, equal to ``F.linear`` up to float rounding (what GEMV vs GEMM already
differ by), so greedy exactness tests run through this path unchanged.

The transpose cache costs one extra copy of the linear weights; it is made lazily (on the
first one-row call), keyed on the weight's storage and version counter so an in-place
update (loading a trained draft, an optimizer step) rebuilds it, and it is skipped for
models whose linear weights exceed ``MAX_TRANSPOSE_BYTES``.

**The rule above is one CPU's.**  On a Zen 2 EPYC the same rule made 2-3-row forwards up to
35 % slower than plain ``F.linear``.  So :func:`install` times the three formulations on the
model's own weights for every (shape, rows) it has, 1 to ``MAX_FAST_ROWS`` rows, and keeps
the fastest (:func:`tune`): each timing cycles through up to ``TUNE_BYTES`` of that shape's
matrices, so the weights stream from memory as in a real forward rather than sitting in
cache.  That takes a few seconds once; the choices are kept in ``fastlinear.json`` in the
cache dir, keyed by CPU model, torch version, thread count and transpose permission, and
reused by every later load (the app, the speculator process, the draft).

**Row kernels.**  Since 2026-12-02 the candidates also include two numba kernels
(``engine/rowkernels.py``) that read each weight once for all 1-8 rows; on the Zen 2 VM they
win almost everywhere beyond one row.  Choices are kept per torch thread count, and
:func:`prepare` times (or reads back) the ones for the count decoding actually runs with: the
app loads its models with every core and decodes pinned to fewer (SSD), where at 2 threads
MKL's products use both cores and the kernels one.

``SSD_CHAT_FAST_LINEAR``: ``0`` turns the whole thing off, ``static`` uses the Zen 4 rule
without timing, ``torch`` times torch's three products only (no row kernels; all three for
A/B measurements), ``retune`` times again and overwrites the stored choices.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
import types
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import rowkernels

MAX_TRANSPOSE_BYTES = 2 << 30  # 2 GiB of linear weights: a ~500M-parameter model in fp32
MAX_FAST_ROWS = rowkernels.MAX_ROWS  # rows timed and served (1..8)
STATIC_MAX_ROWS = 5  # the Zen 4 rule was measured up to 5 rows
TUNE_BYTES = 64 << 20  # matrices of one shape cycled through per timing: more than a CPU's last-level cache
TUNE_REPEATS = 3  # timed passes per (shape, rows, formulation); the fastest counts
METHODS = ("linear", "wxt", "xwt", "rows", "rows4")  # F.linear; (W @ x.T).T; x @ Wt with the cached transpose;
# the numba row kernels (engine/rowkernels.py), one or four outputs per pass over x
_KERNEL_BLOCK = {"rows": 1, "rows4": 4}  # row-kernel method -> outputs per pass
_DTYPES = (torch.float32,)
_choices: dict[tuple[int, int, int, int], str] = {}  # (threads, out, in, rows) -> the method measured fastest on this CPU
_retuned: set[tuple[int, int, int]] = set()  # (threads, out, in) timed again in this process under SSD_CHAT_FAST_LINEAR=retune
_installed: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models install() changed: prepare() times their shapes


def _mode() -> str:
    return os.environ.get("SSD_CHAT_FAST_LINEAR", "1").strip().lower()


def enabled() -> bool:
    return _mode() not in ("0", "false", "no", "off")


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


def static_choice(out_f: int, in_f: int, rows: int) -> str:
    """The rule measured on the Zen 4 VM (the module docstring's table), used where nothing was timed."""
    if rows == 1:
        return "xwt"
    if 2 <= rows <= STATIC_MAX_ROWS and (rows == 2 or not _wide_input(out_f, in_f)):
        return "wxt"
    return "linear"


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, wt: Any = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` by the fastest formulation for the number of rows of ``x``.
    ``wt``: the contiguous transpose of ``w`` (or a callable returning it, or None), used for
    one row."""
    if (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)) or x.dtype != w.dtype or x.device != w.device \
            or w.device.type != "cpu":
        return F.linear(x, w, bias)
    out_f, in_f = w.shape
    rows = x.numel() // in_f if in_f else 0
    method = _choices.get((torch.get_num_threads(), out_f, in_f, rows)) or static_choice(out_f, in_f, rows)
    t = (wt() if callable(wt) else wt) if method == "xwt" else None
    if method == "linear" or (method == "xwt" and t is None) or not _runnable(method, w):
        return F.linear(x, w, bias)
    y = _run(method, x.reshape(rows, in_f), w, t)  # the same products tune() timed
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], out_f)


_row_op: Any = None


def row_op() -> Any:
    """The row kernels as a torch custom op, ``ssd_chat::row_matmul(x, w, block)`` = x @ w.T: opaque to
    torch.compile, so a compiled graph calls the same kernels as the eager fast path."""
    global _row_op
    if _row_op is None:
        @torch.library.custom_op("ssd_chat::row_matmul", mutates_args=())
        def row_matmul(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
            return rowkernels.matmul_t(x, w, block)

        @row_matmul.register_fake
        def _(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
            return x.new_empty(x.shape[0], w.shape[0])

        _row_op = row_matmul
    return _row_op


def traceable(m: nn.Linear, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``m`` for ``rows`` [rows, in] inputs as a compiled graph can call it: the formulation the stored
    timings chose (the row kernels through :func:`row_op`), else the static rule.  ``xwt`` reads the
    transpose cache the eager fast path keeps (taken now: a later in-place weight update needs a new graph)."""
    w, b = m.weight, m.bias
    out_f, in_f = w.shape
    method = _choices.get((torch.get_num_threads(), out_f, in_f, rows)) or static_choice(out_f, in_f, rows)
    if method in _KERNEL_BLOCK and _runnable(method, w) and rows <= MAX_FAST_ROWS:
        op, block = row_op(), _KERNEL_BLOCK[method]
        return (lambda x: op(x, w, block)) if b is None else (lambda x: op(x, w, block) + b)
    if method not in ("linear", "wxt", "xwt"):
        method = static_choice(out_f, in_f, rows)
    if method == "xwt" and getattr(m, "_ssd_allow_t", False):
        wt = cached_transpose(m, w)
        return (lambda x: torch.mm(x, wt)) if b is None else (lambda x: torch.mm(x, wt) + b)
    if method == "wxt":
        return (lambda x: torch.mm(w, x.t()).t()) if b is None else (lambda x: torch.mm(w, x.t()).t() + b)
    return lambda x: F.linear(x, w, b)


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias, lambda: _transposed(self))


def install(model: nn.Module, announce: Callable[[], None] | None = None,
            tuned: Callable[[float], None] | None = None) -> int:
    """Give every plain float32 CPU ``nn.Linear`` in ``model`` the few-row fast path, with the
    formulation per (shape, rows) timed on this CPU (:func:`stored_or_tuned`) for those and for
    the weights a module lists in ``fast_linear_weights`` (a trained draft's reduced head, which
    calls :func:`linear` itself).  ``announce`` is called once before any timing (the first load
    on a machine: seconds, including compiling the row kernels), so a caller can say why it waits;
    ``tuned(fraction)`` then hears how far the timing is.  Returns how many layers were changed (0 when disabled, on GPU, or for other dtypes)."""
    if not enabled():
        return 0
    linears = _plain_linears(model)
    if not linears:
        return 0
    seen: set[int] = set()
    total = 0
    for m in linears:
        if m.weight.data_ptr() not in seen:
            seen.add(m.weight.data_ptr())
            total += m.weight.numel() * m.weight.element_size()
    allow_t = total <= MAX_TRANSPOSE_BYTES
    model._ssd_fast_allow_t = allow_t
    _installed.add(model)
    _prepare_model(model, announce, tuned)
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


def _plain_linears(model: nn.Module) -> list[nn.Linear]:
    """The plain float32 CPU ``nn.Linear`` modules of ``model``: those the fast path serves."""
    return [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype in _DTYPES]


def _weights_by_shape(model: nn.Module) -> dict[tuple[int, int], list[torch.Tensor]]:
    by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
    own = [getattr(m, n) for m in model.modules() for n in getattr(type(m), "fast_linear_weights", ())]
    for w in [m.weight for m in _plain_linears(model)] + [w for w in own if w.device.type == "cpu" and w.dtype in _DTYPES]:
        by_shape.setdefault(tuple(w.shape), []).append(w)  # type: ignore[arg-type]
    return by_shape


def _prepare_model(model: nn.Module, announce: Callable[[], None] | None = None,
                   tuned: Callable[[float], None] | None = None) -> None:
    if _mode() == "static":
        return
    threads = torch.get_num_threads()
    retune = _mode() == "retune"  # once per process, thread count and shape
    all_shapes = _weights_by_shape(model)
    by_shape = {s: ws for s, ws in all_shapes.items()
                if any((threads, *s, r) not in _choices for r in range(1, MAX_FAST_ROWS + 1))
                or (retune and (threads, *s) not in _retuned)}
    if by_shape:
        _choices.update({(threads, *k): m for k, m in stored_or_tuned(by_shape, model._ssd_fast_allow_t, announce, tuned).items()})
        if retune:
            _retuned.update((threads, *s) for s in by_shape)
    # the row kernels these choices name, loaded now rather than inside the first reply (~0.3 s)
    rowkernels.warm({(r, _KERNEL_BLOCK[m]) for (t, o, i, r), m in _choices.items()
                     if t == threads and m in _KERNEL_BLOCK and (o, i) in all_shapes})


def prepare() -> None:
    """Make sure every installed model has choices for torch's current thread count: call it
    after changing the thread count for decoding (the choices differ: at 2 threads MKL's
    products use both cores, the row kernels one).  Stored choices are read back; shapes never
    timed with this thread count are timed now.  Cheap when nothing is missing."""
    if not enabled():
        return
    for model in list(_installed):
        _prepare_model(model)


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install` (and drop the transpose caches)."""
    _installed.discard(model)
    for m in model.modules():
        if getattr(m, "_ssd_fast", False):
            del m.forward
            for a in ("_ssd_fast", "_ssd_allow_t", "_ssd_t", "_ssd_t_key"):
                m.__dict__.pop(a, None)


# --- choosing the formulation by timing it on this CPU ---------------------------------------------


def methods(allow_t: bool) -> list[str]:
    """The formulations this process can run: ``xwt`` needs the transpose cache, the row kernels numba."""
    kernels = _mode() != "torch" and rowkernels.available()
    return [m for m in METHODS if (allow_t or m != "xwt") and (m not in _KERNEL_BLOCK or kernels)]


def _runnable(method: str, w: torch.Tensor) -> bool:
    """Per call, so cheap: a row kernel needs a contiguous weight (and numba, loaded once)."""
    if method in _KERNEL_BLOCK:
        return w.is_contiguous() and rowkernels.available()
    return True


def _run(method: str, x: torch.Tensor, w: torch.Tensor, wt: torch.Tensor | None) -> torch.Tensor:
    if method in _KERNEL_BLOCK:
        return rowkernels.matmul_t(x, w, _KERNEL_BLOCK[method])
    if method == "xwt":
        return torch.mm(x, wt)  # type: ignore[arg-type]
    if method == "wxt":
        return torch.mm(w, x.t()).t().contiguous()
    return F.linear(x, w)


@torch.inference_mode()
def tune(weights: list[torch.Tensor], allow_t: bool, rows: range = range(1, MAX_FAST_ROWS + 1),
         clock: Any = time.perf_counter) -> dict[int, str]:
    """The fastest formulation for each row count, timed on these same-shape matrices: each pass
    multiplies every one of them (up to ``TUNE_BYTES``), so they stream from memory."""
    out_f, in_f = weights[0].shape
    per = weights[0].numel() * weights[0].element_size()
    ws = [w.detach() for w in weights[: max(1, min(len(weights), TUNE_BYTES // max(per, 1)))]]
    wts = [w.t().contiguous() for w in ws] if allow_t else []
    ms = [m for m in methods(allow_t) if _runnable(m, ws[0])]
    best: dict[int, str] = {}
    gen = torch.Generator().manual_seed(out_f * 131 + in_f)
    for r in rows:
        x = torch.randn(r, in_f, generator=gen, dtype=ws[0].dtype)
        times: dict[str, float] = {}
        for m in ms:
            for w, t in zip(ws, wts or [None] * len(ws)):  # warm-up (and the transposes' first touch)
                _run(m, x, w, t)
            fastest = float("inf")
            for _ in range(TUNE_REPEATS):
                t0 = clock()
                for w, t in zip(ws, wts or [None] * len(ws)):
                    _run(m, x, w, t)
                fastest = min(fastest, clock() - t0)
            times[m] = fastest
        best[r] = min(ms, key=lambda m: (times[m], METHODS.index(m)))
    return best


def _machine_key(allow_t: bool) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ident = [cpu, torch.__version__, torch.get_num_threads(), allow_t, MAX_FAST_ROWS, methods(allow_t), "v2"]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


def _store() -> Path:
    from .models import cache_dir  # models imports this module

    return cache_dir() / "fastlinear.json"


def stored_or_tuned(by_shape: dict[tuple[int, int], list[torch.Tensor]], allow_t: bool,
                    announce: Callable[[], None] | None = None,
                    tuned: Callable[[float], None] | None = None) -> dict[tuple[int, int, int], str]:
    """Choices for every shape in ``by_shape`` on this machine: from the store when timed before,
    otherwise timed now (:func:`tune`, after one call of ``announce``) and added to the store.
    A missing, unreadable or corrupt store only means timing again."""
    key = _machine_key(allow_t)
    path = _store()
    try:
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict):
            stored = {}
    except (OSError, ValueError):
        stored = {}
    mine = stored.get(key) if isinstance(stored.get(key), dict) else {}
    retune = _mode() == "retune"
    out: dict[tuple[int, int, int], str] = {}
    changed = False
    def valid(got: Any) -> bool:
        return isinstance(got, dict) and all(got.get(str(r)) in METHODS for r in range(1, MAX_FAST_ROWS + 1))

    todo = sum(1 for o, i in by_shape if retune or not valid(mine.get(f"{o}x{i}")))
    n_tuned = 0
    for (out_f, in_f), ws in by_shape.items():
        name = f"{out_f}x{in_f}"
        got = mine.get(name)
        if retune or not valid(got):
            if announce is not None and not changed:
                announce()
            if tuned is not None:
                tuned(n_tuned / todo)
            got = {str(r): m for r, m in tune(ws, allow_t).items()}
            n_tuned += 1
            mine[name] = got
            changed = True
        out.update({(out_f, in_f, int(r)): m for r, m in got.items()})  # type: ignore[union-attr]
    if changed and tuned is not None:
        tuned(1.0)
    if changed:
        stored[key] = mine
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache dir: keep the choices for this process only
    return out
