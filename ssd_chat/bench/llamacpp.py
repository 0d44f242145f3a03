"""llama.cpp's ``llama-bench`` as the comparison point of ``ssd-chat bench --against llama.cpp PATH``.

It decodes the same GGUF file, on the same cores (the process is pinned to them, as the bench pins
its own modes), with the same number of new tokens and no prompt (``-p 0 -n N``: llama-bench's
``tg`` test), and reports its ``avg_ts`` (tokens per second, the mean of ``-r`` repetitions).
Nothing here builds or ships llama.cpp: PATH is a ``llama-bench`` binary the user built (for
example from the llama.cpp source vendored in the ``llama-cpp-python`` sdist), or a folder holding
one (``bin/`` or ``build/bin/`` inside it are searched too).

Every failure is a :class:`LlamaCppError` whose message is one line: a missing or non-executable
binary, a run that fails or hangs, output that is not llama-bench's JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

NAME = "llama.cpp"
BINARY = "llama-bench"
SEARCH = ("", "bin", "build/bin")  # inside a folder given as PATH


class LlamaCppError(Exception):
    """llama-bench could not be run or read (one line for the user)."""


@dataclass(frozen=True, slots=True)
class TgResult:
    tok_per_s: float  # llama-bench's avg_ts for the tg test
    stddev: float
    n_gen: int
    threads: int
    cores: tuple[int, ...] | None
    repetitions: int
    binary: str
    build: str  # llama.cpp's build commit and number
    model_type: str  # e.g. "llama ?B Q4_1"
    wall_s: float  # the whole llama-bench run (load, warm-up, repetitions)
    command: str

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cores": list(self.cores) if self.cores is not None else None}

    def describe(self) -> str:
        where = f"core{'s' if self.cores and len(self.cores) > 1 else ''} {','.join(map(str, self.cores))}" if self.cores else "any core"
        return (f"{NAME} llama-bench tg{self.n_gen}, {where}, {self.threads} thread{'s' if self.threads != 1 else ''}: "
                f"{self.tok_per_s:.1f} ± {self.stddev:.1f} tok/s")


def find_binary(path: str | Path) -> Path:
    """The llama-bench executable at ``path`` (the binary itself or a folder holding it)."""
    p = Path(path).expanduser()
    if p.is_dir():
        found = next((p / sub / BINARY for sub in SEARCH if (p / sub / BINARY).is_file()), None)
        if found is None:
            raise LlamaCppError(f"no {BINARY} in '{path}' (looked in {', '.join(str(p / s / BINARY) for s in SEARCH)})")
        p = found
    if not p.exists():
        raise LlamaCppError(f"{BINARY} not found: '{path}' does not exist")
    if not p.is_file() or not os.access(p, os.X_OK):
        raise LlamaCppError(f"'{p}' is not an executable file (expected llama.cpp's {BINARY})")
    return p


def run_tg(binary: str | Path, gguf: str | Path, n_gen: int, threads: int, cores: tuple[int, ...] | None = None,
           repetitions: int = 3, timeout_s: float = 900.0) -> TgResult:
    """Time llama-bench's token generation (``-p 0 -n n_gen``) on ``gguf`` with ``threads`` threads,
    pinned to ``cores`` (None: wherever the OS puts it)."""
    exe = find_binary(binary)
    gguf = Path(gguf)
    if not gguf.is_file():
        raise LlamaCppError(f"the GGUF file '{gguf}' does not exist")
    cmd = [str(exe), "-m", str(gguf), "-p", "0", "-n", str(int(n_gen)), "-t", str(int(threads)),
           "-r", str(int(repetitions)), "-o", "json"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                errors="replace")
    except OSError as e:  # exec format error, permissions changed meanwhile, ...
        raise LlamaCppError(f"could not start '{exe}': {e.strerror or e}") from None
    try:
        if cores is not None and hasattr(os, "sched_setaffinity"):
            # before it loads the model and starts its threads, which inherit the mask; if it exited already,
            # its exit status says why
            with contextlib.suppress(OSError):
                os.sched_setaffinity(proc.pid, cores)
        out, err = proc.communicate(timeout=timeout_s)
    except BaseException as e:  # a timeout, or Ctrl-C: never leave it running
        proc.kill()
        proc.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            raise LlamaCppError(f"{BINARY} did not finish within {timeout_s:.0f} s") from None
        raise
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), "no message")
        raise LlamaCppError(f"{BINARY} failed (exit status {proc.returncode}): {last[:300]}")
    entry = parse_tg(out, n_gen)
    build = f"{entry.get('build_commit', '?')} ({entry.get('build_number', '?')})"
    return TgResult(float(entry["avg_ts"]), float(entry.get("stddev_ts") or 0.0), int(n_gen), int(entry.get("n_threads", threads)),
                    tuple(cores) if cores is not None else None, int(repetitions), str(exe), build,
                    str(entry.get("model_type", "")), wall, " ".join(cmd))


def parse_tg(stdout: str, n_gen: int) -> dict[str, Any]:
    """The tg entry (``n_prompt`` 0, ``n_gen`` n_gen) of llama-bench's ``-o json`` output."""
    try:
        data = json.loads(stdout)
    except ValueError:
        raise LlamaCppError(f"{BINARY} printed no JSON results (is it llama.cpp's {BINARY}, recent enough for -o json?)") from None
    rows = data if isinstance(data, list) else [data]
    for row in rows:
        if isinstance(row, dict) and row.get("n_prompt") == 0 and row.get("n_gen") == n_gen:
            ts = row.get("avg_ts")
            if isinstance(ts, (int, float)) and ts > 0:
                return row
    raise LlamaCppError(f"{BINARY}'s JSON has no token-generation result for {n_gen} tokens")


