"""llama.cpp (llama-cpp-python's low-level API) on the packaged GGUF: ms per llama_decode of 1-4
rows (logits of every row, or of the last), and whether rows of a 3-row batch equal one-row decodes
bit for bit (docs/performance-cpu.md).

    python -m lab.llama_rows THREADS
"""
import ctypes
import pathlib
import sys
import time

import llama_cpp as L
import numpy as np
from ssd_chat.engine.load import models

threads = int(sys.argv[1])
L.llama_backend_init()
_quiet = L.llama_log_callback(lambda level, text, data: None)
L.llama_log_set(_quiet, ctypes.c_void_p(0))
model = L.llama_model_load_from_file(str(pathlib.Path(models.packaged_gguf())).encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 2048, 512, 512, threads, threads
cp.flash_attn_type = 1
ctx = L.llama_init_from_model(model, cp)
V = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
mem = L.llama_get_memory(ctx)
batch = L.llama_batch_init(512, 0, 1)


def decode(ids, pos0, last_only=False):
    for i, t in enumerate(ids):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = t, pos0 + i, 1, 0
        batch.logits[i] = int(not last_only or i == len(ids) - 1)
    batch.n_tokens = len(ids)
    assert L.llama_decode(ctx, batch) == 0
    return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(1 if last_only else len(ids), V)).copy()


prompt = list(range(100, 160))
lg, n = decode(prompt, 0)[-1], len(prompt)
seq, steps = list(prompt), []
for _ in range(63):
    seq.append(int(lg.argmax()))
    lg = decode([seq[-1]], len(seq) - 1)[0]
    steps.append(lg)
same = 0
for j in range(0, 60, 3):
    L.llama_memory_seq_rm(mem, 0, n + j, -1)
    rows = decode(seq[n + j:n + j + 3], n + j)
    same += sum(int(np.array_equal(rows[i], steps[j + i])) for i in range(3))
print(f"threads={threads} verify rows equal to one-row decodes: {same}/60")
for last in (False, True):
    for rows in (1, 2, 3, 4):
        ts = []
        for _ in range(40):
            L.llama_memory_seq_rm(mem, 0, n, -1)
            t0 = time.perf_counter()
            decode(seq[n:n + rows], n, last)
            ts.append(time.perf_counter() - t0)
        print(f"  rows={rows} logits={'last' if last else 'all'}: {sorted(ts)[20] * 1e3:.2f} ms")
