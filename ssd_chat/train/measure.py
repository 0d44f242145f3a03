"""Measuring a draft in real (incremental, cached) decoding (``ssd-chat draft eval``)."""

from __future__ import annotations

import time
from typing import Any

import torch

from ..engine import Runner, drafter, ModelError, Error, is_feature_draft, Metrics, LoadedModel
from .prompts import prompt_ids


def _greedy(logits: torch.Tensor, i: int) -> tuple[torch.Tensor, None]:
    return logits.argmax(), None


@torch.inference_mode()
def measure(target: LoadedModel, draft: LoadedModel, prompts: list[str] | list[list[int]], max_new_tokens: int = 128,
            ks: tuple[int, ...] = (2, 4)) -> dict[str, Any]:
    """Greedy decoding of each prompt by the target, with the draft fed the same tokens through its
    own cache (as SD feeds it): top-1 agreement as SD sees it, the greedy SD tokens per target
    forward for each k (``prompts``: texts, or token ids), and the draft / target cost of one cached
    single-token step, timed back to back in this process (a ratio, robust to a busy machine)."""
    matches: list[list[bool]] = []
    t_target = t_draft = 0.0
    steps = 0
    features = is_feature_draft(draft.model)
    all_ids = [p if isinstance(p, list) else prompt_ids(target, [p])[0] for p in prompts]
    for ids in all_ids:
        d = drafter(draft.forwards, None, draft.device)
        t = Runner(target.model, target.device, mid_layer=d.mid_layer)
        seq = list(ids)
        if len(seq) > 1:
            d.prefill(seq[:-1], t.append(seq[:-1], logits="none", hidden=features))
        row = []
        for _ in range(max_new_tokens):
            a = time.perf_counter()
            out = t.append(seq[-1:], hidden=features)  # the target's next token after seq
            b = time.perf_counter()
            guess = int(d.propose(seq, 1, _greedy)[0][0])  # the draft's, from what it has seen of seq
            c = time.perf_counter()
            d.rollback(len(seq), out)
            t_target, t_draft, steps = t_target + b - a, t_draft + c - b, steps + 1
            tok = int(out.logits[-1].argmax())
            row.append(guess == tok)
            if tok in target.eos_ids:
                break
            seq.append(tok)
        matches.append(row)
    n = sum(len(r) for r in matches)
    out_: dict[str, Any] = {
        "num_prompts": len(prompts), "num_tokens": n,
        "agreement": sum(map(sum, matches)) / max(n, 1),
        "draft_cost": t_draft / max(t_target, 1e-9),
        "target_step_ms": 1000 * t_target / max(steps, 1), "draft_step_ms": 1000 * t_draft / max(steps, 1),
    }
    if features:
        out_.update(_sd_rounds(target, draft, all_ids, max_new_tokens, ks))
        return out_
    for k in ks:
        tokens = rounds = 0
        for row in matches:
            i = 0
            while i < len(row):
                a_ = 0
                while a_ < k and i + a_ < len(row) and row[i + a_]:
                    a_ += 1
                tokens += min(a_ + 1, len(row) - i)
                i += a_ + 1
                rounds += 1
        out_[f"tokens_per_round_k{k}"] = tokens / max(rounds, 1)
        out_[f"acceptance_k{k}"] = out_["agreement"]  # the draft only ever reads the true prefix
    return out_


def _sd_rounds(target: LoadedModel, draft: LoadedModel, all_ids: list[list[int]], max_new_tokens: int,
               ks: tuple[int, ...]) -> dict[str, float]:
    """Greedy SD for real with each k: tokens per target forward, and the acceptance rate of a
    draft token whose predecessors were accepted.  For a feature draft, the later tokens of a round
    are drafted on the draft's own features, so this is lower than the first-token agreement."""
    from ..engine import Engine, EngineConfig, SamplingParams

    out: dict[str, float] = {}
    for k in ks:
        engine = Engine(EngineConfig(mode="sd", k=k), target, draft)
        tally = Metrics("sd")
        for ids in all_ids:
            for ev in engine.stream(list(ids), SamplingParams(max_new_tokens=max_new_tokens)):
                if isinstance(ev, Error):
                    raise ModelError(f"SD failed while measuring the draft: {ev.message}")
                tally.add(ev)
        out[f"tokens_per_round_k{k}"] = tally.num_tokens / max(tally.num_rounds, 1)
        out[f"acceptance_k{k}"] = tally.chained_acceptance or 0.0
    return out
