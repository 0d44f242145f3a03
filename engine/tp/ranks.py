"""Rank 0's hold on the other tensor-parallel ranks: their processes, pipes and the process group
(:class:`Ranks`, what :class:`~ssd_chat.engine.tp.core.TPCore`'s finalizer closes), the watchdog that
notices a dead worker on NCCL, and the keep-alive that stops an idle group from timing out."""

from __future__ import annotations

import contextlib
import threading
import weakref
from multiprocessing.connection import wait
from typing import Any, Callable

import torch

from .. import processes
from .rank_process import CLOSE, HEADER

CLOSE_TIMEOUT_S = 3.0


class Ranks:
    """The worker processes, their pipes and the process group (what the finalizer closes)."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.group = False  # this process holds the default process group
        self.healthy = True
        self.closing = False
        self.cuda = False
        self.device = torch.device("cpu")  # rank 0's: the CLOSE broadcast goes there (cuda:2 for cuda:2,cuda:3)
        self.dead: str | None = None  # set by the watchdog: a worker that exited while the group was up
        self.lost: str | None = None  # set by the keep-alive: why the ranks closed while no call was running
        self.stop = threading.Event()
        self.lock = threading.RLock()  # held by each call; shutdown waits for one in flight (the keep-alive's)

    def shutdown(self) -> None:
        """CLOSE to every rank if the group still works; then terminate, kill, and leave the group.  Idempotent."""
        self.stop.set()
        with self.lock:
            self._shutdown()

    def _shutdown(self) -> None:
        import torch.distributed as dist

        self.closing = True
        if self.group and self.healthy:
            with contextlib.suppress(Exception):
                dist.broadcast(torch.tensor([CLOSE] + [0] * (HEADER - 1), device=self.device), 0)
        for p in self.procs:
            p.join(CLOSE_TIMEOUT_S if self.healthy else 0.2)
        for p in self.procs:
            if p.is_alive() and self.healthy:
                p.terminate()
                p.join(CLOSE_TIMEOUT_S)
            if p.is_alive():  # a broken group: a hung (or stopped, deaf to SIGTERM) rank is killed at once
                p.kill()
                p.join(CLOSE_TIMEOUT_S)
        for c in self.conns:
            with contextlib.suppress(Exception):
                c.close()
        if self.group:
            self.group = False
            with contextlib.suppress(Exception):
                if self.cuda and not self.healthy:  # a broken NCCL group can hang in a clean destroy
                    dist.distributed_c10d._abort_process_group()
                else:
                    dist.destroy_process_group()
        self.healthy = False


def watch(ranks: Ranks) -> None:
    """NCCL does not notice a dead peer (it waits for its timeout): abort the group when a worker exits."""
    wait([p.sentinel for p in ranks.procs])
    if ranks.group and ranks.healthy and not ranks.closing:
        ranks.dead = next((f"rank {r} (pid {p.pid}) {processes.exit_words(p)}" for r, p in enumerate(ranks.procs, 1)
                           if not p.is_alive()), None)
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            dist.distributed_c10d._abort_process_group()


def keep_alive(owner: Any, ranks: Ranks, interval_s: float, nop: Callable[[Any], None]) -> threading.Thread:
    """Between calls every worker waits in a collective for the next one, and a collective gives up
    after the group's timeout: a chat left idle longer would lose its ranks.  So every ``interval_s``
    without a call this thread calls ``nop(owner)`` (an empty command).  It holds ``owner`` weakly (a
    dropped model is still finalized) and stops when the ranks close; a failure is kept in
    ``ranks.lost`` for the next call to report."""
    ref = weakref.ref(owner)

    def run() -> None:
        while not ranks.stop.wait(interval_s):
            tp = ref()
            if tp is None or ranks.closing:
                return
            try:
                nop(tp)
            except Exception as e:  # noqa: BLE001 - the ranks are closed; the next call says why
                ranks.lost = str(e)
                return
            finally:
                del tp

    t = threading.Thread(target=run, name="ssd-tp-keepalive", daemon=True)
    t.start()
    return t
