"""Running the real command line: ``python -m ssd_chat`` in a subprocess, and a fake llama.cpp binary."""

from __future__ import annotations

import subprocess
import sys


def cli(*args, env=None, input=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "ssd_chat", *args], capture_output=True, text=True,
                          env=env, input=input, timeout=timeout)


FAKE = """#!{python}
# a stand-in for llama.cpp's llama-bench: records its arguments and CPU affinity, prints -o json
import json, os, sys, time
args = sys.argv[1:]
log = os.environ.get("FAKE_LLAMA_LOG")
if log:
    with open(log, "a") as f:
        f.write(json.dumps({{"args": args, "cores": sorted(os.sched_getaffinity(0))}}) + "\\n")
mode = os.environ.get("FAKE_LLAMA_MODE", "ok")
if mode == "fail":
    print("llama_model_load: error loading model: tensor data is not within the file bounds", file=sys.stderr)
    sys.exit(1)
if mode == "garbage":
    print("| model | size | params |")
    sys.exit(0)
if mode == "hang":
    time.sleep(60)
n = int(args[args.index("-n") + 1])
t = int(args[args.index("-t") + 1])
burn = float(os.environ.get("FAKE_LLAMA_BURN_MS", "0")) * n * int(args[args.index("-r") + 1]) / 1e3
t0 = time.process_time()
while time.process_time() - t0 < burn:  # CPU time in proportion to the tokens generated
    pass
print(json.dumps([{{"build_commit": "abc1234", "build_number": 42, "model_type": "llama ?B Q4_1", "n_prompt": 0,
                   "n_gen": n, "n_threads": t, "avg_ts": 50.0 * t, "stddev_ts": 1.5, "samples_ts": [50.0 * t]}}]))
"""

