"""Which draft is best for SSD once the target runs in its GGUF precision: acceptance x cost.

For each candidate, on the compact core at one thread (core 0, CPU time):

* cost: a 1-row draft step and a 6-row tree step (SSD's speculator at depth 0) after 200 tokens;
* acceptance: greedy, teacher-forced: on the target's own greedy continuations of 12 chat prompts
  (3 per family, 48 tokens each, chat template), the fraction of positions where the draft's
  argmax is the target's token.  That is exactly when greedy SD accepts a drafted token.

Candidates: ``int8`` as today (torch dynamic int8), ``int8`` as Q8_0 blocks on the GGUF kernels
(fast_weights.q8_copy), ``layers:N`` sharing the target's GGUF linears, and the trained draft as
shipped (float32 own layers and head) and with fast weights (gguf_drafts.fast_draft).

Estimates per k (stated as such: they assume independent acceptances, geometric run lengths):
E = (1 - a^(k+1)) / (1 - a) tokens per round; SD = E / (k D1 + V(k+1)); SSD with every round
a cache hit = E / max(V(k+1), W) with W = D(k+1) + k T6 the speculator's work per round (glue
forward and k tree steps), V(k+1) the GGUF target's verify (row-independent attention).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .cpu_perf_common import Models, forward, greedy, load_average, pin, timed

TOKENS = 48


def _prompts(m: Models) -> list[list[int]]:
    from ssd_chat.engine.load.chat import messages_for, prompt_ids

    from ssd_chat.bench.prompts import load_prompts

    ps, _ = load_prompts("all", 3)
    return [prompt_ids(m.lm.tokenizer, messages_for(p.text))[0] for p in ps]


def _continuations(m: Models, prompts: list[list[int]]) -> list[list[int]]:
    from ssd_chat.engine.model.core import Core

    m.swapped(True)
    core = Core(m.model, "target", row_attention=True)
    return [greedy(core, p, TOKENS)[0] for p in prompts]


def acceptance(model: torch.nn.Module, prompts: list[list[int]], conts: list[list[int]]) -> float:
    from ssd_chat.engine.model.core import Core

    core = Core(model, "draft")
    hit = total = 0
    for p, c in zip(prompts, conts):
        core.reset()
        lg = core.append(p + c[:-1]).logits[len(p) - 1:]
        hit += int((lg.argmax(-1) == torch.tensor(c)).sum())
        total += len(c)
    return hit / total


def cost(model: torch.nn.Module, reps: int) -> dict[str, Any]:
    from ssd_chat.engine.model.core import Core

    core = Core(model, "draft")
    core.append([(i * 37) % 5000 + 10 for i in range(200)], logits="none")
    return {f"rows_{r}": timed(forward(core, r, r >= 6), reps, 1)["min_ms"] for r in (1, 2, 3, 4, 5, 6)}


def estimates(a: float, d: dict[str, float], v: dict[int, float]) -> list[dict[str, Any]]:
    out = []
    for k in (1, 2, 3, 4):
        e = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
        work = d[f"rows_{k + 1}"] + k * d["rows_6"]
        out.append({"k": k, "tokens_per_round": round(e, 2), "sd_tok_per_s": round(1e3 * e / (k * d["rows_1"] + v[k + 1]), 1),
                    "ssd_tok_per_s": round(1e3 * e / max(v[k + 1], work), 1), "speculator_ms_per_round": round(work, 1)})
    return out


def run(m: Models, reps: int, log: Callable[[str], None]) -> dict[str, Any]:
    from ssd_chat.engine.drafts import gguf as gguf_drafts, shipped as drafts
    from ssd_chat.engine.load import gguf_weights as fast_weights
    from ssd_chat.engine.model.core import Core

    pin((0,), 1)
    prompts = _prompts(m)
    conts = _continuations(m, prompts)
    verify = Core(m.model, "target", row_attention=True)
    verify.append([(i * 37) % 5000 + 10 for i in range(200)], logits="none")
    v = {r: timed(forward(verify, r, False), reps, 1)["min_ms"] for r in (1, 2, 3, 4, 5)}
    log(f"target verify ms by rows: {v}")
    m.swapped(False)  # derived on the float32 target, as the app derives them (the trained draft checks a hash)
    cands: dict[str, tuple[torch.nn.Module, bool]] = {"int8 (torch dynamic int8)": (drafts.derive("int8", m.lm).model, False),
                                                      "trained (float32, as shipped)": (drafts.derive("trained", m.lm).model, False)}
    fast_trained = drafts.derive("trained", m.lm).model
    m.swapped(True)
    m.quant.swap_modules(fast_trained, gguf_drafts.fast_draft(fast_trained, m.gguf))
    cands["trained (GGUF shared layers, Q8_0 own layers and head)"] = (fast_trained, True)
    cands["int8 as Q8_0 blocks (GGUF kernels)"] = (fast_weights.q8_copy(m.model, m.gguf), True)
    for n in (2, 4, 8):
        cands[f"layers:{n} (GGUF)"] = (drafts.derive(f"layers:{n}", m.lm).model, True)
    out: dict[str, Any] = {"target_verify_ms": v, "prompts": len(prompts), "tokens": TOKENS, "drafts": {}}
    for name, (model, gguf) in cands.items():
        m.swapped(gguf)  # the float32 candidates share float32 target layers
        with torch.inference_mode():
            a = acceptance(model, prompts, conts)
            d = cost(model, reps)
        out["drafts"][name] = {"acceptance": round(a, 4), "cost_ms": d, "estimates": estimates(a, d, v), "load": load_average()}
        log(f"draft {name}: acceptance {a:.3f}, cost {d}")
    m.swapped(True)
    best = max(((n, e) for n, r in out["drafts"].items() for e in r["estimates"]), key=lambda t: t[1]["ssd_tok_per_s"])
    out["best_ssd"] = {"draft": best[0], **best[1]}
    return out
