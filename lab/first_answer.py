"""The first answer on a fresh machine (docs/startup.md): ``ssd-chat ask`` with an empty cache folder, in a
pseudo-terminal so the load line is drawn, timestamping each stage the line names and the answer's first
byte.  A second run on the same cache shows a warm start.

    .venv/bin/python -m lab.first_answer               # default mode (auto)
    .venv/bin/python -m lab.first_answer --mode ar --runs 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

PROMPT = "What is the capital of France?"
# the load line: "<stage>… 45% · 12 s" / "<stage>… 3 s", redrawn in place
STAGE = re.compile(r"([a-zA-Z][^\r\n\x1b…]{3,80})…")
ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")
ANSWER = re.compile(r"Paris|France|capital", re.I)


def one_run(args: argparse.Namespace, cache: str) -> dict:
    import pexpect

    env = dict(os.environ, SSD_CHAT_CACHE_DIR=cache, SSD_CHAT_CONFIG_DIR=tempfile.mkdtemp(), TERM="xterm-256color")
    cmd = ["-m", "ssd_chat", "ask", "-n", str(args.n)] + (["--mode", args.mode] if args.mode else []) + [PROMPT]
    t0 = time.monotonic()
    child = pexpect.spawn(sys.executable, cmd, env=env, encoding="utf-8", codec_errors="replace", timeout=600,
                          dimensions=(24, 200))
    stages: dict[str, float] = {}
    first = None
    text = ""
    while True:
        try:
            chunk = child.read_nonblocking(4096, timeout=0.2)
        except pexpect.TIMEOUT:
            continue
        except pexpect.EOF:
            break
        now = time.monotonic() - t0
        text += chunk
        plain = ANSI.sub("", chunk)
        for m in STAGE.finditer(plain):
            stages.setdefault(m.group(1).strip(), round(now, 1))
        # the answer: a visible line that is not the load line (the line is cleared before the reply)
        if first is None and "starting the decoder" in stages and ANSWER.search(ANSI.sub("", text[-600:]).split("decoder")[-1]):
            first = round(now, 1)
    child.close()
    return {"first_answer_s": first, "whole_s": round(time.monotonic() - t0, 1), "stages_first_seen_s": stages,
            "exit": child.exitstatus}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default=None, help="--mode for ask (default: the product's default)")
    ap.add_argument("--runs", type=int, default=1, help="runs on the same cache: the first is the fresh start")
    ap.add_argument("-n", type=int, default=16)
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="ssd-chat-fresh-")
    load = os.getloadavg()[0]
    results = [one_run(args, cache) for _ in range(args.runs)]
    print(json.dumps({"mode": args.mode or "default", "load_average_before": round(load, 2),
                      "load_average_after": round(os.getloadavg()[0], 2), "runs": results}, indent=1))


if __name__ == "__main__":
    main()
