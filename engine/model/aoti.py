"""CPU graphs as AOTInductor packages: compiled once per machine, loaded in a fraction of a second.

``torch.compile`` re-traces the Python of every layer at each start (12-17 s per row shape for
SmolLM2-135M on a small CPU) and checks its guards on every call (about 1 ms).  An AOTInductor
package (``torch.export`` then ``aoti_compile_and_package``) is a shared library: loading it skips
tracing, and calling it skips dynamo.  The window (mask width) and the cache capacity are dynamic,
so one package serves a whole reply.  The model's weights are baked in as constants, so the key
includes a fingerprint of them.  Packages live in ``aoti/`` in the ssd-chat cache dir.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch

from ..config import cache_dir, cpu_name, numba_attention
from ..processes import pid_alive
from .cache import StaticKV

VERSION = "v2"  # bump when the graph's code changes in a way the key does not see


class Trunk(Protocol):
    """What the compilers need of a model's trunk (a :class:`core.Core`), so that they depend on
    no core: its name, model, mid-layer tap, cache and device, and the graph for a row count."""

    name: str
    model: torch.nn.Module
    mid_layer: int | None
    kv: StaticKV
    device: torch.device

    def graph_for(self, rows: int) -> Callable: ...


def rows_words(rows: int) -> str:
    return f"{rows} row{'s' if rows != 1 else ''}"


def fingerprint(model: torch.nn.Module) -> str:
    """Names, shapes, dtypes and a few values of every tensor the model holds (its weights as the
    package bakes them), hashed."""
    h = hashlib.sha256()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        flat = t.detach().reshape(-1)
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        for part in (flat[:16], flat[flat.numel() // 2:flat.numel() // 2 + 16], flat[-16:]):
            h.update(part.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    for name, m in model.named_modules():  # GGUF linears keep their int4 operands outside the buffers
        packed = getattr(m, "int4", None)
        if packed is not None:
            h.update(f"{name}:int4:{tuple(packed[0].shape)}".encode())
            h.update(packed[1].reshape(-1)[:32].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:20]


def path_for(core: Trunk, rows: int) -> Path:
    ident = [cpu_name(), torch.__version__, torch.get_num_threads(), rows, fingerprint(core.model),
             core.mid_layer, os.environ.get("SSD_CHAT_CPU_KERNELS", ""), VERSION]
    if numba_attention():  # the graph calls cpu/attend.py
        ident.append("attention: numba")
    key = hashlib.sha256(json.dumps(ident, default=str).encode()).hexdigest()[:20]
    return cache_dir() / "aoti" / f"{core.name.replace('/', '_')}-{rows}rows-{key}.pt2"


def load_or_build(core: Trunk, rows: int, example: tuple, progress: Callable[[str], None], path: Path | None = None,
                  load: bool = True) -> Callable | None:
    """The package for ``core``'s graph of ``rows`` rows (at ``path``, default :func:`path_for`): loaded from
    the cache, else exported, compiled (minutes on a small CPU; ``progress`` says so first) and stored.
    ``load`` False: only build it (a background build, :mod:`background`)."""
    path = path or path_for(core, rows)
    with building(path, lambda: progress(f"waiting for another ssd-chat compiling {core.name} for {rows_words(rows)}")):
        if not path.exists():  # else another process built it while this one waited
            _build(core, rows, example, progress, path)
    return load_package(path) if load else None


@contextlib.contextmanager
def building(path: Path, waiting: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Held while ``path`` is built (an ``flock`` on ``<package>.lock``; ``waiting()`` first if another process
    holds it): a first start's app and its mode probe's measurer want the same packages at once, and each
    build is minutes of CPU on a small machine."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as f:  # the lock goes when the file closes, also in a killed process
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waiting()
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _build(core: Trunk, rows: int, example: tuple, progress: Callable[[str], None], path: Path) -> None:
    progress(f"compiling {core.name} for {rows_words(rows)} (once)")
    fn = core.graph_for(rows)

    class Graph(torch.nn.Module):
        def forward(self, ks: Any, vs: Any, ids: Any, pos: Any, slots: Any, mask: Any) -> Any:
            return fn(ks, vs, ids, pos, slots, mask)

    cap = torch.export.Dim("capacity", min=16, max=1 << 20)
    width = torch.export.Dim("width", min=16, max=1 << 20)
    ks, vs = example[0], example[1]
    dyn = {"ks": [{1: cap}] * len(ks), "vs": [{1: cap}] * len(vs), "ids": None, "pos": None, "slots": None,
           "mask": {1: width}}
    with torch.inference_mode():
        ep = torch.export.export(Graph(), tuple(example), dynamic_shapes=dyn, strict=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp))
        # who can load it: `models cache prune` finds the packages another torch or CPU built (never loaded here)
        path.with_suffix(".json").write_text(json.dumps({"torch": torch.__version__, "cpu": cpu_name()}))
        os.replace(tmp, path)


def use_disk_cache() -> None:
    """Inductor's kernels and FX graphs under the ssd-chat cache dir (unless the user chose a dir)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # inductor writes its default into the environment when it first looks: that one is not a choice
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    # several models x row shapes x cache reallocations recompile the same code object
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


_UNPACK_LOCK = threading.Lock()


def unpack_dir() -> Path:
    """Where this process's loaded packages unpack (about 200 MB each).  torch's loader unpacks into
    ``$TMPDIR/aotinductor_*`` and deletes it only when the loader is destroyed, which a process that ends
    by a signal or ``os._exit`` never does: in /tmp each such start left its packages behind."""
    return cache_dir() / "unpacked" / str(os.getpid())


def sweep_unpacked() -> None:
    """Remove what processes that are gone left unpacked."""
    for d in (cache_dir() / "unpacked").glob("*"):
        if d.name.isdigit() and int(d.name) != os.getpid() and not pid_alive(int(d.name)):
            shutil.rmtree(d, ignore_errors=True)


def load_package(path: Path) -> Callable:
    """A built package, ready to call (a seam: tests stand in for it)."""
    if numba_attention():
        from ..cpu import attend

        attend.op()  # the package calls ssd_chat::attend by name
    with _UNPACK_LOCK:
        sweep_unpacked()
        here = unpack_dir()
        here.mkdir(parents=True, exist_ok=True)
        old = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = str(here)  # read by the C++ loader, for this call only
        try:
            return torch._inductor.aoti_load_package(str(path))
        finally:
            if old is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = old
