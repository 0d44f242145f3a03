"""ms per forward of the packaged model's target core at 1-4 rows, and whether each row of a 3-row
verify equals the one-row step at its position bit for bit (docs/performance-cpu.md).

    [SSD_CHAT_CPU_KERNELS=int4] python -m lab.core_rows THREADS off|on
"""
import sys
import time

import torch

from ssd_chat.engine.config import EngineConfig
from ssd_chat.engine.engine import Engine

threads, comp = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(threads)
e = Engine.load(EngineConfig(mode="ar", compile=comp))
r = e.target.forwards.runner("target", comp, (1, 3))
prompt = e.prompt_ids([{"role": "user", "content": "Write a short poem about the sea."}])[0]
lg = r.append(prompt, logits="last").logits[-1]
n, seq, steps = r.length, list(prompt), []
for _ in range(40):  # greedy one-row steps (the first compiles under "on")
    seq.append(int(lg.argmax()))
    lg = r.append([seq[-1]]).logits[-1]
    steps.append(lg.clone())
same = tot = 0
for j in range(0, 36, 3):
    r.truncate(n + j)
    rows = r.append(seq[n + j:n + j + 3]).logits
    same += sum(int(torch.equal(rows[i], steps[j + i])) for i in range(3))
    tot += 3


def ms(rows: int, reps: int = 40) -> float:
    ts = []
    for _ in range(reps):
        r.truncate(n)
        t0 = time.perf_counter()
        r.append(seq[n:n + rows])
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[reps // 2] * 1e3


print(f"threads={threads} compile={comp} forward={r.label} verify rows equal to one-row steps: {same}/{tot}")
for rows in (1, 2, 3, 4):
    print(f"  rows={rows}: {ms(rows):.2f} ms")
