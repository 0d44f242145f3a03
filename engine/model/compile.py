"""Compiling the core's row shapes: ``torch.compile`` once per shape, eager where that is better.

A call with fewer rows than a compiled shape is padded up to it (the padding rows write to the
cache's trash slot and are dropped); one with more rows (a prefill) runs eagerly.

* CUDA: CUDA graphs over fully static shapes: the attention window is the whole cache buffer,
  marked a static address so its in-place K/V writes stay inside the graph.
* CPU: an AOTInductor package per row shape (:mod:`aoti`), built once per machine and model
  (minutes on a small CPU), then loaded in a fraction of a second.  ``on`` and ``auto`` both
  compile every shape: eager and compiled forwards differ in the last bits, and a verify must
  compute what one-row steps compute.

Any failure while compiling or running a graph turns compiling off for this core, sends one
``notify`` line and reruns the call eagerly: the caller sees the eager result, never a traceback.
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

from ..cpu import quant
from . import aoti, background
from .aoti import Trunk, rows_words

COMPILE_MODES = ("off", "on", "auto")
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
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got '{mode}'")
        self.core, self.mode = core, mode
        self.rows = sorted({int(r) for r in rows if int(r) > 0})
        self.cuda = core.device.type == "cuda"
        self.notify = notify or (lambda s: None)
        self.progress = progress or (lambda s: None)
        self.failed: str | None = None  # why compiling was turned off
        self.compile_s: dict[int, float] = {}  # rows -> seconds the first call took (compile + run)
        self._fns: dict[tuple[int, int], Callable] = {}  # (rows, threads) -> compiled graph
        self._static: int = -1  # kv.version last marked a static address
        # background builds (``auto`` on CPU, :mod:`background`): set by the model's handle, () -> (make, recipe):
        # rebuilds the model in the build process
        self.source: Callable[[], tuple[Callable, Any]] | None = None
        self.path = "eager"  # the path of the reply under way, fixed at its first forward (:meth:`_decide`)
        self._decided = False
        self._ready: dict[tuple[int, int], Callable] = {}  # packages built in the background, taken at a reply's start
        self._building: set[tuple[int, int]] = set()
        self._builds: list[background.Build] = []
        self._bg_failed: str | None = None
        self._spawners: list[threading.Thread] = []
        self._slots: list[_Slot] = []
        self._gen = 0  # :meth:`close` counts up: a build that starts after it is closed at once
        self._lock = threading.Lock()
        if mode != "off" and self.rows:
            aoti.use_disk_cache()
            if not self.cuda:
                quant.use_int4(core.model)

    @property
    def active(self) -> bool:
        return self.mode != "off" and self.failed is None and bool(self.rows)

    @property
    def background(self) -> bool:
        """Whether a missing shape builds in a background process while replies run eagerly: ``auto`` on
        CPU, for a model the build process can rebuild (``source``)."""
        return self.mode == "auto" and not self.cuda and self.source is not None and _compile is _default_compile

    @property
    def compiled(self) -> bool:
        """Whether the reply under way (or the last one) runs on compiled graphs."""
        return self.active and (self.path == "compiled" if self.background else True)

    def begin(self) -> None:
        """A new reply: its path (compiled or eager) is fixed at its first forward and kept to its end, so
        a build that finishes mid-reply is taken by the next reply, never inside one (the paths compute in
        different precisions, so their greedy tokens part after a while)."""
        self._decided = False

    def status(self) -> str | None:
        """"compiling <name> for 3 rows in the background, 40%" (the shape being built now, and how many wait
        after it) while a background build runs, else None."""
        if not self._building:
            return None
        live = next((b for b in self._builds if b.running), None)
        r, _t, frac = live.current() if live is not None else (*min(self._building), 0.0)
        more = len(self._building) - 1
        after = f", then {more} more shape{'s' if more > 1 else ''}" if more > 0 else ""
        return f"compiling {self.core.name} for {rows_words(r)} in the background, {frac:.0%}{after}"

    def close(self) -> None:
        """Stop the background builds (their unfinished files go; finished packages stay)."""
        with self._lock:
            self._gen += 1
            builds, self._builds = self._builds, []
            slots, self._slots = self._slots, []
        for b in builds:
            b.close()
        for slot in slots:
            slot.done(True)
        self._building.clear()

    def forget(self) -> None:
        """Drop the graphs made so far: CPU packages bake the weights in (:mod:`aoti`), so a caller that
        changes them in place must call this; the next call loads or builds a package for the new ones."""
        self.close()
        self._fns.clear()
        self._ready.clear()

    def shape_for(self, n: int) -> int | None:
        """The compiled row count that serves ``n`` rows (None: run eagerly)."""
        return next((r for r in self.rows if r >= n), None)

    def run(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> tuple | None:
        """The compiled graph's (logits, hidden, mid) for these rows, or None: run them eagerly."""
        if not self.active:
            return None
        if self.background:
            if not self._decided:
                self._decide()
            if self.path != "compiled":
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
        if self.background:  # packages on disk load now; missing ones start building, and replies run eagerly
            self._decide(say=False)  # the load line says it; each reply that runs eagerly says it again
            t = torch.get_num_threads()
            for r in self.rows:  # a loaded package's first call (its lazy loads, numba's head kernel: about
                if (r, t) in self._fns and not self._call(r, *self.example(r)):  # a second) falls in the load
                    return
            return
        kv = self.core.kv
        kv.reserve(min(AUTO_WIDTH, kv.limit or AUTO_WIDTH))  # a small model's context may be shorter
        for r in self.rows:
            if not self._call(r, *self.example(r)):
                return

    # -- background builds -------------------------------------------------------------------------
    def _decide(self, say: bool = True) -> None:
        """Fix this reply's path: compiled when every row shape has its package for this thread count
        (loaded from disk, or built in the background since the last reply), else eager, starting the
        builds it lacks; their notice is queued before any work of the reply."""
        self._decided, self.path = True, "eager"
        t = torch.get_num_threads()
        with self._lock:
            self._fns.update(self._ready)
            self._ready.clear()
        jobs = []
        for r in self.rows:
            if (r, t) in self._fns or (r, t) in self._building:
                continue
            path = aoti.path_for(self.core, r)
            if path.exists():
                try:
                    self._fns[r, t] = aoti.load_package(path)
                except Exception as e:  # noqa: BLE001 - a package that does not load: compile it again
                    self._fail(e)
                    return
            elif self._bg_failed is None:
                jobs.append((r, t, path))
        if jobs:
            self._start(jobs)
        if all((r, t) in self._fns for r in self.rows):
            self.path = "compiled"
        elif self._building and say:  # every reply that runs eagerly for it says so, before its first token
            self.notify(f"{self.status()}; replies run uncompiled until it is ready")

    def _start(self, jobs: list[tuple[int, int, Any]]) -> None:
        self._building.update((r, t) for r, t, _p in jobs)
        # the process starts from a thread of its own: spawning it is no part of the reply that asked
        t = threading.Thread(target=self._spawn, args=(jobs, self._gen), name="ssd-compile-start", daemon=True)
        self._spawners.append(t)
        t.start()

    def _spawn(self, jobs: list[tuple[int, int, Any]], gen: int) -> None:
        """Start the build once no other build of this process runs (one at a time: two cores, and each
        build holds a copy of the model)."""
        assert self.source is not None
        while not _SLOT.acquire(timeout=0.2):
            if gen != self._gen:
                return
        if gen != self._gen:  # closed while it waited: start no process for a model that is gone
            _SLOT.release()
            return
        slot = _Slot(len(jobs))
        try:
            b = background.Build(self.source, type(self.core), self.core.name, self.core.mid_layer, AUTO_WIDTH, jobs,
                                 lambda r, t, path: (self._built(r, t, path), slot.done()),
                                 lambda why: (slot.done(True), self._build_failed(why)))
        except Exception as e:  # noqa: BLE001 - no process could start: stay eager, say so once
            slot.done(True)
            self._build_failed(f"{type(e).__name__}: {e}")
            return
        with self._lock:
            stale = gen != self._gen  # closed while it started
            if not stale:
                self._builds.append(b)
                self._slots.append(slot)
        if stale:
            b.close()
            slot.done(True)

    def _built(self, r: int, t: int, path: Any) -> None:
        """From the build's watcher thread: load the package; the next reply takes it."""
        fn = aoti.load_package(path)
        with self._lock:
            self._ready[r, t] = fn
            self._building.discard((r, t))

    def _build_failed(self, why: str) -> None:
        self._bg_failed = why
        self._building.clear()
        self.notify(f"compiling {self.core.name} in the background failed ({why}); it runs uncompiled")

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
        rows, and the attention sums the same terms in the same order (row invariance)."""
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

    def example(self, r: int) -> tuple:
        """Inputs (ids, pos, slots, mask) of a warm-up call of ``r`` rows."""
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
                self.progress(f"compiling {self.core.name} for {rows_words(r)} (once)")
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


_SLOT = threading.Semaphore(1)  # one background build at a time in this process


class _Slot:
    """A build's hold on :data:`_SLOT`: given back when its last shape is built, or it fails or is closed."""

    def __init__(self, shapes: int) -> None:
        self.left, self._lock = shapes, threading.Lock()

    def done(self, all_shapes: bool = False) -> None:
        with self._lock:
            if self.left <= 0:
                return
            self.left = 0 if all_shapes else self.left - 1
            if self.left == 0:
                _SLOT.release()


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
