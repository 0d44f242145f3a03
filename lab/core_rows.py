"""ms per forward of the packaged model's target core at 1-4 rows (a step and verifies of 2-4 rows),
the verify/step ratios, the output head's share, and whether each row of every verify equals the
one-row step at its position bit for bit (docs/performance-cpu.md).

    [SSD_CHAT_CPU_KERNELS=int4] [SSD_CHAT_ATTENTION=numba] python -m lab.core_rows THREADS off|on [--reps 40] [--context N]

Every row count is compiled (``on``: one package each, built once per machine).  The row counts
are timed interleaved (each repetition times 1, 2, 3 and 4 rows in turn), median of ``--reps``, and
then in blocks (``--reps`` forwards of one row count in a row, as a decoder runs them: AR only ever
calls the 1-row graph, a verifier only its k + 1-row one).  Each row count is a package of its own
with its own copy of the weights, so interleaving evicts one graph's weights with the others' from
the caches; where a model fits in the last-level cache, the blocks are what the decoders see.
At one thread the times are this thread's CPU time (on a shared machine wall time also counts the
waits for other processes); at two, wall time.  ``head`` is the Q8_0 output head's product alone
on the same rows, timed the same way; ``q4`` the 210 Q4 products of one forward through torch's int4
GEMM (what the compiled graph runs; absent under ``off`` without ``SSD_CHAT_CPU_KERNELS=int4``).
"""
import argparse
import time

import torch

from ssd_chat.engine.config import EngineConfig
from ssd_chat.engine.cpu.quant import GGUFLinear
from ssd_chat.engine.engine import Engine

ROWS = (1, 2, 3, 4)
ap = argparse.ArgumentParser(prog="python -m lab.core_rows", description=__doc__.split("\n\n")[0])
ap.add_argument("threads", type=int)
ap.add_argument("compile", choices=["off", "on"])
ap.add_argument("--reps", type=int, default=40)
ap.add_argument("--context", type=int, default=0, help="tokens already in the cache (the prompt repeated to about N); "
                "attention reads the whole window, so a step costs more as a chat grows")
a = ap.parse_args()
torch.set_num_threads(a.threads)
clock = time.thread_time if a.threads == 1 else time.perf_counter
e = Engine.load(EngineConfig(mode="ar", compile=a.compile))
r = e.target.forwards.runner("target", a.compile, ROWS)
prompt = e.prompt_ids([{"role": "user", "content": "Write a short poem about the sea."}])[0]
prompt = prompt * max(1, a.context // len(prompt))
lg = r.append(prompt, logits="last").logits[-1]
n, seq, steps = r.length, list(prompt), []
for _ in range(40):  # greedy one-row steps (the first compiles under "on")
    seq.append(int(lg.argmax()))
    lg = r.append([seq[-1]]).logits[-1]
    steps.append(lg.clone())
same = {k: [0, 0] for k in ROWS[1:]}
for k in ROWS[1:]:
    for j in range(0, 36, k):
        r.truncate(n + j)
        rows = r.append(seq[n + j:n + j + k]).logits
        same[k][0] += sum(int(torch.equal(rows[i], steps[j + i])) for i in range(k))
        same[k][1] += k

head = max((m for m in e.target.model.modules() if isinstance(m, GGUFLinear)), key=lambda m: m.out_features)
hx = torch.randn(max(ROWS), head.in_features)
q4 = [m for m in e.target.model.modules() if isinstance(m, GGUFLinear) and m.int4 is not None]
xs = {f: torch.randn(max(ROWS), f).to(torch.bfloat16) for f in {m.in_features for m in q4}}


def forward_s(k: int) -> float:
    """One forward of ``k`` rows after the prompt, timed."""
    r.truncate(n)
    t0 = clock()
    r.append(seq[n:n + k])
    return clock() - t0


fwd: dict[int, list[float]] = {k: [] for k in ROWS}
hd: dict[int, list[float]] = {k: [] for k in ROWS}
q4t: dict[int, list[float]] = {k: [] for k in ROWS}
for _ in range(a.reps):
    for k in ROWS:
        fwd[k].append(forward_s(k))
        t0 = clock()
        head(hx[:k])
        hd[k].append(clock() - t0)
        t0 = clock()
        for m in q4:
            torch.ops.aten._weight_int4pack_mm_for_cpu(xs[m.in_features][:k], m.int4[0], 32, m.int4[1])
        q4t[k].append(clock() - t0)


blk: dict[int, list[float]] = {k: [] for k in ROWS}
for k in ROWS:
    for i in range(a.reps + 5):  # the first few warm the caches with this graph's weights
        t = forward_s(k)
        if i >= 5:
            blk[k].append(t)


def med(ts: list[float]) -> float:
    return sorted(ts)[len(ts) // 2] * 1e3


print(f"threads={a.threads} compile={a.compile} forward={r.label} clock={clock.__name__} context={n} "
      f"verify rows equal to one-row steps: " + ", ".join(f"{k} rows {s}/{t}" for k, (s, t) in same.items()))
for k in ROWS:
    print(f"  rows={k}: forward {med(fwd[k]):.2f} ms ({med(fwd[k]) / med(fwd[1]):.2f}x)"
          f"  head {med(hd[k]):.2f} ms ({med(hd[k]) / med(hd[1]):.2f}x)"
          + (f"  q4 {med(q4t[k]):.2f} ms ({med(q4t[k]) / med(q4t[1]):.2f}x)" if q4 else "")
          + f"  | in blocks: forward {med(blk[k]):.2f} ms ({med(blk[k]) / med(blk[1]):.2f}x)")
