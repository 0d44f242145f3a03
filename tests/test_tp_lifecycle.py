"""Tensor-parallel ranks as processes: other architectures, a rank that dies or fails mid-call, a shard
that cannot load, and no rank outliving the app (exit, Ctrl-C, SIGKILL)."""

from __future__ import annotations

import re

import pytest
import torch

from ssd_chat.engine.model.core import Core
from ssd_chat.engine.errors import ModelError, TPError

from helpers import procs
from helpers.models import PROMPT, tiny_llama, tiny_qwen
from helpers.tp import alive, close as _close, greedy, save as _save, start as _start

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", ["qwen3", "qwen2-tied"])
def test_other_architectures_split_too(kind, tmp_path):
    """Qwen3 (q/k norms, head_dim apart from hidden/heads); Qwen2 (qkv biases) with a tied head."""
    model = tiny_qwen("qwen3") if kind == "qwen3" else tiny_qwen("qwen2", tied=True)
    ref = Core(model, kind)
    with _start(_save(model, tmp_path)) as tp:
        _close(ref.append(PROMPT).logits, tp.append(PROMPT).logits)
        _close(ref.append([4, 5, 6]).logits, tp.append([4, 5, 6]).logits)
        assert greedy(tp, PROMPT, 12) == greedy(ref, PROMPT, 12)



@pytest.mark.parametrize("fault, words", [("exit:3", "rank 1 (pid {pid}) exited with status 3"),
                                          ("raise:2", "rank 1 failed (RuntimeError: injected fault)")])
def test_a_rank_that_dies_mid_call_is_one_clear_error_and_a_new_start_works(tmp_path, fault, words):
    model = tiny_llama(seed=0)
    folder = _save(model, tmp_path)
    tp = _start(folder, fault={1: fault})
    pid = tp.pids[0]
    ref = Core(model, "tiny")
    with pytest.raises(TPError) as err:
        for tok in PROMPT:  # the fault fires inside the worker's n-th forward
            tp.append([tok])
    msg = str(err.value)
    assert words.format(pid=pid) in msg and "every rank was closed" in msg and "\n" not in msg
    assert alive([pid]) == [] and tp.closed
    with pytest.raises(TPError, match="closed; start the model again"):
        tp.append([1])
    with _start(folder) as again:  # the app restarts the ranks and goes on
        _close(again.append(PROMPT).logits, ref.append(PROMPT).logits)
        pids = again.pids
    assert alive(pids) == []


