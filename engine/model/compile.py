"""Compiling the core's row shapes: ``torch.compile`` once per shape, eager where that is better.

Each row count in ``rows`` (1, k+1, B, ...) gets its own compiled graph of
:meth:`Core.graph_for`; a call with fewer rows is padded up to the next compiled shape (the
padding rows write to the cache's trash slot and are dropped), a call with more rows
(a prefill) runs eagerly.

* CUDA: ``mode="reduce-overhead"`` (CUDA graphs).  The graph's shapes are fully static: the
  attention window is the whole cache buffer, which is marked a static address so its
  in-place K/V writes stay inside the graph.  Outputs are cloned (a replay overwrites them).
* CPU: an AOTInductor package per row shape (:mod:`aoti`), the attention window and the cache
  capacity dynamic; built once per machine and model (minutes on a small CPU), then loaded in a
  fraction of a second.  ``on`` and ``auto`` both compile every shape: eager and compiled forwards
  differ in the last bits, and a verify must compute what one-row steps compute.  The graphs
  attend with :func:`core.attend_rows` over a window padded to WIDTH_STEP slots.

Any failure while compiling or running a graph (no C++ compiler, an inductor error, a CUDA
graph capture failure) turns compiling off for this core, sends one ``notify`` line and
reruns the call eagerly: the caller sees the eager result, never a traceback.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable

import torch

from ..config import cache_dir
from ..cpu import quant
from . import aoti
from .aoti import Trunk

MODES = ("off", "on", "auto")
AUTO_WIDTH = 256  # attention window of the warm-up calls
WIDTH_STEP = 16  # CPU graphs attend over windows padded to a multiple of this (see Compiler._cpu_width)


def _compile(fn: Callable, cuda: bool) -> Callable:
    """torch.compile for one row shape (a seam: tests inject failures here; CPU graphs otherwise
    become AOTInductor packages, :mod:`aoti`)."""
    if cuda:
        return torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)
    return torch.compile(fn, fullgraph=True, dynamic=False)


_default_compile = _compile


class Compiler:
    def __init__(self, core: Trunk, mode: str, rows: tuple[int, ...], notify: Callable[[str], None] | None,
                 progress: Callable[[str], None] | None) -> None:
        if mode not in MODES:
            raise ValueError(f"compile must be one of {', '.join(MODES)}, got '{mode}'")
        self.core, self.mode = core, mode
        self.rows = sorted({int(r) for r in rows if int(r) > 0})
        self.cuda = core.device.type == "cuda"
        self.notify = notify or (lambda s: None)
        self.progress = progress or (lambda s: None)
        self.failed: str | None = None  # why compiling was turned off
        self.compile_s: dict[int, float] = {}  # rows -> seconds the first call took (compile + run)
        self._fns: dict[tuple[int, int], Callable] = {}  # (rows, threads) -> compiled graph
        self._static: int = -1  # kv.version last marked a static address
        if mode != "off" and self.rows:
            _use_disk_cache()
            if not self.cuda:
                quant.use_int4(core.model)

    @property
    def active(self) -> bool:
        return self.mode != "off" and self.failed is None and bool(self.rows)

    def forget(self) -> None:
        """Drop the graphs made so far: CPU packages bake the weights in (:mod:`aoti`), so a caller that
        changes them in place must call this; the next call loads or builds a package for the new ones."""
        self._fns.clear()

    def shape_for(self, n: int) -> int | None:
        """The compiled row count that serves ``n`` rows (None: run eagerly)."""
        for r in self.rows:
            if r >= n:
                return r
        return None

    def run(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> tuple | None:
        """The compiled graph's (logits, hidden, mid) for these rows, or None: run them eagerly."""
        if not self.active:
            return None
        n = ids.shape[0]
        r = self.shape_for(n)
        if r is None:
            return None
        got = self._call(r, *self._pad(r, ids, pos, slots, mask))
        if got is None:
            return None
        lg, h, mid = got
        return lg[:n], h[:n], None if mid is None else mid[:n]

    @torch.inference_mode()
    def warm(self) -> None:
        """Compile (or load) every row shape now."""
        if not self.active:
            return
        kv = self.core.kv
        kv.reserve(min(AUTO_WIDTH, kv.limit or AUTO_WIDTH))  # a small model's context may be shorter
        for r in self.rows:
            if not self._call(r, *self._dummy(r)):
                return

    # -- internals ---------------------------------------------------------------------------------
    def _pad(self, r: int, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> tuple:
        n, kv = ids.shape[0], self.core.kv
        width = kv.capacity + 1 if self.cuda else self._cpu_width(mask.shape[1])  # CUDA graphs: the whole buffer
        if n == r and width == mask.shape[1]:
            return ids, pos, slots, mask
        m = self.pad_width(mask, r, width)
        m[n:, 0] = True  # padding rows look at slot 0 (any finite slot) and write to the trash slot
        pad = r - n
        z = ids.new_zeros(pad)
        return (torch.cat([ids, z]), torch.cat([pos, z]), torch.cat([slots, z + kv.trash]), m)

    def _cpu_width(self, w: int) -> int:
        """The attention window of a CPU graph: ``w`` rounded up to a multiple of WIDTH_STEP, so that a
        row sees the same window (its extra slots masked) in a one-row step and in a verify of k + 1
        rows, and :func:`core.attend_rows` sums the same terms in the same order (row invariance)."""
        kv = self.core.kv
        want = -(-w // WIDTH_STEP) * WIDTH_STEP
        if want > kv.capacity + 1:
            try:
                kv.reserve(want)
            except ValueError:  # the last slots of the context: the window is the whole buffer
                pass
        return min(want, kv.capacity + 1)

    def pad_width(self, mask: torch.Tensor, rows: int | None = None, width: int | None = None) -> torch.Tensor:
        """``mask`` [T, W] padded with False to ``rows`` rows (default T) and ``width`` columns
        (default :meth:`_cpu_width` (W)); ``mask`` itself where nothing is added."""
        rows = mask.shape[0] if rows is None else rows
        width = self._cpu_width(mask.shape[1]) if width is None else width
        if (rows, width) == tuple(mask.shape):
            return mask
        m = torch.zeros(rows, width, dtype=torch.bool, device=mask.device)
        m[: mask.shape[0], : mask.shape[1]] = mask
        return m

    def _dummy(self, r: int) -> tuple:
        kv, dev = self.core.kv, self.core.device
        width = min(AUTO_WIDTH, kv.capacity)
        ids = torch.zeros(r, dtype=torch.long, device=dev)
        mask = torch.zeros(r, width, dtype=torch.bool, device=dev)
        mask[:, :width] = True
        mask = self._pad(r, ids, ids, ids, mask)[3]
        return ids, ids.clone(), ids + kv.trash, mask  # distinct tensors: an export would take ids and pos for one input

    def _call(self, r: int, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> tuple | None:
        key = (r, torch.get_num_threads())  # CPU kernels are generated for a thread count
        kv = self.core.kv
        try:
            fn = self._fns.get(key)
            first = fn is None
            if first and not self.cuda and _compile is _default_compile:  # CPU: an AOTInductor package (aoti)
                fn = self._fns[key] = aoti.load_or_build(self.core, r, (kv.k, kv.v, ids, pos, slots, mask), self.progress)
            elif first:
                self.progress(f"compiling {self.core.name} for {r} rows (once)")
                fn = self._fns[key] = _compile(self.core.graph_for(r), self.cuda)
            if self.cuda:
                _graph_tls()
            if self._static != kv.version and self.cuda:  # new cache tensors: CUDA graphs write them in place
                for t in kv.k + kv.v:
                    torch._dynamo.mark_static_address(t)
                self._static = kv.version
            t0 = time.perf_counter()
            with _sigint_after():
                lg, h, mid = fn(kv.k, kv.v, ids, pos, slots, mask)
            if first:
                self.compile_s[r] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - any compiler failure means: run eagerly, say so once
            if "KeyboardInterrupt" in str(e):  # Ctrl-C inside a package's Python fallback op
                raise KeyboardInterrupt from e
            self._fail(e)
            return None
        if self.cuda:  # a later replay of this graph overwrites its outputs
            lg, h, mid = lg.clone(), h.clone(), None if mid is None else mid.clone()
        return lg, h, mid

    def _fail(self, e: BaseException) -> None:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        if not first:  # a bare assert: where it was raised is the only lead
            tb = traceback.extract_tb(e.__traceback__)
            first = f"at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
        self.failed = f"{type(e).__name__}: {first}"
        self._fns.clear()
        self.notify(f"compiling {self.core.name} failed ({self.failed}); it runs uncompiled")


@contextmanager
def _sigint_after():
    """Ctrl-C during a graph call raises KeyboardInterrupt when the call returns.  Raised inside it, in
    an AOTInductor package's Python fallback op, it came out as a RuntimeError after C++ printed an
    error line.  Only the main thread with Python's own handler (``ask``, ``bench``) is concerned."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    hit: list[int] = []
    signal.signal(signal.SIGINT, lambda *_: hit.append(1))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hit:
        raise KeyboardInterrupt


def _graph_tls() -> None:
    """CUDA graph trees keep their managers in thread-local storage set up by the thread that imported
    them; torch before 2.13 asserts when another thread (the app's loader, the rig's speculator) first
    compiles or replays a graph.  Give this thread its own, as torch 2.13 does."""
    from torch._inductor import cudagraph_trees as ct

    if hasattr(ct.local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
        return
    ct.local.tree_manager_containers = {}
    ct.local.tree_manager_locks = defaultdict(threading.Lock)


def _use_disk_cache() -> None:
    """Inductor's kernels and FX graphs under the ssd-chat cache dir (unless the user chose a dir)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # inductor writes its default into the environment when it first looks: that one is not a choice
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    # several models x row shapes x cache reallocations recompile the same code object
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
