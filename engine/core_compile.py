"""Compiling the core's row shapes: ``torch.compile`` once per shape, eager where that is better.

Each row count in ``rows`` (1, k+1, B, ...) gets its own compiled graph of
:meth:`Core.graph_for`; a call with fewer rows is padded up to the next compiled shape (the
padding rows write to the cache's trash slot and are dropped), a call with more rows
(a prefill) runs eagerly.

* CUDA: ``mode="reduce-overhead"`` (CUDA graphs).  The graph's shapes are fully static: the
  attention window is the whole cache buffer, which is marked a static address so its
  in-place K/V writes stay inside the graph.  Outputs are cloned (a replay overwrites them).
* CPU: inductor, with the attention window dynamic (one graph per row count, whatever the
  context length).  ``compile="auto"`` times each compiled shape against eager on the first
  use and keeps the faster; the verdict is stored in ``core-compile.json`` in the cache dir
  (keyed by CPU, torch version, threads and model shape), so later starts skip compiling
  shapes that lost.  Compiled kernels themselves land in inductor's on-disk cache,
  ``TORCHINDUCTOR_CACHE_DIR`` (default: ``inductor/`` in the ssd-chat cache dir).

Any failure while compiling or running a graph (no C++ compiler, an inductor error, a CUDA
graph capture failure) turns compiling off for this core, sends one ``notify`` line and
reruns the call eagerly: the caller sees the eager result, never a traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from .config import cache_dir

if TYPE_CHECKING:
    from .core import Core

MODES = ("off", "on", "auto")
AUTO_REPEATS = 7  # timed calls per formulation under compile="auto" (the median counts)
AUTO_WIDTH = 256  # attention window of the timing calls
WIDTH_STEP = 16  # CPU graphs attend over windows padded to a multiple of this (see Compiler._cpu_width)


def _compile(fn: Callable, cuda: bool) -> Callable:
    """torch.compile for one row shape (a seam: tests inject failures here)."""
    if cuda:
        return torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)
    return torch.compile(fn, fullgraph=True, dynamic=False)


class Compiler:
    def __init__(self, core: "Core", mode: str, rows: tuple[int, ...], notify: Callable[[str], None] | None,
                 progress: Callable[[str], None] | None) -> None:
        if mode not in MODES:
            raise ValueError(f"compile must be one of {', '.join(MODES)}, got '{mode}'")
        self.core, self.mode = core, mode
        self.rows = sorted({int(r) for r in rows if int(r) > 0})
        self.cuda = core.device.type == "cuda"
        self.notify = notify or (lambda s: None)
        self.progress = progress or (lambda s: None)
        self.failed: str | None = None  # why compiling was turned off
        self.verdicts: dict[int, str] = {}  # rows -> "compiled" | "eager" (auto on CPU)
        self.compile_s: dict[int, float] = {}  # rows -> seconds the first call took (compile + run)
        self._fns: dict[tuple[int, int], Callable] = {}  # (rows, threads) -> compiled graph
        self._static: int = -1  # kv.version last marked a static address
        if mode != "off" and self.rows:
            _use_disk_cache()

    @property
    def active(self) -> bool:
        return self.mode != "off" and self.failed is None and bool(self.rows)

    def shape_for(self, n: int) -> int | None:
        """The compiled row count that serves ``n`` rows (None: run eagerly)."""
        for r in self.rows:
            if r >= n:
                return None if self.verdicts.get(r) == "eager" else r
        return None

    def run(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> tuple | None:
        """The compiled graph's (logits, hidden, mid) for these rows, or None: run them eagerly."""
        if not self.active:
            return None
        n = ids.shape[0]
        r = self.shape_for(n)
        if r is None:
            return None
        if self.mode == "auto" and not self.cuda and r not in self.verdicts:
            self._decide(r)
            if self.verdicts.get(r) == "eager" or not self.active:
                return None
        got = self._call(r, *self._pad(r, ids, pos, slots, mask))
        if got is None:
            return None
        lg, h, mid = got
        return lg[:n], h[:n], None if mid is None else mid[:n]

    @torch.inference_mode()
    def warm(self) -> None:
        """Compile (and under auto, time) every row shape now."""
        if not self.active:
            return
        self.core.kv.reserve(AUTO_WIDTH)
        for r in self.rows:
            if self.mode == "auto" and not self.cuda:
                self._decide(r)
            elif not self._call(r, *self._dummy(r)):
                return

    # -- internals ---------------------------------------------------------------------------------
    def _pad(self, r: int, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> tuple:
        n, kv = ids.shape[0], self.core.kv
        width = kv.capacity + 1 if self.cuda else self._cpu_width(mask.shape[1])  # CUDA graphs: the whole buffer
        if n == r and width == mask.shape[1]:
            return ids, pos, slots, mask
        m = torch.zeros(r, width, dtype=torch.bool, device=mask.device)
        m[:n, : mask.shape[1]] = mask
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

    def _dummy(self, r: int) -> tuple:
        kv, dev = self.core.kv, self.core.device
        width = min(AUTO_WIDTH, kv.capacity)
        ids = torch.zeros(r, dtype=torch.long, device=dev)
        mask = torch.zeros(r, width, dtype=torch.bool, device=dev)
        mask[:, :width] = True
        mask = self._pad(r, ids, ids, ids, mask)[3]
        return ids, ids, ids + kv.trash, mask

    def _call(self, r: int, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> tuple | None:
        key = (r, torch.get_num_threads())  # CPU kernels are generated for a thread count
        kv = self.core.kv
        try:
            fn = self._fns.get(key)
            first = fn is None
            if first:
                self.progress(f"compiling {self.core.name} for {r} rows (once)")
                fn = self._fns[key] = _compile(self.core.graph_for(r), self.cuda)
            if self._static != kv.version:  # new cache tensors: CUDA graphs write them in place; CPU: any length
                for t in kv.k + kv.v:
                    torch._dynamo.mark_static_address(t) if self.cuda else torch._dynamo.mark_dynamic(t, 1)
                self._static = kv.version
            if not self.cuda:
                torch._dynamo.mark_dynamic(mask, 1)
            t0 = time.perf_counter()
            lg, h, mid = self._guarded(fn, first, (kv.k, kv.v, ids, pos, slots, mask))
            if first:
                self.compile_s[r] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - any compiler failure means: run eagerly, say so once
            self._fail(e)
            return None
        if self.cuda:  # a later replay of this graph overwrites its outputs
            lg, h, mid = lg.clone(), h.clone(), None if mid is None else mid.clone()
        return lg, h, mid

    def _guarded(self, fn: Callable, first: bool, args: tuple) -> tuple:
        """``fn(*args)``; on CPU, once the graph has run, without evaluating dynamo's guards (1-2 ms a
        call on a 30-layer model, an eighth of a step): where a call does need a new graph, dynamo
        says so and the call runs again with the guards."""
        if first or self.cuda:
            return fn(*args)
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return fn(*args)
        except RuntimeError as e:
            if "skip_guard_eval_unsafe" not in str(e):
                raise
            return fn(*args)

    def _fail(self, e: BaseException) -> None:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        self.failed = f"{type(e).__name__}: {first}"
        self._fns.clear()
        self.notify(f"compiling {self.core.name} failed ({self.failed}); it runs uncompiled")

    def _decide(self, r: int) -> None:
        """compile="auto" on CPU: keep the compiled graph for ``r`` rows only where it is faster."""
        key = _auto_key(self.core, r)
        stored = _load_verdicts().get(key)
        if stored in ("compiled", "eager"):
            self.verdicts[r] = stored
            return
        self.core.kv.reserve(AUTO_WIDTH)
        args = self._dummy(r)
        if self._call(r, *args) is None:  # compiles (the progress line) or fails (notice, eager)
            return
        kv = self.core.kv
        with torch.inference_mode():
            eager = [L.proj for L in self.core.layers]
            t_eager = _median_time(lambda: self.core.head(self.core.trunk(kv.k, kv.v, *args, eager)[0]))
            t_comp = _median_time(lambda: self._call(r, *args))
        if not self.active:
            return
        self.verdicts[r] = "compiled" if t_comp < t_eager else "eager"
        _store_verdict(key, self.verdicts[r], t_eager, t_comp)


def _median_time(f: Callable[[], Any]) -> float:
    """Seconds per call of ``f`` (median of AUTO_REPEATS, after one untimed call)."""
    f()
    ts = []
    for _ in range(AUTO_REPEATS):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _use_disk_cache() -> None:
    """Inductor's kernels and FX graphs under the ssd-chat cache dir (unless the user chose a dir)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # inductor writes its default into the environment when it first looks: that one is not a choice
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    # several models x row shapes x cache reallocations recompile the same code object
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _auto_key(core: "Core", r: int) -> str:
    cfg = core.model.config
    shape = [type(core.head).__name__, type(core.layers[0].proj["q"]).__name__, len(core.layers), cfg.hidden_size,
             core.heads, core.kv_heads, core.head_dim, getattr(cfg, "intermediate_size", 0), getattr(cfg, "vocab_size", 0)]
    ident = [_cpu_name(), torch.__version__, torch.get_num_threads(), str(core.dtype), shape, r, "v1"]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


def _store_path() -> Any:
    return cache_dir() / "core-compile.json"


def _load_verdicts() -> dict[str, str]:
    try:
        got = json.loads(_store_path().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v.get("verdict") for k, v in got.items() if isinstance(v, dict)} if isinstance(got, dict) else {}


def _store_verdict(key: str, verdict: str, t_eager: float, t_comp: float) -> None:
    path = _store_path()
    try:
        got = json.loads(path.read_text())
        got = got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        got = {}
    got[key] = {"verdict": verdict, "eager_ms": round(t_eager * 1e3, 3), "compiled_ms": round(t_comp * 1e3, 3)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(got, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache dir: decide again next start
