"""The one way decoding code reads a device tensor on the host, and the count of those reads.

On a GPU every device→host read (``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``, ``.cpu()``)
waits for all queued kernels: a round that reads once per draft step pays a sync per step.  The
round and the speculator therefore keep their tokens on the device and read through :func:`read`,
once per SD round and at most once per speculator request (``tests/test_host_reads.py`` holds the
budget by counting the reads here).  Reads at load time or in tests need not come through here.  :func:`on_host` is the one exception to
the budget: a read of a tensor already in host memory (the CPU sampler's tie check), which waits for
nothing; it is counted under ``"cpu: ..."`` so the budget test can tell the two apart.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_local = threading.local()


def read(t: torch.Tensor, what: str = "") -> Any:
    """``t.tolist()`` (a Python scalar for a 0-dim tensor), counted under ``what`` by :func:`counting`."""
    counts: Counter | None = getattr(_local, "counts", None)
    if counts is not None:
        counts[what] += 1
    return t.tolist()


def on_host(t: torch.Tensor, what: str = "") -> Any:
    """:func:`read` for a CPU tensor (refused for any other device: that read would be a sync)."""
    if t.device.type != "cpu":
        raise ValueError(f"on_host({what!r}) read a {t.device.type} tensor: use read(), inside the budget")
    return read(t, f"cpu: {what}")


@contextmanager
def counting() -> Iterator[Counter]:
    """Count this thread's :func:`read` calls, by ``what``, while the block runs."""
    before = getattr(_local, "counts", None)
    _local.counts = Counter()
    try:
        yield _local.counts
    finally:
        _local.counts = before
