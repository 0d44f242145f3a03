"""Simulated hardware: the real decoders with every forward padded to a latency model.

``ssd-chat bench --simulate PROFILE`` runs AR, SD and SSD (every process and line of Python) on
small models, and makes each forward of the compact core last what the profile (a JSON file in
``assets/profiles``, :func:`load_profile`) says the real model takes on the real hardware: the
forward computes, then sleeps until the modelled time has passed (longer real compute counts as an
overrun).  Padding only sleeps, so tokens are exactly what they would be.  With ``shared_device``
a forward holds one device (a lock file shared by the processes) for its modelled time, so the
verifier and the speculator take turns.  :func:`activate` switches it on through the environment
(``SSD_CHAT_SIMULATE``), for the speculator processes too.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

ENV = "SSD_CHAT_SIMULATE"


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class Cost:
    """One model's forward time: ``step_ms`` for up to ``flat_rows`` rows (the GPU regime: rows are
    nearly free until the matrix units fill), then ``per_row_ms`` for each further row (a prefill)."""

    step_ms: float
    flat_rows: int = 8
    per_row_ms: float = 0.0

    def ms(self, rows: int) -> float:
        return self.step_ms + max(0, rows - self.flat_rows) * self.per_row_ms


@dataclass(frozen=True)
class Profile:
    name: str
    title: str
    target: Cost
    draft: Cost
    k: int  # draft tokens per round (the setup's own)
    fan_out: str  # SSD's fan-out for it
    acceptance: float  # the per-token acceptance of the setup (greedy)
    acceptance_source: str
    shared_device: bool = False
    paper: dict[str, float] | None = None  # published tok/s {ar, sd, ssd} for this setup
    sources: tuple[str, ...] = ()
    derivation: str = ""

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def _profile_dir() -> Path:
    return Path(str(resources.files("ssd_chat.assets"))) / "profiles"


def names() -> list[str]:
    return sorted(p.stem for p in _profile_dir().glob("*.json"))


def load_profile(name: str) -> Profile:
    """A profile by name (``assets/profiles/NAME.json``) or by the path of a JSON file."""
    path = Path(name)
    if not (path.suffix == ".json" and path.is_file()):
        path = _profile_dir() / f"{name}.json"
        if not path.is_file():
            raise ProfileError(f"unknown profile '{name}' (profiles: {', '.join(names())}; or the path of a .json file)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        costs = {r: Cost(**raw.pop(r)) for r in ("target", "draft")}
        prof = Profile(**{**raw, **costs, "sources": tuple(raw.get("sources", ()))})
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ProfileError(f"profile {path}: {e}") from None
    if not (0.0 < prof.acceptance < 1.0) or prof.k < 1 or min(prof.target.step_ms, prof.draft.step_ms) <= 0:
        raise ProfileError(f"profile {path}: acceptance must lie in (0, 1), k >= 1 and the step times > 0")
    return prof


@dataclass
class Tally:
    """What the padding did in this process, per role."""

    forwards: int = 0
    modelled_s: float = 0.0
    compute_s: float = 0.0
    overruns: int = 0  # forwards whose compute took longer than the model
    slack_s: float = 0.0  # sleeping past the modelled end (the OS timer)
    device_wait_s: float = 0.0  # waiting for the shared device

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass
class Padding:
    profile: Profile
    lock_path: str | None
    tallies: dict[str, Tally] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._mutex = threading.Lock()  # the device is one per process too (the verifier's threads)
        self._fd: int | None = None

    @contextlib.contextmanager
    def forward(self, role: str, rows: int) -> Iterator[None]:
        """Hold the (shared) device, compute, then sleep until the modelled time has passed."""
        cost = self.profile.target if role == "target" else self.profile.draft
        want = cost.ms(rows) / 1e3
        tally = self.tallies.setdefault(role, Tally())
        with self._device(tally):
            t0 = time.perf_counter()
            yield
            compute = time.perf_counter() - t0
            if compute < want:
                _wait_until(t0 + want)
            else:
                tally.overruns += 1
            tally.slack_s += max(0.0, time.perf_counter() - t0 - max(want, compute))
        tally.forwards += 1
        tally.modelled_s += want
        tally.compute_s += compute

    @contextlib.contextmanager
    def _device(self, tally: Tally) -> Iterator[None]:
        if not self.profile.shared_device or not self.lock_path:
            yield
            return
        t0 = time.perf_counter()
        with self._mutex:
            if self._fd is None:
                self._fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            tally.device_wait_s += time.perf_counter() - t0
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)


SPIN_S = 0.0004  # the OS wakes a sleeper up to ~0.2 ms late: sleep to this close, then spin


def _wait_until(end: float) -> None:
    left = end - time.perf_counter()
    if left > SPIN_S:
        time.sleep(left - SPIN_S)
    while time.perf_counter() < end:
        pass


_active: list[Padding | None] = []  # this process's padding, read once from the environment


def slowed(prof: Profile, scale: float) -> Profile:
    """The profile's hardware ``scale`` times slower (slow motion: a CPU whose real forwards are slower
    than the modelled GPU's can still keep to it; the caller divides the clock it reads by ``scale``)."""
    if scale == 1.0:
        return prof
    cost = {r: Cost(c.step_ms * scale, c.flat_rows, c.per_row_ms * scale) for r, c in (("target", prof.target), ("draft", prof.draft))}
    return Profile(**{**prof.describe(), **cost, "sources": prof.sources})


