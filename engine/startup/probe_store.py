"""Where ``auto``'s measurements live, what they are keyed by, who may measure, and how busy the machine was.

The key is what can change which mode is fastest (:func:`key_fields`): the machine (CPU, cores, GPUs),
the model and draft by content (a local file's name, size and a digest of its first and last MiB, never
its path: the packaged model sits in each virtualenv), and the build (ssd-chat and torch versions, k,
dtype, compile, devices, fan-out, ``SSD_CHAT_CPU_KERNELS``).  A :class:`Record` keeps the figures with
when they were taken, the load other processes put on the machine meanwhile, and the verdict: ``ok``, or
``busy`` / ``noisy`` (kept too, so that later starts do not measure again; ``ssd-chat config measure``
does).  One process measures a key at a time (:func:`lock`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ..config import EngineConfig, cache_dir, numba_attention, write_atomic
from ..config import cpu_name as _cpu_name  # a seam: tests give it another CPU

FILE = "mode-probe.json"
VERSION = 2  # of a stored record's format
SAMPLE = 1 << 20  # bytes of a model file's head and tail that its identity digests
RETRY_S = 24 * 3600  # a busy or noisy record is measured again (in the background) after this long


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def _digest(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE))
        if size > 2 * SAMPLE:
            f.seek(size - SAMPLE)
        h.update(f.read(SAMPLE))
    return h.hexdigest()[:16]


def _file_identity(path: Path) -> list[Any]:
    """A local model by content: each file's name, size and digest (a folder: its files, by name)."""
    try:
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        out: list[Any] = []
        for p in files:
            size = p.stat().st_size
            out.append([p.name, size, _digest(p, size)])
        return out
    except OSError:
        return [path.name]


def _model_identity(name: str) -> list[Any]:
    from ..errors import ModelError
    from ..load import models

    try:
        spec = models.resolve(name)
    except (ModelError, OSError, ValueError):  # a derived draft ("int8", "layers:6", "trained"): the name is all there is
        return [name]
    if spec.kind in ("folder", "gguf"):
        return [spec.kind, *_file_identity(Path(spec.source))]
    return [spec.kind, spec.source]


def key_fields(config: EngineConfig, draft: str | None) -> dict[str, Any]:
    """Everything that can change which mode is fastest here: machine, model, draft and build."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {
        "cpu": _cpu_name(), "cores": cores, "gpus": gpus, "torch": _version("torch"), "ssd-chat": _version("ssd-chat"),
        "target": _model_identity(config.target), "draft": _model_identity(draft) if draft else None, "k": config.k,
        "dtype": config.dtype, "compile": config.compile, "target_device": config.target_device,
        "draft_device": config.draft_device, "fan_out": config.fan_out, "budget": config.budget,
        "cpu_kernels": os.environ.get("SSD_CHAT_CPU_KERNELS", ""),
        **({"attention": "numba"} if numba_attention() else {}),
    }


def key(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20]


def store_path() -> Path:
    return cache_dir() / FILE


# -- the load other processes put on the machine ---------------------------------------------------
@dataclass(frozen=True)
class Load:
    others: float  # cores' worth of CPU time other processes used while measuring
    loadavg: float  # the 1-minute load average at the end (the probe's own threads included)
    cores: int  # the machine's
    probe_cores: int  # the cores the probe's runs use

    def busy(self) -> bool:
        """Other work took more than the cores the probe leaves free (and at least half a core)."""
        return self.others > max(0.5, self.cores - self.probe_cores)

    def words(self) -> str:
        return f"other work {self.others:.1f} of {self.cores} cores, load average {self.loadavg:.1f}"


def _tree_ticks(root: int) -> int | None:
    """CPU ticks of ``root`` and its descendants, with the children each has waited for: a grandchild that has
    ended (a background compile, reaped by the forkserver) is counted in its parent's, not lost."""
    try:
        parent: dict[int, int] = {}
        ticks: dict[int, int] = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat", encoding="ascii", errors="replace") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            pid = int(d)
            parent[pid] = int(fields[1])
            ticks[pid] = sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
        total, todo = 0, [root]
        while todo:
            p = todo.pop()
            total += ticks.get(p, 0)
            todo += [c for c, pp in parent.items() if pp == p]
        return total
    except (OSError, ValueError, IndexError):
        return None