def check_against(name: str, path: str, target_spec: Any) -> Path:
    """Checks for ``--against NAME PATH`` before anything loads: the tool, the binary, a GGUF target."""
    if name.strip().lower() != NAME:
        raise LlamaCppError(f"--against {name}: the only comparison is '{NAME}' (--against {NAME} PATH)")
    exe = find_binary(path)
    if getattr(target_spec, "kind", None) != "gguf":
        raise LlamaCppError(f"--against {NAME} times the same GGUF file, and the target '{getattr(target_spec, 'name', target_spec)}' is not a .gguf model")
    return exe


def against(exe: Path, gguf: str | Path, plans: list[Any], report: dict[str, Any], n_gen: int,
            progress: Any = None) -> list[str]:
    """Run llama-bench where each protocol runs AR (its cores and thread count), store the results
    and their ratios in ``report["against"]`` and return one line per protocol for the console."""
    done: dict[tuple, TgResult] = {}
    out: dict[str, Any] = {}
    lines = []
    for plan in plans:
        if plan.mode != "ar" or plan.cores is None:
            continue
        key = (plan.cores, plan.threads)
        if key not in done:
            if progress is not None:
                progress(f"timing {NAME} ({BINARY} -t {plan.threads}) on core(s) {','.join(map(str, plan.cores))}")
            done[key] = run_tg(exe, gguf, n_gen, plan.threads or len(plan.cores), plan.cores)
        tg = done[key]
        modes = report.get("protocols", {}).get(plan.protocol, {}).get("modes", {})
        ratios = {m: (v["tok_per_s"]["median"] / tg.tok_per_s if v.get("tok_per_s", {}).get("median") else None)
                  for m, v in modes.items()}
        out[plan.protocol] = {"llama_bench": tg.as_dict(), "ratio_to_llamacpp": ratios}
        shown = ", ".join(f"{m.upper()} {modes[m]['tok_per_s']['median']:.1f} tok/s = {r:.2f}×" for m, r in ratios.items() if r is not None)
        lines.append(f"{plan.protocol} protocol: {tg.describe()}; {shown or 'no ssd-chat result to compare'}")
    if not out:
        raise LlamaCppError(f"--against {NAME} compares CPU runs, and this benchmark ran none on the CPU")
    report["against"] = {NAME: out}
    return lines
