"""Acceptance of the packaged draft in real SD and SSD replies, greedy and at the chat defaults
(docs/performance-cpu.md, "Acceptance at the default sampling"): tokens per verify, acceptance per
draft position, SSD's cache hits and the tokens per verify after a hit and after a miss, over the
held-out prompts (``assets/distill_heldout.jsonl``), in one process with the app's settings.

Acceptance figures do not depend on the machine's load (tok/s would, and are not reported).

    .venv/bin/python -m lab.accept_runs --prompts 20 -n 96 --modes sd,ssd --json docs/results/accept-runs.json
"""

from __future__ import annotations

import argparse
import json
import sys

from ssd_chat.engine.load.gen_defaults import CHAT_DEFAULT

SETTINGS = {"greedy": dict(temperature=0.0, repetition_penalty=1.0), "defaults": dict(CHAT_DEFAULT)}


def summary(m) -> dict:
    """The figures of one mode and setting, over all its replies (an engine.metrics.Metrics)."""
    hits, ssd = m.num_hits, m.num_ssd_rounds
    out = {"rounds": m.num_rounds, "tokens_per_verify": round(1 + m.num_accepted / max(m.num_rounds, 1), 3),
           "per_position": [round(a / d, 3) for a, d in zip(m.position_accepted, m.position_drafted)]}
    if ssd:
        out.update(cache_hits=round(hits / ssd, 3),
                   tokens_per_verify_on_hit=round(1 + m.accepted_on_hit / hits, 3) if hits else None,
                   tokens_per_verify_on_miss=round(1 + m.accepted_on_miss / (ssd - hits), 3) if ssd > hits else None)
    return out


def run(modes: list[str], num_prompts: int, n: int, k: int | None) -> dict:
    from ssd_chat.engine.events import Error
    from ssd_chat.engine.metrics import Metrics
    from ssd_chat.engine.params import SamplingParams
    from ssd_chat.chat.loading import load_engine
    from ssd_chat.cli.options import settings
    from ssd_chat.train.prompts import load_prompts, prompt_ids

    values = settings({"mode": modes[0], **({"k": k} if k else {})})
    engine = load_engine(values, progress_to_stderr=False)
    out: dict = {"draft": engine.draft.name, "k": engine.config.k, "prompts": num_prompts, "max_new_tokens": n}
    try:
        ids = prompt_ids(engine.target, load_prompts(heldout=True)[:num_prompts])
        for mode in modes:
            engine.reconfigure(mode=mode)
            for name, kw in SETTINGS.items():
                m = Metrics(mode)
                for i, p in enumerate(ids):
                    for ev in engine.stream(list(p), SamplingParams(max_new_tokens=n, seed=i, **kw)):
                        if isinstance(ev, Error):
                            raise SystemExit(f"{mode} failed: {ev.message}")
                        m.add(ev)
                out[f"{mode} {name}"] = summary(m)
                print(f"{mode} {name}: {out[f'{mode} {name}']}", file=sys.stderr, flush=True)
    finally:
        engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m lab.accept_runs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="sd,ssd")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("-k", type=int)
    ap.add_argument("--json")
    a = ap.parse_args()
    res = run(a.modes.split(","), a.prompts, a.n, a.k)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