def _machine_ticks() -> tuple[int, int] | None:
    """(busy, total) ticks of all CPUs since boot."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return v[0] + v[1] + v[2] + v[5] + v[6] + v[7], sum(v)
    except (OSError, ValueError):
        return None


class Watch:
    """Measures what other processes did with the CPUs between its start and :meth:`stop`."""

    def __init__(self, probe_cores: int) -> None:
        self.probe_cores = probe_cores
        self.cores = os.cpu_count() or 1
        self.t0 = time.monotonic()
        self.m0, self.s0 = _machine_ticks(), _tree_ticks(os.getpid())

    def stop(self) -> Load:
        m1, s1 = _machine_ticks(), _tree_ticks(os.getpid())
        avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        if None in (self.m0, m1, self.s0, s1) or m1[1] <= self.m0[1]:  # no /proc: the load average less the probe's share
            others = max(0.0, avg - self.probe_cores)
        else:
            busy, total = m1[0] - self.m0[0], m1[1] - self.m0[1]
            others = max(0.0, (busy - (s1 - self.s0)) / total * self.cores)
        return Load(round(others, 2), round(avg, 2), self.cores, self.probe_cores)


# -- the records -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    result: dict[str, Any]  # probe.Result.to_json()
    verdict: str  # "ok", "busy" (other work during the runs), "noisy" (figures that cannot be right)
    why: str | None  # for busy / noisy
    at: float  # time.time() when measured
    load: Load

    def to_json(self, fields: dict[str, Any]) -> dict[str, Any]:
        return {"v": VERSION, "key": fields, "result": self.result, "verdict": self.verdict, "why": self.why,
                "at": self.at, "load": vars(self.load)}

    @classmethod
    def from_json(cls, d: Any) -> "Record | None":
        try:
            if d.get("v") != VERSION or d["verdict"] not in ("ok", "busy", "noisy"):
                return None
            load = Load(**{k: (int if k in ("cores", "probe_cores") else float)(d["load"][k]) for k in Load.__dataclass_fields__})
            return cls(d["result"], d["verdict"], d.get("why"), float(d["at"]), load)
        except (AttributeError, KeyError, TypeError, ValueError):
            return None

    def when(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(self.at))

    def stale(self) -> bool:
        """A busy or noisy record old enough for a start to measure again in the background."""
        return self.verdict != "ok" and time.time() - self.at > RETRY_S


def _read(path: Path) -> dict[str, Any]:
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return got if isinstance(got, dict) else {}


def read(fields: dict[str, Any], path: Path | None = None) -> Record | None:
    entry = _read(path or store_path()).get(key(fields))
    return Record.from_json(entry) if isinstance(entry, dict) else None


def write(fields: dict[str, Any], record: Record, path: Path | None = None) -> None:
    """Add ``record`` under ``fields``; a cache dir that cannot be written is left as it is."""
    path = path or store_path()
    data = _read(path)
    data[key(fields)] = record.to_json(fields)
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True, default=str))


# -- one measurer per key --------------------------------------------------------------------------
def lock_path(fields: dict[str, Any], path: Path | None = None) -> Path:
    return (path or store_path()).with_name(f"mode-probe-{key(fields)}.lock")


LOCK_FD = "SSD_CHAT_MEASURE_LOCK_FD"  # a measurer process's inherited, already locked descriptor


def take(fields: dict[str, Any], path: Path | None = None, wait: float = 0.0) -> int | None:
    """The key's lock: an open descriptor holding it, -1 when the cache dir cannot be written (nothing can
    be stored, so nothing is shared), or None when another process holds it for ``wait`` seconds.  The
    kernel drops it when every holder of the descriptor has exited, however it exits."""
    import fcntl

    p = lock_path(fields, path)
    inherited = os.environ.get(LOCK_FD)
    if inherited:
        try:
            fd = int(inherited)
            if os.fstat(fd).st_ino == os.stat(p).st_ino:  # the one a parent took for this key
                return fd
        except (OSError, ValueError):
            pass
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return -1
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.1)


@contextlib.contextmanager
def lock(fields: dict[str, Any], path: Path | None = None, wait: float = 0.0) -> Iterator[bool]:
    """Hold the key's lock for the block (:func:`take`): yields False when another process holds it (then
    do not measure)."""
    fd = take(fields, path, wait)
    try:
        yield fd is not None
    finally:
        if fd is not None and fd >= 0:
            os.close(fd)


def measuring(fields: dict[str, Any], path: Path | None = None) -> bool:
    """Whether another process holds the key's lock (is measuring it) now."""
    with lock(fields, path) as got:
        return not got
