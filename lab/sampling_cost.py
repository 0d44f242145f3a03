"""What sampling at the chat defaults (temperature 0.8, top-p 0.9, top-k 40, repetition penalty 1.1)
costs per step against a greedy step, on the packaged model (docs/performance-cpu.md, "Sampling cost").

Each piece is timed on the model's own logits, all pieces in turn within every repetition (a busy
machine slows them alike), and the median is reported in ms:

* AR: the penalty and the draw against the argmax, and the target's one-row forward;
* SD and SSD's verifier: the rows' penalties, p and the acceptance test against the greedy outcome
  (one argmax), and the target's k+1-row forward;
* the draft's draws: one penalized draw per draft token (SD, the fallback) and one per tree depth
  over B branches (the speculator's own :func:`treedraw.draw_depth`: penalized in place and put
  back, q' kept on its top-k support), against the argmax, and the draft's one-row forward;
* the speculator's q' per round: the k depths' supports stacked and the served branch's k rows made
  dense (what it sends; under greedy nothing).

    python -m lab.sampling_cost [--threads 1] [--reps 100] [--k K] [--branches B]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from ssd_chat.engine.config import EngineConfig
from ssd_chat.engine.sampling.penalties import Penalties
from ssd_chat.engine.sampling.sampling import (
    draw_draft,
    greedy_outcome,
    logits_to_probs,
    make_generator,
    sample_next,
    verify,
)
from ssd_chat.engine.sampling.support import as_dense, stack
from ssd_chat.engine.engine import Engine
from ssd_chat.engine.load.gen_defaults import CHAT_DEFAULT
from ssd_chat.engine.params import SamplingParams
from ssd_chat.engine.speculate.treedraw import draw_depth

T, TOP_K, TOP_P, REP = (CHAT_DEFAULT[k] for k in ("temperature", "top_k", "top_p", "repetition_penalty"))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m lab.sampling_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--k", type=int, default=EngineConfig().k)
    ap.add_argument("--branches", type=int, default=8, help="tree rows per depth (the default budget at k=2 or 3)")
    ap.add_argument("--json", help="write the medians here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    k = a.k
    e = Engine.load(EngineConfig(mode="sd", k=k))
    tr = e.target.forwards.runner("target", "auto", (1, k + 1))
    dr = e.draft.forwards.runner("draft", "auto", (1,))
    prompt = e.prompt_ids([{"role": "user", "content": "Write a short story about a dragon who learns to read."}])[0]
    logits = tr.append(prompt, logits="last").logits[-1]
    dr.append(prompt, logits="none")
    seq = list(prompt)
    for _ in range(100):  # a reply of 100 greedy tokens: the penalties' history and the logits measured on
        seq.append(int(logits.argmax()))
        logits = tr.append([seq[-1]]).logits[-1]
        dr.append([seq[-1]], logits="none")
    n_t, n_d = tr.length, dr.length
    chain = seq[-(k + 1):]
    rows = tr.append(chain).logits.clone()  # [k+1, V]: a verify's rows
    tr.truncate(n_t)
    dlogits = dr.append([seq[-1]]).logits[-1].clone()
    dr.truncate(n_d)
    tree = rows[:1].expand(a.branches, -1).clone() + 0.01 * torch.randn(a.branches, rows.shape[-1])
    pen = Penalties(REP, prompt=prompt)
    pen.add(seq[len(prompt):])
    gen = make_generator(0)
    drafts = chain[1:]
    qs = torch.stack([draw_draft(pen.rows(rows[i][None], drafts[:i], 1 + i)[0], T, TOP_K, TOP_P, gen)[1] for i in range(k)])
    dtoks = torch.tensor(drafts)
    prefixes = [chain[:2 + b % k] for b in range(a.branches)]
    drawn = torch.tensor(chain[:2]).repeat(a.branches, 1)
    params = SamplingParams(T, TOP_P, TOP_K, 0, repetition_penalty=REP)
    depth_qs = [draw_depth(tree, pen, prefixes, drawn, params, 1.0, gen)[1] for _ in range(k)]

    def fwd(runner, n, ids):
        runner.append(ids)
        runner.truncate(n)

    pieces = {
        "target_forward_1": lambda: fwd(tr, n_t, chain[:1]),
        f"target_forward_{k + 1}": lambda: fwd(tr, n_t, chain),
        "draft_forward_1": lambda: fwd(dr, n_d, chain[:1]),
        "ar_greedy": lambda: int(logits.argmax()),
        "ar_sample": lambda: sample_next(pen.rows(logits[None])[0], T, TOP_K, TOP_P, gen),
        "verify_greedy": lambda: greedy_outcome(rows, drafts),
        "verify_sample": lambda: verify(dtoks, qs, logits_to_probs(pen.rows(rows, chain), T, TOP_K, TOP_P), gen),
        "draw_greedy": lambda: int(dlogits.argmax()),
        "draw_sample": lambda: int(draw_draft(pen.rows(dlogits[None], drafts[:1], 2)[0], T, TOP_K, TOP_P, gen)[0]),
        "tree_draw_greedy": lambda: tree.argmax(dim=-1),
        "tree_draw_sample": lambda: draw_depth(tree, pen, prefixes, drawn, params, 1.0, gen),
        "tree_q_round": lambda: as_dense(stack(depth_qs, 1)[a.branches - 1]),
    }
    times: dict[str, list[float]] = {name: [] for name in pieces}
    for _ in range(a.reps):
        for name, fn in pieces.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: sorted(ts)[len(ts) // 2] * 1e3 for name, ts in times.items()}
    for name, ms in med.items():
        print(f"{name:>20}: {ms:8.3f} ms")
    ar_step = med["target_forward_1"] + med["ar_greedy"]
    verify_step = med[f"target_forward_{k + 1}"] + med["verify_greedy"]
    sd_round = verify_step + k * (med["draft_forward_1"] + med["draw_greedy"])
    sd_extra = med["verify_sample"] - med["verify_greedy"] + k * (med["draw_sample"] - med["draw_greedy"])
    share = {
        "ar": (med["ar_sample"] - med["ar_greedy"]) / ar_step,
        "ssd_verifier": (med["verify_sample"] - med["verify_greedy"]) / verify_step,
        "sd_round": sd_extra / sd_round,
        "tree_depth_vs_draft_forward": (med["tree_draw_sample"] - med["tree_draw_greedy"]) / med["draft_forward_1"],
        "tree_q_round_vs_draft_forward": med["tree_q_round"] / med["draft_forward_1"],
    }
    print(f"sampling over greedy, as a share of the greedy step (threads={a.threads}, k={k}, branches={a.branches}):")
    for name, x in share.items():
        print(f"{name:>28}: {100 * x:6.1f} %")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"ms": med, "share": share, "threads": a.threads, "k": k, "branches": a.branches}, f, indent=1)


if __name__ == "__main__":
    main()
