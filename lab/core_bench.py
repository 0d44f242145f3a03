"""Per-forward cost of the compact core against the transformers path, on the packaged model.

    python -m lab.core_bench [--threads 1,2] [--rows 1,3,6,8] [--context 200] [--reps 25]
                                  [--compile | --no-compile] [--json PATH]

For each thread count and row count it times, interleaved (one call of each path per
repetition, so a busy machine slows all of them alike), the median of:

* ``transformers``: the model as ``models.load_model`` gives it to the app (fastlinear and the GQA
  attention installed) on a ``DynamicCache``: 1 row and k+1 rows as ``kv.forward``, B tree
  rows as the SSD speculator calls it (4D mask, explicit positions);
* ``core eager``: :class:`~ssd_chat.engine.model.core.Core` uncompiled (its projections are the
  same fastlinear modules);
* ``core compiled``: the same with ``compile="on"`` for every row count; the first call of
  each shape is the compile time (inductor's on-disk cache makes a second run faster).

Each timed call appends its rows after ``--context`` committed tokens and rolls back.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch


def timed(paths: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """``{"<name> ms": median wall ms}`` of each path after one warm-up call each, timed interleaved
    (one call of each path per repetition, so a busy machine slows all of them alike)."""
    for f in paths.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(reps):
        for name, f in paths.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {f"{k} ms": round(statistics.median(v) * 1e3, 2) for k, v in times.items()}


def _tree_args(L: int, rows: int) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """A tree step of ``rows`` branches over a committed prefix of L tokens, at depth 0 (each row sees
    the prefix and itself), as the SSD speculator's first tree forward."""
    ids = [(17 * b + 5) % 1000 + 10 for b in range(rows)]
    return ids, [L] * rows, [L + b for b in range(rows)], [[] for _ in range(rows)]


def _hf_call(model: Any, rows: int, tree: bool) -> Callable[[Any, int], None]:
    from ssd_chat.engine.model import runner as kv

    def run(cache: Any, L: int) -> None:
        if not tree:
            kv.forward(model, torch.arange(rows) + 10, cache)
        else:  # the speculator's tree step: prefix + itself, RoPE position L
            dtype = model.get_input_embeddings().weight.dtype
            mask = torch.cat([torch.ones(rows, L, dtype=torch.bool), torch.eye(rows, dtype=torch.bool)], dim=1)
            attn = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)[None, None]
            with torch.inference_mode():
                model(input_ids=torch.tensor(_tree_args(L, rows)[0])[None], cache=cache, use_cache=True,
                      position_ids=torch.full((1, rows), L), attention_mask=attn)
        kv.truncate(cache, L)
    return run


def _core_call(core: Any, rows: int, tree: bool) -> Callable[[], None]:
    def run() -> None:
        L = core.kv.length
        if tree:
            core.tree(*_tree_args(L, rows))
        else:
            core.append(list(range(10, 10 + rows)))
            core.kv.truncate(L)
    return run


def measure(lm: Any, threads: int, rows_list: list[int], context: int, reps: int, compile_on: bool,
            tree_from: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    from ssd_chat.engine.cpu import fastlinear
    from ssd_chat.engine.model import runner as kv
    from ssd_chat.engine.model.core import Core

    torch.set_num_threads(threads)
    fastlinear.prepare()  # the fast path's choices for this thread count (timed once per machine)
    model = lm.model
    prompt = [(i * 37) % 5000 + 10 for i in range(context)]
    cache = kv.new_cache(model)
    kv.forward(model, torch.tensor(prompt), cache, last_only=True)
    eager = Core(model, lm.name)
    eager.append(prompt, logits="none")
    comp = None
    if compile_on:
        comp = Core(model, lm.name, compile="on", rows=tuple(rows_list), progress=log, notify=log)
        comp.append(prompt, logits="none")
    out = []
    for rows in rows_list:
        tree = rows >= tree_from
        paths: dict[str, Callable[[], None]] = {"transformers": (lambda f=_hf_call(model, rows, tree): f(cache, context)),
                                                 "core eager": _core_call(eager, rows, tree)}
        row: dict[str, Any] = {"threads": threads, "rows": rows, "kind": "tree" if tree else ("1 row" if rows == 1 else "verify")}
        if comp is not None:
            t0 = time.perf_counter()
            _core_call(comp, rows, tree)()
            row["compile_s"] = round(time.perf_counter() - t0, 1)
            if comp.compiler.failed:
                row["compile_failed"] = comp.compiler.failed
            else:
                paths["core compiled"] = _core_call(comp, rows, tree)
        row.update(timed(paths, reps))
        log(json.dumps(row))
        out.append(row)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["threads", "kind", "rows", "transformers ms", "core eager ms", "core compiled ms", "compile_s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "—")) for c in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.core_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,3,6,8")
    ap.add_argument("--tree-from", type=int, default=6, help="row counts from this one are timed as SSD tree steps")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from ssd_chat.engine.load import models

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    lm = models.load_model(models.PACKAGED, models.parse_placement("cpu", "float32"), progress=lambda s, f: log(s))
    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        results += measure(lm, threads, [int(r) for r in args.rows.split(",")], args.context, args.reps, args.compile,
                           args.tree_from, log)
    print(table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
