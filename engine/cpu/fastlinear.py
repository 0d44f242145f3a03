"""Faster few-row ``nn.Linear`` on CPU: decode steps, verification and draft trees.

Decoding multiplies every weight matrix by a handful of rows.  PyTorch's CPU ``F.linear`` goes
through MKL's GEMM with a transposed operand, and for 2-5 rows that path can be two to three times
slower than one row: it reorganises the whole weight for every call.  The same products computed
another way are memory-bound, as they should be: ``wxt`` ``(W @ x.T).T``, ``xwt`` ``x @ Wt`` with a
cached transpose, and ``rows`` / ``rows4``, the numba kernels of :mod:`rowkernels`.

Which one is fastest depends on the CPU, the shape, the row count and torch's thread count (one
CPU's rule made another's 2-3-row forwards 35 % slower), so a :class:`FastPath` times them on the
model's own weights, once per machine, and keeps the choices in ``fastlinear.json`` in the cache
dir.  All are the same products in a different summation order: results equal ``F.linear`` up to
float rounding, what GEMV and GEMM already differ by.

:meth:`FastPath.install` replaces each plain float32 CPU ``nn.Linear`` by a :class:`FastLinear`
(the same weight and bias, so tied and shared weights stay shared), and :meth:`FastPath.prepare`
times (or reads back) the choices for a thread count.  One path serves a process (:func:`shared`).
``SSD_CHAT_FAST_LINEAR=0`` turns it off, ``=torch`` keeps to torch's products (A/B runs).
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import store as fastlinear_store, rowkernels

MAX_TRANSPOSE_BYTES = 2 << 30  # linear weights above this (a ~500M-parameter fp32 model) get no transpose copy
MAX_FAST_ROWS = rowkernels.MAX_ROWS  # rows timed and served (1..8)
STATIC_MAX_ROWS = 5  # the rule used where nothing was timed was measured up to 5 rows
TUNE_BYTES = 64 << 20  # matrices of one shape cycled through per timing: more than a CPU's last-level cache
TUNE_REPEATS = 3  # timed passes per (shape, rows, formulation); the fastest counts
METHODS = ("linear", "wxt", "xwt", "rows", "rows4")
KERNEL_BLOCK = {"rows": 1, "rows4": 4}  # row-kernel method -> outputs per pass
Key = tuple[int, int, int, int]  # (threads, out, in, rows)


def mode() -> str:
    """``SSD_CHAT_FAST_LINEAR``: ``1`` (default), ``torch`` (no row kernels) or ``0`` (off)."""
    return os.environ.get("SSD_CHAT_FAST_LINEAR", "1").strip().lower()


def enabled() -> bool:
    return mode() not in ("0", "false", "no", "off")


def static_choice(out_f: int, in_f: int, rows: int) -> str:
    """The rule used where nothing was timed (measured on one Zen 4 CPU): the transpose for one row,
    ``W @ x.T`` for 2-5 rows except long-row matrices (the MLP's down projection) beyond two."""
    if rows == 1:
        return "xwt"
    wide = in_f >= 1024 and in_f >= 2 * out_f
    if 2 <= rows <= STATIC_MAX_ROWS and (rows == 2 or not wide):
        return "wxt"
    return "linear"


class FastLinear(nn.Linear):
    """An ``nn.Linear`` computed by the formulation its :class:`FastPath` timed fastest for the
    number of rows.  Shares the weight and bias of the Linear it replaced."""

    def __init__(self, linear: nn.Linear, path: "FastPath", allow_t: bool) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        if linear.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = linear.bias
        self.path = path
        self.allow_t = allow_t  # whether the transpose copy may be kept (memory)
        self._t: torch.Tensor | None = None
        self._t_key: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.path.linear(x, self.weight, self.bias, self.transposed)

    def transposed(self) -> torch.Tensor | None:
        """The contiguous transpose of the weight, rebuilt when the weight's storage or version
        changes (an in-place update, a trained draft's weights copied in); None if not allowed."""
        if not self.allow_t:
            return None
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._t_key != key:
            self._t, self._t_key = w.detach().t().contiguous(), key
        return self._t

    def plain(self) -> nn.Linear:
        """An ``nn.Linear`` with the same weight and bias (for code that needs that exact type)."""
        m = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        m.weight = self.weight
        if self.bias is not None:
            m.bias = self.bias
        return m


class FastPath:
    """The fast path of one process: the :class:`FastLinear` modules it installed and its choice
    per (threads, shape, rows).  ``store``: the choices file (default: ``fastlinear.json`` in the
    cache dir); ``kernels``: whether the row kernels are candidates (default: unless
    ``SSD_CHAT_FAST_LINEAR=torch``); ``timed``: False keeps to :func:`static_choice`."""

    def __init__(self, store: Any = None, kernels: bool | None = None, timed: bool = True) -> None:
        self.store = store
        self.kernels = (mode() != "torch") if kernels is None else kernels
        self.timed = timed
        self.choices: dict[Key, str] = {}
        self._layers: weakref.WeakSet[FastLinear] = weakref.WeakSet()

    def __deepcopy__(self, memo: dict) -> "FastPath":
        return self  # a copied model's layers stay served by the same path

    # -- installing ------------------------------------------------------------------------------
    def install(self, model: nn.Module, announce: Callable[[], None] | None = None,
                tuned: Callable[[float], None] | None = None) -> int:
        """Replace every plain float32 CPU ``nn.Linear`` inside ``model`` by a :class:`FastLinear`,
        then :meth:`prepare` the current thread count (``announce`` is called once before any timing,
        the first load on a machine; ``tuned(fraction)`` hears how far it is).  Returns how many
        modules were replaced (0 when disabled, on GPU, or for other dtypes)."""
        if not enabled() or _suspended[0]:
            return 0
        for m in model.modules():  # copies of installed layers (a draft built from the target's) are served too
            if isinstance(m, FastLinear) and m.path is self:
                self._layers.add(m)
        plain = {id(m): m for m in model.modules() if type(m) is nn.Linear and _served(m.weight)}
        if not plain:
            return 0
        sizes = {m.weight.data_ptr(): m.weight.numel() * m.weight.element_size() for m in plain.values()}
        allow_t = sum(sizes.values()) <= MAX_TRANSPOSE_BYTES
        new: dict[int, FastLinear] = {}
        for parent in list(model.modules()):
            for name, child in list(parent._modules.items()):  # every name: a module may sit at two
                if id(child) in plain:
                    fast = new.setdefault(id(child), FastLinear(child, self, allow_t))
                    setattr(parent, name, fast)
                    self._layers.add(fast)
        self.prepare(None, announce, tuned)
        return len(new)

    # -- choosing ---------------------------------------------------------------------------------
    def prepare(self, threads: int | None = None, announce: Callable[[], None] | None = None,
                tuned: Callable[[float], None] | None = None) -> None:
        """Make sure every shape served has choices for ``threads`` torch threads (default: the
        current count): read back from the store, or timed now with that many threads.  Cheap when
        nothing is missing.  The choices differ by thread count: at 2 threads MKL's products use
        both cores, the row kernels one."""
        if not enabled() or not self.timed:
            return
        with _threads(threads):
            n = torch.get_num_threads()
            for allow_t, by_shape in self._weights().items():
                missing = {s: ws for s, ws in by_shape.items() if any((n, *s, r) not in self.choices for r in range(1, MAX_FAST_ROWS + 1))}
                if missing:
                    got = fastlinear_store.stored_or_tuned(missing, allow_t, self._tune, self._methods(allow_t), announce, tuned,
                                                           self.store)
                    self.choices.update({(n, *k): m for k, m in got.items()})
            # the row kernels these choices name, loaded now rather than inside the first reply
            rowkernels.warm({(r, KERNEL_BLOCK[m]) for (t, _, _, r), m in self.choices.items() if t == n and m in KERNEL_BLOCK})

    def choice(self, out_f: int, in_f: int, rows: int) -> str:
        return self.choices.get((torch.get_num_threads(), out_f, in_f, rows)) or static_choice(out_f, in_f, rows)

    def _weights(self) -> dict[bool, dict[tuple[int, int], list[torch.Tensor]]]:
        out: dict[bool, dict[tuple[int, int], list[torch.Tensor]]] = {}
        seen: set[int] = set()
        for m in list(self._layers):
            w = m.weight
            if w.data_ptr() not in seen and _served(w):
                seen.add(w.data_ptr())
                out.setdefault(m.allow_t, {}).setdefault(tuple(w.shape), []).append(w)  # type: ignore[arg-type]
        return out

    def _methods(self, allow_t: bool) -> list[str]:
        """The formulations this path can run: ``xwt`` needs the transpose copy, the row kernels numba."""
        kernels = self.kernels and rowkernels.available()
        return [m for m in METHODS if (allow_t or m != "xwt") and (m not in KERNEL_BLOCK or kernels)]

    def _tune(self, weights: list[torch.Tensor], allow_t: bool) -> dict[int, str]:
        return tune(weights, self._methods(allow_t))

    # -- running ----------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               wt: Callable[[], torch.Tensor | None] | None = None) -> torch.Tensor:
        """``F.linear(x, w, bias)`` by the formulation chosen for the rows of ``x``; ``wt`` gives the
        weight's transpose (for ``xwt``).  Anything that needs gradients is plain ``F.linear``."""
        if (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)) or x.dtype != w.dtype \
                or x.device != w.device or w.device.type != "cpu":
            return F.linear(x, w, bias)
        out_f, in_f = w.shape
        rows = x.numel() // in_f if in_f else 0
        method = self.choice(out_f, in_f, rows)
        t = wt() if method == "xwt" and wt is not None else None
        if method == "linear" or (method == "xwt" and t is None) or not _runnable(method, w):
            return F.linear(x, w, bias)
        y = run(method, x.reshape(rows, in_f), w, t)  # the same products tune() timed
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], out_f)

    def traceable(self, m: FastLinear, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """``m`` for [rows, in] inputs as a compiled graph can call it: the chosen formulation (the row
        kernels through :func:`row_op`, opaque to the compiler), else the static rule.  ``xwt`` reads
        the transpose taken now: a later in-place weight update needs a new graph."""
        w, b = m.weight, m.bias
        out_f, in_f = w.shape
        method = self.choice(out_f, in_f, rows)
        if method in KERNEL_BLOCK and _runnable(method, w) and rows <= MAX_FAST_ROWS:
            op, block = row_op(), KERNEL_BLOCK[method]
            # an AOTInductor package cannot call a Python custom op: an export takes the static rule
            plain = self._plain(m, static_choice(out_f, in_f, rows))

            def kernels(x: torch.Tensor) -> torch.Tensor:
                if torch.compiler.is_exporting():
                    return plain(x)
                return op(x, w, block) if b is None else op(x, w, block) + b
            return kernels
        if method not in ("linear", "wxt", "xwt"):
            method = static_choice(out_f, in_f, rows)
        return self._plain(m, method)

    @staticmethod
    def _plain(m: FastLinear, method: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """``m`` by one of torch's own products (``linear``, ``wxt``, ``xwt``)."""
        w, b = m.weight, m.bias
        wt = m.transposed() if method == "xwt" else None
        if wt is not None:
            return (lambda x: torch.mm(x, wt)) if b is None else (lambda x: torch.mm(x, wt) + b)
        if method == "wxt":
            return (lambda x: torch.mm(w, x.t()).t()) if b is None else (lambda x: torch.mm(w, x.t()).t() + b)
        return lambda x: F.linear(x, w, b)


def restore(model: nn.Module) -> None:
    """Put plain ``nn.Linear`` modules back where :meth:`FastPath.install` put FastLinears."""
    plain: dict[int, nn.Linear] = {}
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if isinstance(child, FastLinear):
                setattr(parent, name, plain.setdefault(id(child), child.plain()))


_shared: FastPath | None = None
_suspended = [0]


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No :meth:`FastPath.install` inside: for a caller that replaces the linears right after (a GGUF
    target's by GGUF linears), whose float ones would be timed and wrapped for nothing."""
    _suspended[0] += 1
    try:
        yield
    finally:
        _suspended[0] -= 1


def shared() -> FastPath:
    """The process's fast path (what the app's models, the speculator's draft and the drafts use)."""
    global _shared
    if _shared is None:
        _shared = FastPath()
    return _shared


def install(model: nn.Module, announce: Callable[[], None] | None = None, tuned: Callable[[float], None] | None = None) -> int:
    return shared().install(model, announce, tuned)


def prepare(threads: int | None = None) -> None:
    shared().prepare(threads)


# --- the formulations and their timing -------------------------------------------------------------


def _served(w: torch.Tensor) -> bool:
    return w.device.type == "cpu" and w.dtype == torch.float32


def _runnable(method: str, w: torch.Tensor) -> bool:
    """Per call, so cheap: a row kernel needs a contiguous weight (and numba, loaded once)."""
    if method in KERNEL_BLOCK:
        return w.is_contiguous() and rowkernels.available()
    return True


def run(method: str, x: torch.Tensor, w: torch.Tensor, wt: torch.Tensor | None) -> torch.Tensor:
    if method in KERNEL_BLOCK:
        return rowkernels.matmul_t(x, w, KERNEL_BLOCK[method])
    if method == "xwt":
        return torch.mm(x, wt)  # type: ignore[arg-type]
    if method == "wxt":
        return torch.mm(w, x.t()).t().contiguous()
    return F.linear(x, w)


@torch.inference_mode()
def tune(weights: list[torch.Tensor], methods: list[str], rows: range = range(1, MAX_FAST_ROWS + 1),
         clock: Any = time.perf_counter) -> dict[int, str]:
    """The fastest of ``methods`` for each row count, timed on these same-shape matrices: each pass
    multiplies every one of them (up to ``TUNE_BYTES``), so they stream from memory."""
    out_f, in_f = weights[0].shape
    per = weights[0].numel() * weights[0].element_size()
    ws = [w.detach() for w in weights[: max(1, min(len(weights), TUNE_BYTES // max(per, 1)))]]
    wts = [w.t().contiguous() for w in ws] if "xwt" in methods else [None] * len(ws)
    ms = [m for m in methods if _runnable(m, ws[0])]
    best: dict[int, str] = {}
    gen = torch.Generator().manual_seed(out_f * 131 + in_f)
    for r in rows:
        x = torch.randn(r, in_f, generator=gen, dtype=ws[0].dtype)
        times: dict[str, float] = {}
        for m in ms:
            for w, t in zip(ws, wts):  # warm-up (and the transposes' first touch)
                run(m, x, w, t)
            fastest = float("inf")
            for _ in range(TUNE_REPEATS):
                t0 = clock()
                for w, t in zip(ws, wts):
                    run(m, x, w, t)
                fastest = min(fastest, clock() - t0)
            times[m] = fastest
        best[r] = min(ms, key=lambda m: (times[m], METHODS.index(m)))
    return best


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    old = torch.get_num_threads()
    if n and n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n and n != old:
            torch.set_num_threads(old)


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
