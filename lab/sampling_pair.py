"""Default sampling against greedy, end to end (docs/performance-cpu.md, "Sampling"): ``ssd-chat ask -n N --json``
at the chat defaults (T 0.8, top-p 0.9, top-k 40, repetition 1.1) and greedy without a penalty
(``--temperature 0 --repetition-penalty 1``), interleaved on one prompt, per mode.

    .venv/bin/python -m lab.sampling_pair --modes ar,sd,ssd --rounds 3 -n 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

PROMPT = "Write a short story about a robot who learns to paint."
SETTINGS = {"default": ["--seed", "1"], "greedy": ["--temperature", "0", "--repetition-penalty", "1"]}


def ask(mode: str, n: int, extra: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "ssd_chat", "ask", "--mode", mode, "-n", str(n), "--json", *extra, PROMPT],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)["stats"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", default="ar,sd,ssd")
    p.add_argument("-n", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    env = dict(os.environ, SSD_CHAT_CONFIG_DIR=tempfile.mkdtemp(), SSD_CHAT_DATA_DIR=tempfile.mkdtemp(), HF_HUB_OFFLINE="1")
    summary = {}
    for mode in args.modes.split(","):
        runs: dict[str, list[dict]] = {k: [] for k in SETTINGS}
        for r in range(args.rounds):
            for name, extra in SETTINGS.items():
                runs[name].append(ask(mode, args.n, extra, env))
            print(f"{mode} round {r + 1}: " + ", ".join(
                f"{k} {v[-1]['tok_per_s']:.1f} tok/s ({v[-1]['new_tokens']} tokens, tau {v[-1].get('mean_accepted_length') or 1:.2f})"
                for k, v in runs.items()), flush=True)
        med = {k: statistics.median(s["tok_per_s"] for s in v) for k, v in runs.items()}
        tau = {k: statistics.median((s.get("mean_accepted_length") or 1.0) for s in v) for k, v in runs.items()}
        summary[mode] = {"tok_per_s": med, "tau": tau, "default/greedy": med["default"] / med["greedy"]}
        print(f"{mode}: median tok/s default {med['default']:.1f}, greedy {med['greedy']:.1f}: "
              f"default/greedy {med['default'] / med['greedy']:.3f} (tau {tau['default']:.2f} / {tau['greedy']:.2f})", flush=True)
    print(json.dumps({"load_average": os.getloadavg(), "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