def activate(profile_name: str, lock_path: str | None, tally_dir: str | None = None, scale: float = 1.0) -> Padding:
    """Switch simulation on for this process and the processes it starts from now on; each of those
    writes its tallies to ``tally_dir`` when it exits (:func:`child_tallies`).  ``scale``: :func:`slowed`."""
    os.environ[ENV] = json.dumps({"profile": profile_name, "lock": lock_path, "tallies": tally_dir, "parent": os.getpid(),
                                  "scale": scale})
    _active.clear()
    return active()  # type: ignore[return-value]


def child_tallies(tally_dir: str) -> dict[str, dict[str, Any]]:
    """The tallies the processes started under simulation wrote, summed per role."""
    out: dict[str, Tally] = {}
    for f in sorted(Path(tally_dir).glob("*.json")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            for role, t in json.loads(f.read_text()).items():
                acc = out.setdefault(role, Tally())
                for key, v in t.items():
                    setattr(acc, key, getattr(acc, key) + v)
    return {role: t.as_dict() for role, t in out.items()}


def _write_tallies(pad: Padding, tally_dir: str) -> None:
    with contextlib.suppress(OSError):
        Path(tally_dir, f"{os.getpid()}.json").write_text(json.dumps({r: asdict(t) for r, t in pad.tallies.items()}))


def deactivate() -> None:
    os.environ.pop(ENV, None)
    _active.clear()


def active() -> Padding | None:
    if not _active:
        raw = os.environ.get(ENV)
        if not raw:
            _active.append(None)
        else:
            spec = json.loads(raw)
            pad = Padding(slowed(load_profile(spec["profile"]), spec.get("scale", 1.0)), spec.get("lock"))
            _active.append(pad)
            if spec.get("tallies") and spec.get("parent") != os.getpid():  # a speculator: its figures outlive it
                atexit.register(_write_tallies, pad, spec["tallies"])
    return _active[0]


def latency(role: str) -> Any:
    """The hook a core of this role calls around each forward (None: not simulating)."""
    pad = active()
    if pad is None:
        return None
    return lambda rows: pad.forward(role, rows)


def bounds(prof: Profile, tokens_per_round: float, k: int, hit_rate: float) -> dict[str, float]:
    """Analytical tok/s with no overhead, for rounds that emit ``tokens_per_round`` (accepted + bonus):
    AR one step per token; SD k draft steps and a verify per round; SSD a verify per round, or the
    speculator's glue and k tree depths where they take longer (or must take turns with it on a shared
    device), plus the k fallback steps on a miss."""
    e = tokens_per_round
    tv, td = prof.target.ms(k + 1), prof.draft.ms(1)
    tree = (k + 1) * td  # glue + k tree depths, each a flat multi-row step
    hit_round = tv + tree if prof.shared_device else max(tv, tree)
    return {"ar": 1e3 / prof.target.ms(1), "sd": 1e3 * e / (k * td + tv),
            "ssd": 1e3 * e / (hit_round + (1 - hit_rate) * k * td), "ssd_all_hits": 1e3 * e / hit_round}
