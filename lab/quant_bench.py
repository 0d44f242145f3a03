"""Measure the CPU routes for the packaged GGUF's linear layers (docs/quant.md has the results).

    python -m lab.quant_bench [--threads 1 2] [--rows 1 3 8] [--repeats 5] [--json out.json]
    python -m lab.quant_bench --decode [--threads 1 2] [--tokens 32]

For each thread count: memory read bandwidth (a torch sum over 512 MB), then the time of all
211 linears of one forward (30 layers' seven projections + the 49152-row head) at each row count,
per route, fastest of ``--repeats`` passes; each pass multiplies every distinct weight once, so the
weights stream from memory as in decoding.  Routes that do not reproduce the checkpoint exactly
say so in their name.

``--decode``: greedy decoding of the whole model (transformers' forward with its KV cache, one
token per step) with the float32 weights (the app's path) and with the GGUF linears swapped in:
per route: time per step (median), greedy agreement with the float32 model (tokens before the
first difference) and the max abs difference of the logits of the steps fed the same tokens,
over eight prompts.  Times at one thread are this thread's CPU time (see main).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

import numpy as np

from ssd_chat.engine.load import gguf_map, models
from ssd_chat.engine.cpu import quant


def bandwidth(threads: int, mb: int = 512, repeats: int = 5) -> float:
    """GB/s a torch sum reads (by this thread's CPU time at one thread, see main)."""
    torch.set_num_threads(threads)
    a = torch.ones(mb << 18)  # float32: mb MiB
    a.sum()
    clock = time.thread_time if threads == 1 else time.perf_counter
    best = min(_timed(lambda: a.sum(), clock) for _ in range(repeats))
    return a.numel() * 4 / best / 1e9


def _timed(f: Callable[[], Any], clock: Callable[[], float] = time.perf_counter) -> float:
    t = clock()
    f()
    return clock() - t


class Fn(torch.nn.Module):
    """A linear computed by ``f`` on 2-D float32 rows (any leading shape in, float32 out)."""

    def __init__(self, f: Callable[[torch.Tensor], torch.Tensor], out_features: int) -> None:
        super().__init__()
        self.f, self.out_features = f, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x.reshape(-1, x.shape[-1])).float().reshape(*x.shape[:-1], self.out_features)


def routes(model: torch.nn.Module, gguf: Any) -> dict[str, tuple[dict[str, torch.nn.Module], int]]:
    """route -> (a module per linear of the model, in forward order; bytes they read per forward)."""
    g = gguf_map.gguf_linears(model, gguf)
    lins = dict(model.named_modules())
    names = _order(model)
    assert set(names) == set(g)
    w = {n: lins[n].weight.detach() for n in names}
    out: dict[str, tuple[dict[str, torch.nn.Module], int]] = {}
    out["fp32 F.linear"] = ({n: Fn(lambda x, t=w[n]: F.linear(x, t), t.shape[0]) for n, t in w.items()},
                            sum(t.numel() * 4 for t in w.values()))
    out["gguf numba (exact)"] = ({n: g[n] for n in names}, sum(g[n].nbytes for n in names))
    wb = {n: t.to(torch.bfloat16) for n, t in w.items()}
    out["bf16 F.linear (bf16 weights)"] = ({n: Fn(lambda x, t=wb[n]: F.linear(x.to(torch.bfloat16), t), wb[n].shape[0]) for n in names},
                                          sum(t.numel() * 2 for t in wb.values()))
    # torch's int4 product: (nibble - 8) * scale + zero, so Q4_1's d*q + m is scale d, zero m + 8d;
    # it is vectorised for bfloat16 activations and scales only.  Q8_0 has no int4 form: the
    # head gets torch's int8 product with one scale per row (requantised).
    i4: dict[str, torch.nn.Module] = {}
    nbytes = 0
    for n in names:
        fq = g[n]
        if fq.kind in ("Q4_0", "Q4_1"):
            q, d16, m16 = quant.unpack(fq.tiles(), fq.out_features)  # raw nibbles; Q4_0's offset is m = -8d
            dq = torch.from_numpy(d16.view(np.float16).astype(np.float32))  # [out, in/32]
            zero = torch.from_numpy(m16.view(np.float16).astype(np.float32)) + 8 * dq
            nib = torch.from_numpy(q.astype(np.int32))
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nib, 1)
            sz = torch.stack([dq, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [in/32, out, 2]
            i4[n] = Fn(lambda x, p=packed, s=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), p, quant.BLOCK, s),
                       fq.out_features)
            nbytes += packed.numel() + sz.numel() * 2
        else:
            i4[n] = _int8_row(w[n])
            nbytes += w[n].numel() + w[n].shape[0] * 4
    out["torch int4 bf16 + int8 head (approx)"] = (i4, nbytes)
    out["torch int8 per-row (requantised)"] = ({n: _int8_row(w[n]) for n in names}, sum(t.numel() + t.shape[0] * 4 for t in w.values()))
    dyn = {n: torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lins[n]), {torch.nn.Linear}, dtype=torch.qint8)[0]
           for n in names}
    out["torch dynamic int8 (requantised)"] = (dyn, sum(t.numel() + t.shape[0] * 8 for t in w.values()))
    return out


