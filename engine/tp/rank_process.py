"""A tensor-parallel rank other than 0: a worker process that loads its shard and mirrors rank 0.

Rank 0 (:class:`~ssd_chat.engine.tp.core.TPCore`) broadcasts every call that touches the model or
its cache as a fixed 8-number header and its payload tensors, on the process group itself; each
rank then makes the very same :class:`~ssd_chat.engine.model.core.Core` call on its shard, so all
ranks reach the same collectives in the same order.  Only rank 0's answer is used.  Every append
carries rank 0's committed length, so a rollback, ``reset`` and ``set_length`` need no message.

The worker is started and owned like the SSD speculator (:mod:`processes`).  A failure sends one
line on its pipe and ends the process; rank 0's next collective then fails and it reports that line.
A ``ValueError`` (an argument check) is raised by rank 0's identical call too, before any
collective, so the worker just waits for the next command.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

import torch

from .. import processes

HEADER = 8
APPEND, STEP, ADOPT, RESERVE, WARM, CLOSE, NOP = range(1, 8)  # NOP: rank 0 keeps an idle group alive
LOGITS = ("all", "last", "none")


class CompileFailed(RuntimeError):
    """Compiling failed on one rank: it would run eagerly while the others run graphs, and eager
    and compiled forwards make differently shaped collectives (padded rows, the head on every row)."""


def refuse_eager_fallback(text: str) -> None:
    """The core's ``notify`` on a rank: turn its eager fallback into an error."""
    raise CompileFailed(text)


def init_group(backend: str, port: int, rank: int, world: int, device: torch.device, timeout_s: float, store: Any = None) -> None:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl" and rank == 0:  # NCCL's default on a timed-out collective kills the process: the app's
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # rank 0 aborts the group and reports instead
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    kw: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kw)


def main(conn: Any, source: str, cfg: Any, rank: int, world: int, device: str, dtype: torch.dtype, cores: tuple[int, ...] | None,
         port: int, backend: str, name: str, core_kw: dict[str, Any], timeout_s: float, parent_pid: int,
         fault: str | None = None) -> None:
    """The rank's process: load the shard, join the group, serve rank 0's commands until CLOSE."""
    if not processes.child_start(parent_pid):
        return
    import torch.distributed as dist

    try:
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        from ..cpu import fastlinear
        from ..model.core import Core
        from . import shard as tp_shard

        model, comm, info = tp_shard.build(source, cfg, rank, world, dev, dtype, name)
        fastlinear.install(model)  # as the app's models get it (CPU float32 only)
        conn.send(("loaded", info))
        init_group(backend, port, rank, world, dev, timeout_s)
        comm.bind()
        core = Core(model, name, notify=refuse_eager_fallback, **core_kw)
        conn.send(("ready", os.getpid()))
        serve(core, dev, fault)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException as e:  # noqa: BLE001 - one line for rank 0, which reports it
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        try:
            conn.send(("error", f"{type(e).__name__}: {first}"))
        except (OSError, EOFError):
            pass
        sys.exit(1)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the group may be broken; the process ends anyway
                pass
    processes.exit_now()


def _recv(shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    import torch.distributed as dist

    t = torch.empty(shape, dtype=dtype, device=dev)
    dist.broadcast(t, 0)
    return t


def serve(core: Any, dev: torch.device, fault: str | None) -> None:
    """Mirror rank 0's calls (see the module docstring) until CLOSE."""
    import torch.distributed as dist

    hdr = torch.empty(HEADER, dtype=torch.long, device=dev)
    forwards = 0
    fault_kind, fault_at = (fault.split(":")[0], int(fault.split(":")[1])) if fault else (None, -1)
    while True:
        dist.broadcast(hdr, 0)
        op, a, b, c, d = hdr.tolist()[:5]
        if op == CLOSE:
            return
        try:
            if op in (APPEND, STEP):
                if op == APPEND:
                    args: tuple = (_recv((a,), torch.long, dev),)
                else:
                    ipc = _recv((3, a), torch.long, dev)
                    args = (ipc[0], ipc[1], ipc[2], _recv((a, b), torch.uint8, dev).bool())
                forwards += 1
                if forwards == fault_at:  # test hook: this rank dies (exit) or fails (raise) inside a forward
                    if fault_kind == "exit":
                        os._exit(3)
                    raise RuntimeError("injected fault")
                if op == APPEND:
                    core.kv.length = b
                    core.append(args[0], LOGITS[c], bool(d))
                else:
                    core.step(*args, logits=LOGITS[c], hidden=bool(d))
            elif op == ADOPT:
                src = _recv((a,), torch.long, dev) if a else torch.empty(0, dtype=torch.long, device=dev)
                core.kv.length = c
                core.kv.adopt(b, src)
            elif op == RESERVE:
                core.kv.reserve(a)
            elif op == WARM:
                core.warm()
        except ValueError:
            continue
