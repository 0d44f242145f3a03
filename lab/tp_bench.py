"""Per-forward cost of tensor parallelism on the CPU: one process against ranks over gloo.

    python -m lab.tp_bench [--rows 1,3,8] [--tree-from 6] [--context 200] [--reps 25] [--json PATH]

On the packaged SmolLM2-135M (fp32), eager (no compile), each call appending its rows after
``--context`` committed tokens and rolling back (rows >= ``--tree-from``: an SSD tree step).
Two phases, each timed interleaved (one call of each path per repetition, so a busy machine
slows all alike), medians:

1. ``core 1 thread`` (pinned to the first core), ``core 2 threads`` (both cores) and
   ``TP 2 ranks`` (ranks on the first and second core, one thread each, gloo);
2. ``core 1 thread`` against ``TP 1 rank``: the same code path with no other rank (what the
   shard modules and the command protocol cost by themselves).

One process per machine can hold the ranks (torch.distributed's default group), so the two
TP paths run one after the other.  The load average is printed with the numbers: on a shared
machine they say little beyond their order.  Needs two CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any, Callable

import torch

from .core_bench import timed


@contextlib.contextmanager
def pinned(cores: tuple[int, ...]) -> Iterator[None]:
    old_aff, old_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, old_aff)
        torch.set_num_threads(old_threads)


def call(core: Any, rows: int, tree: bool, cores: tuple[int, ...] | None = None) -> Callable[[], None]:
    def run() -> None:
        with pinned(cores) if cores else contextlib.nullcontext():
            L = core.kv.length
            ids = [(17 * b + 5) % 1000 + 10 for b in range(rows)]
            if tree:  # depth 0 of an SSD tree: every row sees the prefix and itself
                core.tree(ids, [L] * rows, [L + b for b in range(rows)], [[] for _ in range(rows)])
            else:
                core.append(ids)
                core.kv.truncate(L)
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.tp_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,3,8")
    ap.add_argument("--tree-from", type=int, default=6)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from ssd_chat.engine.cpu import fastlinear
    from ssd_chat.engine.load import models
    from ssd_chat.engine.model.core import Core
    from ssd_chat.engine.tp.core import TPCore

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        log("tp_bench: needs two CPU cores")
        return 1
    c0, c01 = (cores[0],), (cores[0], cores[1])
    lm = models.load_model(models.PACKAGED, models.parse_placement("cpu", "float32"), progress=lambda s, f: log(s))
    for cs in (c0, c01):
        with pinned(cs):
            fastlinear.prepare()  # the fast path's choices for 1 and 2 threads
    prompt = [(i * 37) % 5000 + 10 for i in range(args.context)]
    core = Core(lm.model, lm.name)
    core.append(prompt, logits="none")
    rows_list = [int(r) for r in args.rows.split(",")]
    load0 = os.getloadavg()
    results: list[dict[str, Any]] = []
    for world in (2, 1):
        tp = TPCore(lm.folder, ["cpu"] * world, lm.name, dtype=torch.float32, cores=[(c,) for c in cores[:world]], progress=log)
        try:
            tp.append(prompt, logits="none")
            for rows in rows_list:
                tree = rows >= args.tree_from
                paths = {"core 1 thread": call(core, rows, tree, c0)}
                if world == 2:
                    paths["core 2 threads"] = call(core, rows, tree, c01)
                paths[f"TP {world} rank{'s' if world > 1 else ''}"] = call(tp, rows, tree)
                row = {"phase": world, "rows": rows, "kind": "tree" if tree else ("1 row" if rows == 1 else "verify"),
                       **timed(paths, args.reps)}
                log(json.dumps(row))
                results.append(row)
        finally:
            tp.close()
    load1 = os.getloadavg()
    cols = ["phase", "kind", "rows", "core 1 thread ms", "core 2 threads ms", "TP 2 ranks ms", "TP 1 rank ms"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r.get(c, "—")) for c in cols) + " |")
    print(f"\nload average (1, 5, 15 min): {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} before, "
          f"{load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} after; torch {torch.__version__}, cores {cores}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"torch": torch.__version__, "load_before": load0, "load_after": load1, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
