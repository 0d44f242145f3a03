"""CPU decoding in the GGUF's own precision against llama.cpp, on the packaged model, in one command.

    python -m lab.cpu_perf [--llama-bench PATH] [--tokens 64] [--compile] [--json out.json]
                                [--sections bandwidth,linears,core,ar,app,accuracy,drafts,llama]

Sections (docs/performance-cpu.md shows a run):

* ``bandwidth``: GB/s a torch sum reads (512 MB), 1 thread.
* ``linears``: the 211 linears of one forward, float32 ``F.linear`` against the GGUF kernels
  (quant.GGUFLinear), at 1/3/6/8 rows; MB per forward and the bound MB / bandwidth.
* ``core``: one compact-core forward (engine/model/core.py) of 1 row, a verify of 3 rows and SSD tree
  steps of 6 and 8 rows after 200 tokens: float32 core (fastlinear, as the app loads it), GGUF
  core, GGUF core with row-independent attention, and with ``--compile`` the compiled GGUF core.
* ``ar``: greedy decoding with the GGUF core (one token per forward): tok/s.
* ``app``: the app's AR decoder (transformers' forward), GGUF precision and ``--dtype float32``:
  CPU ms per token, and whether both gave the same greedy tokens.
* ``accuracy``: GGUF core against the float32 core: greedy agreement over 8 prompts x 32 tokens
  and the max abs difference of the logits of the steps fed the same tokens.
* ``drafts``: acceptance and cost of each SSD draft candidate (see :mod:`lab.cpu_perf_drafts`; helpers in :mod:`lab.cpu_perf_common`).
* ``llama``: llama-bench's tg on the same GGUF, ``-t 1`` on core 0 and ``-t 2`` on cores 0,1.

One-thread measurements are pinned to core 0 and report this thread's CPU time (fastest and
median of the repetitions): on a shared machine wall time also counts waiting for other
processes.  Two-thread ones (cores 0 and 1) report wall time and can only be trusted on a quiet
machine.  Every section records the load average when it ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from .cpu_perf_common import Models, forward, greedy, load_average, log, pin, timed

SECTIONS = ("bandwidth", "linears", "core", "ar", "app", "accuracy", "drafts", "llama")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at",
           "List three primary colors:", "import numpy as np\n", "The quick brown fox", "In 1969, astronauts"]


def bandwidth(mb: int = 512) -> dict[str, Any]:
    pin((0,), 1)
    a = torch.ones(mb << 18)
    best = min(timed(lambda: a.sum(), 5, 1)["min_ms"], 1e9)
    return {"GB_per_s": round(a.numel() * 4 / best / 1e6, 2), "load": load_average()}


def linears(m: Models, rows_list: list[int], reps: int) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    pin((0,), 1)
    names = [n for n in m.gguf if n != "lm_head"] + ["lm_head"]
    subs = dict(m.model.named_modules())
    dense = {n: m.gguf[n].dense for n in names}
    fp32_mb = sum(w.numel() * 4 for w in dense.values()) / 1e6
    gguf_mb = sum(m.gguf[n].nbytes for n in names) / 1e6
    out = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in {subs[n].in_features for n in names}}
        with torch.inference_mode():
            f32 = timed(lambda: [F.linear(xs[w.shape[1]], w) for w in dense.values()], reps, 1)
            g = timed(lambda: [m.gguf[n](xs[m.gguf[n].in_features]) for n in names], reps, 1)
        out.append({"rows": rows, "fp32_MB": round(fp32_mb, 1), "gguf_MB": round(gguf_mb, 1), "fp32": f32, "gguf": g, "load": load_average()})
        log(f"linears {rows} rows: fp32 {f32['min_ms']} ms, gguf {g['min_ms']} ms (load {load_average()})")
    return out


def cores_section(m: Models, rows_list: list[int], reps: int, threads: int, compile_on: bool) -> list[dict[str, Any]]:
    from ssd_chat.engine.cpu import fastlinear
    from ssd_chat.engine.model.core import Core

    pin((0,) if threads == 1 else (0, 1), threads)
    fastlinear.prepare()
    ctx = [(i * 37) % 5000 + 10 for i in range(200)]
    m.swapped(False)
    paths = {"fp32 core": Core(m.model, "fp32")}
    m.swapped(True)
    paths["gguf core"] = Core(m.model, "gguf")
    paths["gguf core, row attention"] = Core(m.model, "gguf-rows", row_attention=True)
    if compile_on:
        paths["gguf core compiled"] = Core(m.model, "gguf-compiled", compile="on", rows=tuple(rows_list), progress=log, notify=log)
    out = []
    with torch.inference_mode():
        for c in paths.values():
            m.swapped(c.name != "fp32")  # the fp32 core calls the model's modules: put its float32 ones back
            c.append(ctx, logits="none")
        for rows in rows_list:
            row: dict[str, Any] = {"threads": threads, "rows": rows, "kind": "tree" if rows >= 6 else "verify" if rows > 1 else "1 row"}
            for name, c in paths.items():
                m.swapped(c.name != "fp32")
                t0 = time.perf_counter()
                f = forward(c, rows, rows >= 6)
                f()
                if c.compiler.active:
                    row[f"{name} first call s"] = round(time.perf_counter() - t0, 1)
                row[name] = timed(f, reps, threads)
            row["load"] = load_average()
            log(f"core {threads} thr {rows} rows: " + ", ".join(f"{k} {v['min_ms']}" for k, v in row.items() if isinstance(v, dict)))
            out.append(row)
    m.swapped(True)
    return out


def ar(m: Models, tokens: int, row_attention: bool) -> dict[str, Any]:
    from ssd_chat.engine.model.core import Core

    pin((0,), 1)
    m.swapped(True)
    core = Core(m.model, "gguf", row_attention=row_attention)
    prompt = m.lm.tokenizer(PROMPTS[0])["input_ids"]
    with torch.inference_mode():
        greedy(core, prompt, 4)
        _, _, cpu = greedy(core, prompt, tokens)
        _, _, wall = greedy(core, prompt, tokens, time.perf_counter)
    step = statistics.median(cpu)
    return {"tokens": tokens, "step_cpu_ms_median": round(step * 1e3, 2), "tok_per_s_cpu": round(1 / step, 1),
            "step_wall_ms_median": round(statistics.median(wall) * 1e3, 2), "tok_per_s_wall": round(1 / statistics.median(wall), 1),
            "row_attention": row_attention, "load": load_average()}


def app_ar(m: Models, gguf: bool, n_lo: int = 16, n_hi: int = 80) -> dict[str, Any]:
    """The app's AR decoder (transformers' forward over the KV cache, what ``ask --mode ar`` and the
    bench run), one thread: CPU ms per token from the difference of a long and a short greedy reply."""
    from ssd_chat.engine.decode.ar import ARDecoder
    from ssd_chat.engine.load.chat import prompt_ids
    from ssd_chat.engine.params import SamplingParams

    pin((0,), 1)
    m.swapped(gguf)
    ids, _ = prompt_ids(m.lm.tokenizer, [{"role": "user", "content": "Write a short poem about the sea."}])
    dec = ARDecoder(m.lm, "off")  # the float32 kernels eagerly: GGUF against float32 on the same arithmetic

    def cpu_of(n: int) -> tuple[float, tuple[int, ...]]:
        t0 = time.thread_time()
        done = list(dec.stream(ids, SamplingParams(max_new_tokens=n, ignore_eos=True)))[-1]
        return time.thread_time() - t0, done.token_ids

    cpu_of(4)
    lo = min(cpu_of(n_lo)[0] for _ in range(2))
    hi, toks = min(cpu_of(n_hi) for _ in range(2))
    ms = (hi - lo) / (n_hi - n_lo) * 1e3
    m.swapped(True)
    return {"precision": "gguf Q4_1" if gguf else "float32", "cpu_ms_per_token": round(ms, 2), "tok_per_s_cpu": round(1e3 / ms, 1),
            "tokens": list(toks), "load": load_average()}


def accuracy(m: Models, tokens: int) -> dict[str, Any]:
    from ssd_chat.engine.model.core import Core

    pin((0,), 1)
    agree = total = 0
    worst = 0.0
    with torch.inference_mode():
        for p in PROMPTS:
            ids = m.lm.tokenizer(p)["input_ids"]
            m.swapped(False)
            ref_toks, ref_logits, _ = greedy(Core(m.model, "fp32"), ids, tokens)
            m.swapped(True)
            toks, logits, _ = greedy(Core(m.model, "gguf", row_attention=True), ids, tokens)
            n = next((i for i, (a, b) in enumerate(zip(toks, ref_toks)) if a != b), len(toks))
            agree, total = agree + n, total + len(toks)
            worst = max(worst, max((a - b).abs().max().item() for a, b in zip(logits[: n + 1], ref_logits[: n + 1])))
    return {"greedy_agreement": f"{agree}/{total}", "logits_max_abs_diff": worst, "prompts": len(PROMPTS), "tokens": tokens}


def llama_cpu_ms_per_token(binary: str, gguf: str, threads: int, cores: tuple[int, ...] | None = None,
                           n_lo: int = 16, n_hi: int = 80, repetitions: int = 3) -> float:
    """CPU time (user + system, all its threads) llama-bench spends per generated token: the
    difference between a long and a short tg run, so loading and warm-up cancel out.  On a busy
    machine this is what a quiet core would take; wall time there also counts waiting for others."""
    import resource

    from ssd_chat.bench import llamacpp

    def cpu_of(n: int) -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        llamacpp.run_tg(binary, gguf, n, threads, cores, repetitions)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

    return (cpu_of(n_hi) - cpu_of(n_lo)) / (repetitions * (n_hi - n_lo)) * 1e3


def llama(exe: str, gguf: str, tokens: int) -> dict[str, Any]:
    from ssd_chat.bench import llamacpp

    out: dict[str, Any] = {}
    for threads, cores in ((1, (0,)), (2, (0, 1))):
        tg = llamacpp.run_tg(exe, gguf, tokens, threads, cores, repetitions=5)
        cpu = llama_cpu_ms_per_token(exe, gguf, threads, cores)
        out[f"t{threads}"] = {**tg.as_dict(), "cpu_ms_per_token": round(cpu, 2), "tok_per_s_by_cpu": round(1e3 / cpu, 1), "load": load_average()}
        log(f"llama.cpp -t {threads}: {tg.tok_per_s:.1f} tok/s wall, {cpu:.2f} ms CPU per token (load {load_average()})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.cpu_perf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench (or its build folder)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens of the AR run and of llama-bench's tg")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", default="1,3,6,8")
    ap.add_argument("--compile", action="store_true", help="also the compiled GGUF core (minutes per row shape the first time)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    want = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = [s for s in want if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {', '.join(bad)} (use {', '.join(SECTIONS)})")
    if "llama" in want and not a.llama_bench:
        want.remove("llama")
        log("no --llama-bench: skipping the llama.cpp section")
    rows = [int(r) for r in a.rows.split(",")]
    res: dict[str, Any] = {"command": " ".join(["python -m lab.cpu_perf", *(argv if argv is not None else sys.argv[1:])]),
                           "machine": machine(), "load_start": load_average()}
    m = Models()
    res["start"] = {"model_load_s": round(m.load_s, 2), "gguf_linears_s": round(m.gguf_s, 2),
                    "gguf_cache": str(m.lm.folder), "gguf_MB": round(sum(g.nbytes for g in m.gguf.values()) / 1e6, 1)}
    if "bandwidth" in want:
        res["bandwidth"] = bandwidth()
        log(f"bandwidth {res['bandwidth']}")
    if "linears" in want:
        res["linears"] = linears(m, rows, a.reps)
    if "core" in want:
        res["core"] = cores_section(m, rows, a.reps, 1, a.compile) + cores_section(m, rows, a.reps, 2, False)
    if "ar" in want:
        res["ar"] = [ar(m, a.tokens, ra) for ra in (False, True)]
        log(f"ar {res['ar']}")
    if "app" in want:
        res["app"] = [app_ar(m, g) for g in (True, False)]
        res["app_same_tokens"] = res["app"][0]["tokens"] == res["app"][1]["tokens"]
        log(f"app AR: {[(r['precision'], r['cpu_ms_per_token']) for r in res['app']]}, same tokens {res['app_same_tokens']}")
    if "accuracy" in want:
        res["accuracy"] = accuracy(m, 32)
        log(f"accuracy {res['accuracy']}")
    if "drafts" in want:
        from . import cpu_perf_drafts

        res["drafts"] = cpu_perf_drafts.run(m, a.reps, log)
    if "llama" in want:
        res["llama"] = llama(a.llama_bench, str(m.path), a.tokens)
    res["load_end"] = load_average()
    res["summary"] = summary(res)
    for line in res["summary"]:
        print(line)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


def machine() -> dict[str, Any]:
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo", encoding="utf-8") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version()}


def summary(res: dict[str, Any]) -> list[str]:
    """The lines docs/performance-cpu.md quotes."""
    out = [f"machine: {res['machine']['cpu']}, cores {res['machine']['cores']}, load average {res['load_start']} -> {res['load_end']}"]
    bw = res.get("bandwidth", {}).get("GB_per_s")
    mb = res["start"]["gguf_MB"]
    if bw:
        out.append(f"bound: {mb} MB per forward / {bw} GB/s = {mb / bw:.2f} ms ({1e3 * bw / mb:.0f} tok/s)")
    ar_ = {r["row_attention"]: r for r in res.get("ar", [])}
    t1 = res.get("llama", {}).get("t1")
    for ra, r in ar_.items():
        line = (f"AR, GGUF core{' + row attention' if ra else ''}, 1 thread: {r['tok_per_s_cpu']} tok/s by CPU time "
                f"({r['tok_per_s_wall']} wall, load {r['load']})")
        if t1:
            line += f"; llama.cpp -t 1: {t1['tok_per_s_by_cpu']} tok/s by CPU time ({t1['tok_per_s']:.1f} wall): {r['tok_per_s_cpu'] / t1['tok_per_s_by_cpu']:.2f}x"
        out.append(line)
    for r in res.get("app", []):
        line = f"app AR ({r['precision']}), 1 thread: {r['tok_per_s_cpu']} tok/s by CPU time ({r['cpu_ms_per_token']} ms per token, load {r['load']})"
        if t1:
            line += f"; {r['tok_per_s_cpu'] / t1['tok_per_s_by_cpu']:.2f}x llama.cpp -t 1"
        out.append(line)
    if "accuracy" in res:
        acc = res["accuracy"]
        out.append(f"GGUF core vs float32 core: greedy agreement {acc['greedy_agreement']}, logits max abs diff {acc['logits_max_abs_diff']:.2e}")
    best = (res.get("drafts") or {}).get("best_ssd")
    t2 = res.get("llama", {}).get("t2")
    if best:
        line = f"equal protocol, SSD estimate (verifier core 0 + speculator core 1, draft {best['draft']}, k={best['k']}): {best['ssd_tok_per_s']} tok/s"
        if t2:
            line += f"; llama.cpp -t 2 on cores 0,1: {t2['tok_per_s']:.1f} tok/s wall (load {t2['load']}): {best['ssd_tok_per_s'] / t2['tok_per_s']:.2f}x"
        out.append(line)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
