"""The GPU check's tensor-parallel step: what one GPU can show of it.

Tensor parallelism over 2 GPUs needs 2 GPUs; the lent machine has one.  So this step runs the
TP code path with a single rank (:class:`~ssd_chat.engine.tp.core.TPCore` over one GPU: the shard
loader and the parallel modules, compiled into CUDA graphs like the core; one rank makes no
collectives) and times it against the plain core on the same random target:

* ``TP=1 eager`` / ``TP=1 compiled``: target 1-row and k+1-row forwards, next to ``core eager`` /
  ``core compiled`` in the same table: the price of the TP code path itself;
* a check that TP=1 gives the core's greedy tokens (bf16: logits differ in the last bits);
* device_map over one GPU puts every layer on it, so it is the ``transformers`` column.

With two or more GPUs, :func:`run_multi` also runs TP=2 over ``cuda:0,cuda:1`` (NCCL, a rank
process of its own) on the draft-shaped model, saved to a temporary folder the ranks read their
shards from: greedy tokens and logits against the core on ``cuda:0``, 1-row and verify forwards,
eager and compiled.  ``--cpu-smoke`` runs that step over two gloo ranks on the CPU, so it is tested.
On one GPU it says it did not run: NCCL's all-reduce cost (or whether CUDA graphs capture it) and
TP=2's speed stay unmeasured there.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

NOT_MEASURED = ("TP=2 needs 2 GPUs: not measured on this one-GPU machine (nor device_map over 2 GPUs); "
                "device_map over one GPU is the transformers path (its column)")


def run(target: torch.nn.Module, prompt: list[int], k: int, reps: int, dev: torch.device, compile_mode: str,
        report: dict[str, Any], note: Callable[[str], None], median_ms: Callable[..., float],
        left: Callable[[], float]) -> None:
    """Add the TP=1 columns to ``report["forwards"]`` and ``report["tp"]``; raises on a failure."""
    from ssd_chat.engine.model.core import Core
    from ssd_chat.engine.tp.core import TPCore

    tp_report: dict[str, Any] = {"not_measured": NOT_MEASURED}
    report["tp"] = tp_report
    source = {n: t for n, t in target.state_dict().items()}  # one rank reads its tensors from memory
    dtype = next(target.parameters()).dtype
    ref = Core(target, "target")
    want = greedy(ref, prompt, 16)
    modes = ["eager"] + (["compiled"] if compile_mode == "on" else [])
    for mode in modes:
        if left() < 90:
            note(f"skipped TP=1 {mode}: {left():.0f} s of the budget left")
            continue
        path = f"TP=1 {mode}"
        t0 = time.perf_counter()
        tp = TPCore(source, [str(dev)], "target", dtype=dtype, compile="on" if mode == "compiled" else "off",
                    rows=(1, k + 1), config=target.config, progress=note)
        try:
            tp_report[f"{path} start_s"] = round(time.perf_counter() - t0, 1)
            tp_report["shard"] = tp.shards[0].line()
            got = greedy(tp, prompt, 16)
            tp_report[f"{path} greedy_equal_core"] = got == want
            tp.reset(), ref.reset()
            a = ref.append(prompt, logits="last").logits.float()
            b = tp.append(prompt, logits="last").logits.float()
            tp_report[f"{path} max_abs_logit_diff"] = round(float((a - b).abs().max()), 4)
            if path not in report["paths"]:
                report["paths"].append(path)
            for kind, rows in (("1 row", 1), ("verify", k + 1)):
                ids = [(r * 31 + 3) % 1000 + 1 for r in range(rows)]
                L = len(prompt)
                call = (lambda ids=ids, L=L: (tp.append(ids), tp.kv.truncate(L)))
                if mode == "compiled":
                    t1 = time.perf_counter()
                    torch.inference_mode()(call)()
                    report["compile_s"][f"target {kind} {path} ({rows} rows)"] = round(time.perf_counter() - t1, 1)
                report["forwards"][f"target {kind} {path} ms"] = median_ms(torch.inference_mode()(call), reps, dev)
        finally:
            tp.close()


def greedy(core: Any, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` on a Core or TPCore (the cache is left at the prompt)."""
    core.reset()
    lg = core.append(prompt, logits="last").logits[-1]
    out: list[int] = []
    while len(out) < n:
        out.append(int(lg.argmax()))
        lg = core.append(out[-1:], logits="last").logits[-1]
    core.kv.truncate(len(prompt))
    return out


def run_multi(model: torch.nn.Module, prompt: list[int], k: int, reps: int, devices: list[str], compile_mode: str,
              report: dict[str, Any], note: Callable[[str], None], median_ms: Callable[..., float],
              left: Callable[[], float]) -> None:
    """TP over ``devices`` (two: NCCL on GPUs, gloo on CPU) on ``model``; adds ``report["tp"]["TP=2 ..."]``
    with the 1-row and verify forwards of TP=2 and of the core (``1 row TP=2 eager ms``, ``1 row core eager ms``, ...);
    raises on a failure."""
    import tempfile

    from ssd_chat.engine.model.core import Core
    from ssd_chat.engine.tp.core import TPCore

    tp_report = report.setdefault("tp", {})
    if devices[0].startswith("cuda"):
        tp_report["not_measured"] = "device_map over 2 GPUs is not measured"
    dev = torch.device(devices[0])
    dtype = next(model.parameters()).dtype
    ref = Core(model, "model")
    want = greedy(ref, prompt, 16)
    with tempfile.TemporaryDirectory(prefix="gpucheck-tp-") as folder:
        t0 = time.perf_counter()
        model.save_pretrained(folder)
        tp_report["TP=2 saved_s"] = round(time.perf_counter() - t0, 1)
        for mode in ["eager"] + (["compiled"] if compile_mode == "on" and dev.type == "cuda" else []):  # CPU ranks: eager
            if left() < (90 if mode == "eager" else 240):
                note(f"skipped TP=2 {mode}: {left():.0f} s of the budget left")
                continue
            path = f"TP=2 {mode}"
            t0 = time.perf_counter()
            with TPCore(folder, devices, "model", dtype=dtype, compile="on" if mode == "compiled" else "off",
                        rows=(1, k + 1), progress=note) as tp:
                tp_report[f"{path} start_s"] = round(time.perf_counter() - t0, 1)
                tp_report[f"{path} shards"] = [s.line() for s in tp.shards]
                got = greedy(tp, prompt, 16)
                tp_report[f"{path} greedy_equal_core"] = got == want
                tp_report[f"{path} first_divergence"] = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
                tp.reset(), ref.reset()
                a = ref.append(prompt, logits="last").logits.float()
                b = tp.append(prompt, logits="last").logits.float()
                tp_report[f"{path} max_abs_logit_diff"] = round(float((a - b).abs().max()), 4)
                core = ref if mode == "eager" else Core(model, "model", compile="on", rows=(1, k + 1))
                core.reset(), core.append(prompt, logits="none")
                for kind, rows in (("1 row", 1), ("verify", k + 1)):
                    ids = [(r * 31 + 3) % 1000 + 1 for r in range(rows)]
                    L = len(prompt)
                    for name, c in ((f"core {mode}", core), (path, tp)):
                        call = (lambda ids=ids, L=L, c=c: (c.append(ids), c.kv.truncate(L)))
                        tp_report[f"{kind} {name} ms"] = median_ms(torch.inference_mode()(call), reps, dev)
