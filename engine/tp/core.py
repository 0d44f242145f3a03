"""Tensor-parallel execution of the compact core: :class:`TPCore`, a drop-in for :class:`Core`.

The model is split over N ranks (:mod:`tp_shard`).  Rank 0 is this process: it runs its shard here
and returns full logits and hidden states, so its callers see a :class:`Core`.  Ranks 1..N-1 are
worker processes that this object starts and owns exactly like the SSD speculator (daemons that
die with the app and ignore Ctrl-C).

Every call is broadcast to the other ranks on the process group itself (NCCL on GPUs, gloo on CPU),
then run here; the ranks meet in the forward's collectives.  If any rank fails or dies mid-call,
rank 0's collective fails, every rank is closed and the call raises :class:`TPError` in one line
that names the rank; a new ``TPCore`` starts them again.  Idle workers would time out in their
collective, so rank 0 sends them an empty command every ``timeout_s / 3`` (:mod:`tp_ranks`).

On CPU (gloo, one rank per core) this is the multi-GPU code path for tests, slower than one process.
Ranks must all run compiled or all eager (the two make differently shaped collectives), so a rank
whose compile fails raises instead of falling back.  One ``TPCore`` of several ranks per process:
it owns torch.distributed's default group.  A single rank makes no collectives and starts no process.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from multiprocessing.connection import wait
from typing import Any, Callable

import torch

from .. import processes
from ..errors import ModelError, TPError
from ..model.core import Core, CoreOutput
from . import ranks as tp_ranks, shard as tp_shard, rank_process as tp_worker
from .ranks import Ranks
from .rank_process import ADOPT, APPEND, HEADER, LOGITS, NOP, RESERVE, STEP, WARM

LOAD_TIMEOUT_S = 900.0  # a rank's start: imports and reading its shard (a 70B shard is tens of GB)


class TPCore:
    """:class:`Core`'s API over a model split across ``devices`` (one rank each; rank 0 here).

    ``source``: the model folder (config.json + safetensors; a GGUF is converted to one by
    :func:`models.model_folder`), or for a single rank a dict of its tensors.  ``cores``: per
    rank, the CPU cores it is pinned to (CPU ranks).  ``progress`` hears the start and one line per
    rank saying what it holds (:meth:`ShardInfo.line`); ``timeout_s`` bounds a collective that waits
    on a hung rank; ``fault`` (tests): ``{rank: "exit:N" | "raise:N"}`` fails that rank's N-th forward.
    The rest are :class:`Core`'s arguments.  ``kv.k``/``kv.v`` are rank 0's own heads."""

    def __init__(self, source: str | os.PathLike | dict[str, torch.Tensor], devices: Sequence[str], name: str = "model",
                 dtype: torch.dtype | None = None, cores: Sequence[tuple[int, ...]] | None = None, compile: str = "off",
                 rows: tuple[int, ...] = (), mid_layer: int | None = None, lookahead: int = 0,
                 progress: Callable[[str], None] | None = None, timeout_s: float = 300.0, config: Any = None,
                 fault: dict[int, str] | None = None) -> None:
        import torch.distributed as dist

        say = progress or (lambda _s: None)
        self.name, self.world = name, len(devices)
        devs = [torch.device(d) for d in devices]
        if not devs or len({d.type for d in devs}) != 1 or devs[0].type not in ("cpu", "cuda"):
            raise TPError(f"tensor parallelism runs over CPU cores or over CUDA GPUs, not {', '.join(map(str, devices)) or 'nothing'}")
        if self.world > 1 and not isinstance(source, (str, os.PathLike)):
            raise TPError("tensor-parallel ranks read their shards from a model folder, not from tensors in memory")
        self.config = config if config is not None else tp_shard.load_config(source)  # type: ignore[arg-type]
        tp_shard.check(self.config, self.world, name)
        if self.world > 1 and dist.is_initialized():
            raise TPError("a tensor-parallel model is already running in this process (one per process): close it first")
        self.device = devs[0]
        cuda = self.device.type == "cuda"
        self.dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
        self.cores = [tuple(c) for c in cores] if cores else None
        self.compile = {"auto": "on" if cuda else "off"}.get(compile, compile)
        core_kw = {"compile": self.compile, "rows": tuple(rows), "mid_layer": mid_layer, "lookahead": lookahead}
        self._ranks = Ranks()
        self._ranks.cuda, self._ranks.device = cuda, devs[0]
        self._finalizer = weakref.finalize(self, self._ranks.shutdown)
        self._lock = self._ranks.lock  # one call (or the CLOSE at exit) on the group at a time
        self._timeout_s = timeout_s
        try:
            self._start(source, devs, core_kw, timeout_s, fault or {}, say)
        except BaseException:
            self._finalizer()
            raise
        self.kv = _TPKV(self)
        self.mid_layer = mid_layer

    # -- starting ----------------------------------------------------------------------------------
    def _start(self, source: Any, devs: list[torch.device], core_kw: dict[str, Any], timeout_s: float,
               fault: dict[int, str], say: Callable[[str], None]) -> None:
        import datetime

        import torch.distributed as dist

        from ..cpu import fastlinear

        backend = "nccl" if devs[0].type == "cuda" else "gloo"
        if self.world > 1:
            store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        ctx = processes.context(forked=True)
        src = os.fspath(source) if isinstance(source, (str, os.PathLike)) else ""
        for r in range(1, self.world):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=tp_worker.main, name=f"ssd-tp-rank{r}", daemon=True,
                               args=(child, src, self.config, r, self.world, str(devs[r]), self.dtype,
                                     self.cores[r] if self.cores else None, store.port, backend, self.name, core_kw,
                                     timeout_s, os.getpid(), fault.get(r)))
            processes.start(proc)  # real stdio, also under Textual
            child.close()
            self._ranks.procs.append(proc)
            self._ranks.conns.append(parent)
        if self.world > 1:
            say(f"started {self.world - 1} tensor-parallel rank process(es) for {self.name}")
        with self._pinned():
            model, comm, info = tp_shard.build(source, self.config, 0, self.world, devs[0], self.dtype, self.name)
            fastlinear.install(model)
        self.shards = [info] + self._collect("loaded", LOAD_TIMEOUT_S)
        if self.world > 1:  # one rank makes no collectives (tp_shard.Comm)
            tp_worker.init_group(backend, store.port, 0, self.world, devs[0], timeout_s, store=store)
            self._ranks.group = True
            comm.bind()
        self.core = Core(model, self.name, notify=tp_worker.refuse_eager_fallback, **core_kw)
        self._collect("ready", 120.0)
        for s in self.shards:
            say(s.line())
        if self.world > 1:  # an idle worker waits in a collective, which times out: send it a NOP now and then
            tp_ranks.keep_alive(self, self._ranks, timeout_s / 3, lambda tp: tp._run([NOP], [], lambda: None))
        if devs[0].type == "cuda" and self.world > 1:
            threading.Thread(target=tp_ranks.watch, args=(self._ranks,), name="ssd-tp-watchdog", daemon=True).start()

    def _collect(self, kind: str, timeout: float) -> list[Any]:
        """The ``kind`` message of every worker, in rank order; a clear error if one fails or dies first."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world - 1:
            pending = [r for r in range(1, self.world) if r not in got]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TPError(f"tensor-parallel rank {pending[0]} of '{self.name}' did not start within {timeout:.0f} s")
            wait([self._ranks.conns[r - 1] for r in pending] + [self._ranks.procs[r - 1].sentinel for r in pending], left)
            for r in pending:
                conn, proc = self._ranks.conns[r - 1], self._ranks.procs[r - 1]
                msg = None
                with contextlib.suppress(EOFError, OSError):
                    msg = conn.recv() if conn.poll() else None
                if msg is not None and msg[0] == kind:
                    got[r] = msg[1]
                elif msg is not None and msg[0] == "error":
                    raise ModelError(f"tensor-parallel rank {r} of '{self.name}' could not start: {msg[1]}")
                elif msg is None and not proc.is_alive():
                    raise TPError(f"tensor-parallel rank {r} of '{self.name}' {processes.exit_words(proc)} while starting")
        return [got[r] for r in range(1, self.world)]

    # -- the Core API ------------------------------------------------------------------------------
    @property
    def max_positions(self) -> int | None:
        return self.core.max_positions

    @property
    def compiler(self) -> Any:
        """Rank 0's :class:`~ssd_chat.engine.model.compile.Compiler` (every rank compiles the same shapes)."""
        return self.core.compiler

    @property
    def pids(self) -> list[int]:
        """The worker processes (ranks 1..N-1)."""
        return [p.pid for p in self._ranks.procs]

    @property
    def model(self) -> torch.nn.Module:
        """Rank 0's shard (local head and MLP counts; ``config`` is the whole model's)."""
        return self.core.model

    def append(self, ids: list[int] | torch.Tensor, logits: str = "all", hidden: bool = False) -> CoreOutput:
        ids_t = self.core._ids(ids)
        Core._check(int(ids_t.numel()), logits)
        head = [APPEND, int(ids_t.numel()), self.core.kv.length, LOGITS.index(logits), int(hidden)]
        return self._run(head, [ids_t], lambda: self.core.append(ids_t, logits, hidden))

    def step(self, ids: list[int] | torch.Tensor, positions: list[int] | torch.Tensor, slots: list[int] | torch.Tensor,
             mask: torch.Tensor, logits: str = "all", hidden: bool = False) -> CoreOutput:
        ids_t, pos, sl = self.core._ids(ids), self.core._ids(positions), self.core._ids(slots)
        if mask.dim() != 2 or not ids_t.numel() == pos.numel() == sl.numel() == mask.shape[0]:
            raise ValueError(f"step: {ids_t.numel()} ids, {pos.numel()} positions, {sl.numel()} slots, mask {tuple(mask.shape)}")
        Core._check(int(ids_t.numel()), logits)
        m = mask.to(self.device, torch.bool)
        head = [STEP, int(ids_t.numel()), int(m.shape[1]), LOGITS.index(logits), int(hidden)]
        return self._run(head, [torch.stack([ids_t, pos, sl]), m.to(torch.uint8)],
                         lambda: self.core.step(ids_t, pos, sl, m, logits, hidden))

    def tree(self, ids: list[int] | torch.Tensor, positions: list[int] | torch.Tensor, slots: list[int] | torch.Tensor,
             ancestors: list[list[int]] | torch.Tensor, prefix: int | None = None, logits: str = "all",
             hidden: bool = False) -> CoreOutput:
        """As :meth:`Core.tree`: the mask is built here and sent as a step."""
        sl = self.core._ids(slots)
        pre = self.core.kv.length if prefix is None else prefix
        anc_max = max((max(a) for a in ancestors if a), default=-1) if isinstance(ancestors, list) else ancestors.shape[1] - 1
        width = max(int(sl.max()), anc_max, pre - 1) + 1
        return self.step(ids, positions, sl, self.core.kv.tree_mask(sl, ancestors, pre, width), logits, hidden)

    def reset(self) -> None:
        self.core.kv.length = 0  # the next append carries it to the other ranks

    def warm(self) -> None:
        self._run([WARM], [], self.core.warm)

    def close(self) -> None:
        """Stop the other ranks and leave the process group (idempotent)."""
        with self._lock:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "TPCore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------------
    def _run(self, head: list[int], payload: list[torch.Tensor], local: Callable[[], Any]) -> Any:
        """Send one call to every rank, then make it here."""
        import torch.distributed as dist

        with self._lock:
            if self.closed:
                raise TPError(self._ranks.lost or f"the tensor-parallel ranks of '{self.name}' are closed; start the model again")
            try:
                with self._pinned():
                    if self.world > 1:
                        dist.broadcast(torch.tensor(head + [0] * (HEADER - len(head)), device=self.device), 0)
                        for t in payload:
                            dist.broadcast(t.to(self.device).contiguous(), 0)
                    t0, out = time.monotonic(), local()
                    if self._ranks.cuda and self.world > 1:  # NCCL: wait here, so a result made while a rank
                        torch.cuda.synchronize(self.device)  # died (group aborted) or hung (timed out) is not used
                        if self._ranks.dead or time.monotonic() - t0 >= self._timeout_s:
                            raise RuntimeError("NCCL collective timed out or aborted")
                    return out
            except ValueError:
                raise  # an argument check: every rank raised it before any collective, and they wait for the next call
            except BaseException as e:
                self._fail(e)

    def _fail(self, exc: BaseException) -> None:
        """A rank failed mid-call: say which, close every rank, raise TPError (Ctrl-C stays Ctrl-C)."""
        deadline = time.monotonic() + 1.0
        why: list[str] = []
        for r, (p, conn) in enumerate(zip(self._ranks.procs, self._ranks.conns), 1):
            p.join(max(0.0, deadline - time.monotonic()))
            msg = None
            with contextlib.suppress(EOFError, OSError):
                while conn.poll():
                    msg = conn.recv()
            if msg is not None and msg[0] == "error":
                why.append(f"rank {r} failed ({msg[1]})")
            elif not p.is_alive():
                why.append(f"rank {r} (pid {p.pid}) {processes.exit_words(p)}")
        if not why and self._ranks.dead:
            why.append(self._ranks.dead)
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        if not why and ("timed out" in first.lower() or "timeout" in first.lower()):
            why.append(f"a rank did not answer within {self._timeout_s:g} s")  # hung (a stopped process, a stuck GPU)
        if not why:
            why.append(f"rank 0 failed ({type(exc).__name__}{': ' + first if first else ''})")
        self._ranks.healthy = False
        self._finalizer()
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise exc
        if isinstance(exc, tp_worker.CompileFailed):
            why.append("tensor-parallel ranks must all run compiled or all eager: use compile off")
        raise TPError(f"tensor-parallel '{self.name}': {'; '.join(why)} during a forward; every rank was closed") from exc

    @contextlib.contextmanager
    def _pinned(self) -> Iterator[None]:
        """On CPU, rank 0's calls run on its own core(s) with as many threads."""
        cores = self.cores[0] if self.cores and hasattr(os, "sched_setaffinity") else None
        if cores is None:
            yield
            return
        old_aff, old_threads = os.sched_getaffinity(0), torch.get_num_threads()
        try:
            if old_aff != set(cores):
                os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
            yield
        finally:
            if old_aff != set(cores):
                os.sched_setaffinity(0, old_aff)
            torch.set_num_threads(old_threads)


