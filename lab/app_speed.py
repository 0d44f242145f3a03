"""The chat app's streaming speed against ``ask``'s, paired and interleaved (docs/performance-cpu.md, "In the app").

Each round runs, on the same prompt and settings: ``ssd-chat ask --json``, the app in a pseudo-terminal
with its engine process (the default), and the app with the engine in its own process
(``SSD_CHAT_IN_PROCESS=1``, as it was).  The app's figure is the saved turn's tok/s (turn_metrics).

    .venv/bin/python -m lab.app_speed --mode ar --rounds 3 -n 200
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "Write a short story about a robot who learns to paint."


def settings(args: argparse.Namespace) -> list[str]:
    return ["--mode", args.mode, "--temperature", "0", "--repetition-penalty", "1", "-n", str(args.n), "--target-device", "cpu"]


def ask(args: argparse.Namespace, env: dict[str, str]) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-m", "ssd_chat", "ask", *settings(args), "--json", PROMPT],
                         env=env, capture_output=True, text=True, check=True).stdout
    stats = json.loads(out)["stats"]
    return float(stats["tok_per_s"]), float(stats["ttft_s"])


def app(args: argparse.Namespace, env: dict[str, str], in_process: bool) -> tuple[float, float]:
    import pexpect

    db = os.path.join(tempfile.mkdtemp(), "h.db")
    env = dict(env, TERM="xterm-256color")
    if in_process:
        env["SSD_CHAT_IN_PROCESS"] = "1"
    child = pexpect.spawn(sys.executable, ["-m", "ssd_chat", *settings(args), "--db", db], env=env,
                          dimensions=(45, 160), encoding="utf-8", codec_errors="replace", timeout=600)
    seen = ""
    try:
        end = time.monotonic() + 600
        while f"{args.mode.upper()} · smollm2" not in seen and time.monotonic() < end:
            try:
                seen = (seen + child.read_nonblocking(65536, timeout=0.5))[-20000:]
            except pexpect.TIMEOUT:
                pass
        if args.ui_nice:  # every thread of the app's own process (the engine process is a child, left alone)
            for tid in os.listdir(f"/proc/{child.pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), args.ui_nice)
        child.send(PROMPT)
        time.sleep(0.5)
        child.send("\r")
        while time.monotonic() < end:
            try:
                child.read_nonblocking(65536, timeout=0.5)  # the terminal is read, as a real one is
            except pexpect.TIMEOUT:
                pass
            try:
                with sqlite3.connect(db) as con:
                    row = con.execute("SELECT tok_per_s, stats_json FROM turn_metrics").fetchone()
            except sqlite3.Error:
                row = None
            if row and row[0]:
                return float(row[0]), float(json.loads(row[1])["ttft_s"])
        raise RuntimeError("no reply")
    finally:
        child.sendcontrol("c")
        child.expect(pexpect.EOF, timeout=60)
        child.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="ar")
    p.add_argument("-n", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-in-process", action="store_true", help="leave out the app with the engine in its own process")
    p.add_argument("--ui-nice", type=int, default=0, help="renice the app's own threads (not the engine process) once loaded")
    args = p.parse_args()
    env = dict(os.environ, SSD_CHAT_CONFIG_DIR=tempfile.mkdtemp(), SSD_CHAT_DATA_DIR=tempfile.mkdtemp(), HF_HUB_OFFLINE="1")
    runs: dict[str, list[tuple[float, float]]] = {"ask": [], "app": [], "app in-process": []}
    for r in range(args.rounds):
        runs["ask"].append(ask(args, env))
        runs["app"].append(app(args, env, False))
        if not args.no_in_process:
            runs["app in-process"].append(app(args, env, True))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1][0]:.1f} tok/s TTFT {v[-1][1]:.2f} s" for k, v in runs.items() if v),
              flush=True)
    med = {k: statistics.median(x for x, _ in v) for k, v in runs.items() if v}
    ttft = {k: statistics.median(t for _, t in v) for k, v in runs.items() if v}
    print(f"{args.mode}: median tok/s " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
          + f"; app/ask {med['app'] / med['ask']:.3f}"
          + (f", in-process/ask {med['app in-process'] / med['ask']:.3f}" if "app in-process" in med else "")
          + "; median TTFT " + ", ".join(f"{k} {v:.2f} s" for k, v in ttft.items()))

if __name__ == "__main__":
    main()
