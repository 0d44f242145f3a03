"""Why the draft is accepted less at the default sampling: the expected acceptance of one draft token,
``sum_x min(p(x), q(x))``, for several proposals q, on the target's own sampled answers to the held-out
prompts (docs/performance-cpu.md, "Acceptance at the default sampling").

p is the target's next-token distribution at the chat defaults (repetition penalty 1.1 over prompt and
reply, temperature 0.8, top-k 40, top-p 0.9), the distribution AR samples.  Each q is one rule for the
draft's distribution at the same prefix (teacher-forced on the target's sampled path, the draft fed
through its own cache as SD feeds it).  Any q keeps SD exact (verification uses the q the token was
drawn from); the rules differ only in how often the target accepts.  Also: the greedy agreement of
the unpenalized argmaxes on the same positions.

    .venv/bin/python -m lab.accept_probe --prompts 20 -n 64 --json docs/results/accept-probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

import torch

from ssd_chat.engine.load.gen_defaults import CHAT_DEFAULT

T, TOP_K, TOP_P, REP = (CHAT_DEFAULT[k] for k in ("temperature", "top_k", "top_p", "repetition_penalty"))


def _rules() -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """name -> q(raw draft logits, penalized draft logits) as a dense [V] distribution."""
    from ssd_chat.engine.sampling.sampling import logits_to_probs

    def warped(temp: float, top_k: int = TOP_K, top_p: float = TOP_P, pen: bool = True):
        return lambda raw, penal: logits_to_probs(penal if pen else raw, temp, top_k, top_p)

    rules = {"as shipped (penalty, T 0.8, top-k 40, top-p 0.9)": warped(T),
             "no penalty on q": warped(T, pen=False),
             "no top-k / top-p on q": warped(T, 0, 1.0),
             "q greedy (point mass on the draft's argmax)": lambda raw, penal: logits_to_probs(penal, 0.0)}
    for tq in (0.3, 0.4, 0.5, 0.6, 0.7, 1.0):
        rules[f"q at T {tq}"] = warped(tq)
    for tk in (5, 10, 20):
        rules[f"q at top-k {tk}"] = warped(T, tk)
    return rules


@torch.inference_mode()
def probe(num_prompts: int, n: int, seed: int) -> dict:
    from ssd_chat.engine.sampling.penalties import Penalties
    from ssd_chat.engine.sampling.sampling import logits_to_probs, make_generator, sample_next
    from ssd_chat.engine.drafts.drafter import drafter, fit_vocab, vocab_size
    from ssd_chat.engine.drafts.feature import is_feature_draft
    from ssd_chat.engine.model import runner as kv
    from ssd_chat.chat.loading import load_engine
    from ssd_chat.cli.options import settings
    from ssd_chat.train.prompts import load_prompts, prompt_ids

    engine = load_engine(settings({"mode": "sd"}), progress_to_stderr=False)
    target, draft = engine.target, engine.draft
    print(f"target {target.name}, draft {draft.name}, k {engine.config.k}", file=sys.stderr, flush=True)
    vocab = vocab_size(target.model)
    features = is_feature_draft(draft.model)
    rules = _rules()
    sums = {name: 0.0 for name in rules}
    greedy_hits = tokens = 0
    gen = make_generator(seed)
    for ids in prompt_ids(target, load_prompts(heldout=True)[:num_prompts]):
        d = drafter(draft.forwards, vocab, draft.device)
        t = kv.Runner(target.model, target.device, mid_layer=d.mid_layer)
        pen = Penalties(REP, prompt=ids)
        seq = list(ids)
        d.prefill(seq[:-1], t.append(seq[:-1], logits="none", hidden=features))
        for _ in range(n):
            out = t.append(seq[-1:], hidden=features)
            seen: list[torch.Tensor] = []
            d.propose(seq, 1, lambda lg, i: (seen.append(lg.reshape(-1)) or lg.argmax(), None))
            d.rollback(len(seq), out)
            raw_t, raw_d = out.logits[-1].float(), fit_vocab(seen[0].float(), vocab)
            p = logits_to_probs(pen.apply(raw_t), T, TOP_K, TOP_P)
            pen_d = pen.apply(raw_d)
            for name, rule in rules.items():
                sums[name] += float(torch.minimum(p, rule(raw_d, pen_d)).sum())
            greedy_hits += int(raw_t.argmax() == raw_d.argmax())
            tokens += 1
            tok = sample_next(pen.apply(raw_t), T, TOP_K, TOP_P, gen)
            if tok in target.eos_ids:
                break
            seq.append(tok)
            pen.add([tok])
        print(f"  {tokens} positions: shipped {sums[next(iter(rules))] / tokens:.3f}", file=sys.stderr, flush=True)
    engine.close()
    acc = {name: round(s / tokens, 4) for name, s in sums.items()}
    return {"prompts": num_prompts, "positions": tokens, "greedy_agreement": round(greedy_hits / tokens, 4),
            "expected_acceptance": acc}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m lab.accept_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    res = probe(a.prompts, a.n, a.seed)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