class _TPKV:
    """``TPCore.kv``: rank 0's :class:`StaticKV` for reading; the calls that move data go to every rank."""

    def __init__(self, tp: TPCore) -> None:
        self._tp = tp

    def __getattr__(self, name: str) -> Any:  # capacity, limit, trash, version, causal_mask, tree_mask, ...
        return getattr(self._tp.core.kv, name)

    @property
    def length(self) -> int:
        return self._tp.core.kv.length

    @length.setter
    def length(self, n: int) -> None:
        self._tp.core.kv.length = n

    def truncate(self, keep: int) -> None:
        self._tp.core.kv.truncate(keep)  # a length: the next append carries it

    def set_length(self, n: int) -> None:
        self._tp.core.kv.set_length(n)

    def reserve(self, n: int) -> None:
        self._tp._run([RESERVE, int(n)], [], lambda: self._tp.core.kv.reserve(n))

    def adopt(self, keep: int, src: torch.Tensor | list[int]) -> None:
        local = self._tp.core.kv
        idx = torch.as_tensor(src, dtype=torch.long).reshape(-1)
        head = [ADOPT, int(idx.numel()), int(keep), local.length]
        self._tp._run(head, [idx] if idx.numel() else [], lambda: local.adopt(keep, idx.to(local.device)))