def test_a_rank_killed_between_calls(tmp_path):
    import os
    import signal

    model = tiny_llama(seed=0)
    tp = _start(_save(model, tmp_path))
    tp.append(PROMPT)
    os.kill(tp.pids[0], signal.SIGKILL)
    with pytest.raises(TPError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL during a forward"):
        tp.append([1])
    assert alive(tp.pids) == []


def test_a_shard_that_cannot_load_stops_every_rank(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _save(tiny_llama(seed=0), tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    before = set(p for p in _spawned())
    with pytest.raises(ModelError, match="the checkpoint has no tensor 'model.layers.1.mlp.up_proj.weight'"):
        _start(folder)
    assert alive([p for p in _spawned() if p not in before]) == []


def _spawned() -> list[int]:
    return [p.pid for p in procs.workers(servers=False)]


# -- no rank outlives the app -------------------------------------------------------------------------

APP = """
import sys, time, torch
from ssd_chat.engine.tp.core import TPCore
tp = TPCore(sys.argv[1], ["cpu", "cpu"], "tiny", dtype=torch.float64)
tp.append([1, 2, 3])
print("pids", *tp.pids, flush=True)
if sys.argv[2] == "wait":  # an app's main loop: it wakes, so a Ctrl-C the kernel gave another thread is handled
    for _ in range(6000):
        time.sleep(0.1)
"""


@pytest.mark.parametrize("end", ["exit", "ctrl-c", "sigkill"])
def test_the_ranks_end_with_the_app(tmp_path, end):
    """A script that starts a TPCore and then exits without close() (the finalizer closes the ranks), gets
    Ctrl-C (SIGINT to its whole process group, as a terminal sends it: the ranks ignore it, the app closes
    them at exit) or is SIGKILLed (the ranks die with it: PR_SET_PDEATHSIG)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    folder = _save(tiny_llama(seed=0), tmp_path / "m")
    proc = subprocess.Popen([sys.executable, "-c", APP, folder, "exit" if end == "exit" else "wait"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("pids "), line + proc.stderr.read()
        pids = [int(x) for x in line.split()[1:]]
        assert len(pids) == 1
        if end == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        elif end == "sigkill":
            proc.kill()
        proc.wait(timeout=60)
        deadline = time.monotonic() + 15
        while alive(pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(pids) == [], end
        if end == "exit":
            assert proc.returncode == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


# -- a rank that dies or hangs mid-generation, seen from the app's process ------------------------------

GENERATE = """
import sys, torch
from ssd_chat.engine.errors import SSDChatError
from ssd_chat.engine.tp.core import TPCore
tp = TPCore(sys.argv[1], ["cpu", "cpu"], "tiny", dtype=torch.float64, timeout_s=float(sys.argv[2]))
print("pids", *tp.pids, flush=True)
try:
    while True:  # greedy generation, restarted before the cache fills
        lg = tp.append(list(range(1, 40)), logits="last").logits[-1]
        for _ in range(40):
            lg = tp.append([int(lg.argmax())], logits="last").logits[-1]
        print("generating", flush=True)
        tp.reset()
except SSDChatError as e:
    print("error:", e, flush=True)
    raise SystemExit(1)
"""


@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_a_rank_lost_mid_generation_is_one_line_within_the_timeout_and_leaves_no_process(tmp_path, how):
    """SIGKILL: gloo sees the closed connection at once.  SIGSTOP (a hung rank): the collective times out after
    ``timeout_s`` and the rank, deaf to SIGTERM while stopped, is killed.  The app's stderr stays empty (no
    traceback, no library noise over a full-screen app) and every rank is gone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    folder = _save(tiny_llama(seed=0), tmp_path / "m")
    timeout_s = 4.0
    proc = subprocess.Popen([sys.executable, "-c", GENERATE, folder, str(timeout_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids: list[int] = []
    try:
        line = proc.stdout.readline()
        assert line.startswith("pids "), line + proc.stderr.read()
        pids = [int(x) for x in line.split()[1:]]
        assert proc.stdout.readline() == "generating\n"
        os.kill(pids[0], signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
        last = out.strip().splitlines()[-1]
        assert proc.returncode == 1 and err == "", (out, err)
        if how == "sigkill":
            assert f"rank 1 (pid {pids[0]}) was killed by SIGKILL during a forward" in last and took < 30
        else:
            assert f"a rank did not answer within {timeout_s:g} s during a forward" in last
            assert timeout_s - 1 < took < timeout_s + 20
        assert last.startswith("error: tensor-parallel 'tiny': ") and "every rank was closed" in last
        assert alive(pids) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in alive(pids):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("broke", ["dead", "timeout"])
def test_on_nccl_a_result_made_while_the_group_broke_is_not_used(tmp_path, monkeypatch, broke):
    """On GPUs rank 0 waits for the device after each call and drops the result when the watchdog found a dead
    rank meanwhile (it aborts the group, and an aborted collective returns whatever its buffer held) or the call
    outlasted the collective timeout (NCCL aborted it).  No NCCL here: the check runs on gloo ranks, told they are CUDA."""
    tp = _start(_save(tiny_llama(seed=0), tmp_path))
    pids = tp.pids
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    tp._ranks.cuda = True
    tp.append(PROMPT)  # a healthy call is used
    if broke == "dead":
        tp._ranks.dead = "rank 1 (pid 12345) exited with status 1"
    else:
        tp._timeout_s = 0.0
    words = "rank 1 (pid 12345) exited with status 1" if broke == "dead" else "a rank did not answer within 0 s"
    with pytest.raises(TPError, match=re.escape(words + " during a forward")):
        tp.append([1])
    assert tp.closed and alive(pids) == []


def test_an_idle_model_outlives_the_collective_timeout(tmp_path):
    """Between calls the workers wait in a collective that gives up after ``timeout_s``; a chat left idle for
    longer keeps its ranks (rank 0 sends an empty command every timeout_s / 3)."""
    import time

    model = tiny_llama(seed=0)
    ref = Core(model, "tiny")
    with _start(_save(model, tmp_path), timeout_s=1.5) as tp:
        _close(tp.append(PROMPT).logits, ref.append(PROMPT).logits)
        time.sleep(5)
        _close(tp.append([4, 5]).logits, ref.append([4, 5]).logits)
        assert not tp.closed


def test_a_rank_killed_while_idle_is_reported_by_the_next_call(tmp_path, capfd):
    import os
    import signal
    import time

    tp = _start(_save(tiny_llama(seed=0), tmp_path), timeout_s=1.5)
    tp.append(PROMPT)
    pid = tp.pids[0]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while not tp.closed and time.monotonic() < deadline:  # the keep-alive finds it
        time.sleep(0.1)
    assert tp.closed and alive([pid]) == []
    with pytest.raises(TPError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
        tp.append([1])
    assert "Traceback" not in capfd.readouterr().err