def _order(model: torch.nn.Module) -> list[str]:
    """The linears in the order a forward calls them (the head last)."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"] + ["lm_head"]


def _int8_row(w: torch.Tensor) -> Fn:
    s = w.abs().amax(1).clamp_min(1e-12) / 127
    q = torch.round(w / s[:, None]).to(torch.int8)
    return Fn(lambda x: torch.ops.aten._weight_int8pack_mm(x, q, s), w.shape[0])


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at",
           "List three primary colors:", "import numpy as np\n", "The quick brown fox", "In 1969, astronauts"]


def greedy(model: torch.nn.Module, ids: torch.Tensor, n: int, clock: Callable[[], float]) -> tuple[list[int], list[torch.Tensor], list[float]]:
    """n greedy tokens: (tokens, logits of each step, seconds of each one-token step)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=ids, cache=cache, use_cache=True)
    toks, logits, times = [], [out.logits[0, -1]], []
    for _ in range(n):
        toks.append(int(logits[-1].argmax()))
        t = clock()
        out = model(input_ids=torch.tensor([[toks[-1]]]), cache=cache, use_cache=True)
        times.append(clock() - t)
        logits.append(out.logits[0, -1])
    return toks, logits, times


def decode(lm: Any, threads: list[int], tokens: int, only: list[str] | None) -> dict[str, Any]:
    """Per route: greedy agreement with the app's float32 model, max abs logits difference on the
    steps fed the same tokens, median time of a one-token step."""
    model, tok = lm.model, lm.tokenizer
    rs = {k: v for k, v in routes(model, models.packaged_gguf()).items() if k != "fp32 F.linear" and (not only or k in only)}
    res: dict[str, Any] = {}
    for th in threads:
        torch.set_num_threads(th)
        clock = time.thread_time if th == 1 else time.perf_counter
        refs = {p: greedy(model, torch.tensor([tok(p)["input_ids"]]), tokens, clock) for p in PROMPTS}
        res.setdefault("fp32 (app path)", {})[f"step_ms_t{th}"] = _median(t for r in refs.values() for t in r[2]) * 1e3
        for name, (mods, _) in rs.items():
            r = res.setdefault(name, {"agree": 0, "total": 0, "logits_max_abs_diff": 0.0})
            old = quant.swap_modules(model, mods)
            try:
                got = {p: greedy(model, torch.tensor([tok(p)["input_ids"]]), tokens, clock) for p in PROMPTS}
            finally:
                quant.swap_modules(model, old)
            r[f"step_ms_t{th}"] = _median(t for g in got.values() for t in g[2]) * 1e3
            if th != threads[0]:
                continue
            for p, (toks, logits, _) in got.items():
                ref_toks, ref_logits, _ = refs[p]
                n = next((i for i, (a, b) in enumerate(zip(toks, ref_toks)) if a != b), len(toks))
                r["agree"] += n
                r["total"] += len(toks)
                diff = max((a - b).abs().max().item() for a, b in zip(logits[: n + 1], ref_logits[: n + 1]))
                r["logits_max_abs_diff"] = max(r["logits_max_abs_diff"], diff)
    for name, r in res.items():
        steps = "  ".join(f"{th} thr {r[f'step_ms_t{th}']:6.1f} ms ({1e3 / r[f'step_ms_t{th}']:5.1f} tok/s)" for th in threads)
        acc = f"  agree {r['agree']}/{r['total']}  logits max abs diff {r['logits_max_abs_diff']:.2e}" if "agree" in r else ""
        print(f"{name:38s} {steps}{acc}", flush=True)
    return res


def _median(xs: Any) -> float:
    v = sorted(xs)
    return v[len(v) // 2]


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m lab.quant_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 3, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--routes", nargs="+", help="only these routes (names as printed)")
    a = ap.parse_args()
    lm = models.load_model(models.PACKAGED, models.parse_placement("cpu", "float32"))
    if a.decode:
        res = decode(lm, a.threads, a.tokens, a.routes)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump({"cpu": _cpu(), "torch": torch.__version__, "routes": res}, fh, indent=1)
        return
    rs = routes(lm.model, models.packaged_gguf())
    subs = dict(lm.model.named_modules())
    ins = [subs[n].in_features for n in _order(lm.model)]
    result: dict[str, Any] = {"cpu": _cpu(), "torch": torch.__version__, "results": []}
    for th in a.threads:
        bw = bandwidth(th)
        print(f"threads={th}: read bandwidth {bw:.1f} GB/s", flush=True)
        for name, (mods, nbytes) in rs.items():
            if a.routes and name not in a.routes:
                continue
            fs = [mods[n] for n in _order(lm.model)]
            row: dict[str, Any] = {"threads": th, "route": name, "MB": nbytes / 1e6, "bandwidth_GBs": bw}
            for r in a.rows:
                torch.set_num_threads(th)
                xs = {k: torch.randn(r, k) for k in {576, 1536}}
                xin = [xs[k] for k in ins]
                for f, x in zip(fs, xin):
                    f(x)
                run = lambda: [f(x) for f, x in zip(fs, xin)]  # noqa: E731
                walls, cpus = [], []
                for _ in range(a.repeats):
                    walls.append(_timed(run))
                    cpus.append(_timed(run, time.thread_time))
                row[f"ms_{r}"] = min(walls) * 1e3
                if th == 1:  # this thread's CPU time: what a quiet core would take (wall time also counts waiting for other processes)
                    row[f"cpu_ms_{r}"] = min(cpus) * 1e3
            row["bound_ms"] = nbytes / bw / 1e6
            result["results"].append(row)
            print(f"  {name:38s} {nbytes / 1e6:6.0f} MB  bound {row['bound_ms']:5.1f} ms  "
                  + "  ".join(f"{r} rows {row[f'ms_{r}']:6.1f}" + (f" (cpu {row[f'cpu_ms_{r}']:6.1f})" if th == 1 else "")
                              for r in a.rows) + " ms", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
