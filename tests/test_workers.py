"""Worker processes start wherever the engine runs: under Textual's stdio (whose fileno() is -1) too."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import env_with_helpers
from ssd_chat.engine import processes as workers

# A fresh interpreter (multiprocessing's resource tracker not yet running), with stdout/stderr replaced
# the way Textual replaces them while the app runs; then a real SSD reply on a tiny pair.
SCRIPT = textwrap.dedent("""
    import sys

    class Capture:  # what Textual puts in sys.stdout / sys.stderr while the app runs
        def write(self, s): return len(s)
        def flush(self): pass
        def fileno(self): return -1
        def isatty(self): return False

    real_out = sys.__stdout__
    sys.stdout = sys.stderr = Capture()
    from helpers.models import CharTokenizer, as_loaded, tiny_llama
    from ssd_chat.engine import Engine, EngineConfig, SamplingParams
    from ssd_chat.engine.events import Done, Notice
    from ssd_chat.engine.decode.ssd import SSDDecoder

    base = tiny_llama(head_scale=3.0)
    target, draft = as_loaded(base, CharTokenizer(64), "t"), as_loaded(base, CharTokenizer(64), "d")
    {prepare}
    dec = SSDDecoder(Engine(EngineConfig(mode="ssd", k=2, fan_out="uniform:2"), target, draft))
    try:
        evs = list(dec.stream([1, 2, 3], SamplingParams(max_new_tokens=12)))
        pid = dec.worker_pid
    finally:
        dec.close()
    done = evs[-1]
    notices = [e.message for e in evs if isinstance(e, Notice) and e.level == "warning"]
    real_out.write(f"{{pid}}|{{done.stats.cache_hit_rate}}|{{done.stats.label}}|{{notices}}\\n")
""")


@pytest.mark.parametrize("prepare", ["", "from ssd_chat.engine import processes; processes.prepare()"])
def test_the_speculator_starts_when_stderr_has_no_file_descriptor(prepare):
    """Textual's stderr made every SSD reply in the app plain SD ("bad value(s) in fds_to_keep"): the
    speculator starts (the worker is a process, its cache is hit) with and without an early prepare()."""
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(prepare=prepare)], env=env_with_helpers(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    pid, hit_rate, label, notices = out.stdout.strip().splitlines()[-1].split("|", 3)
    assert pid != "None" and int(pid) != 0, out.stdout
    assert notices == "[]", notices
    assert label == "SSD" and float(hit_rate) > 0  # an identical draft: the cache is hit


def test_real_stdio_restores_the_replaced_streams(monkeypatch):
    class NoFd:
        def write(self, s):
            return len(s)

        def fileno(self):
            return -1

    fake = NoFd()
    monkeypatch.setattr(sys, "stderr", fake)
    with workers.real_stdio():
        assert sys.stderr.fileno() >= 0
    assert sys.stderr is fake


def _wait_then_sleep(conn) -> None:  # a worker: die with the parent, say so, live on
    import time

    workers.die_with_parent()
    conn.send("armed")
    time.sleep(60)


def test_a_worker_outlives_the_thread_that_started_it():
    """PR_SET_PDEATHSIG fires when the *thread* that started a worker ends.  The app loads models (and starts
    tensor-parallel ranks) in a thread that ends after the load, so workers must start from a thread that lives
    as long as the process: a worker started from a short thread, which outlives the worker's prctl, still runs."""
    import threading
    import time

    ctx = workers.context()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_wait_then_sleep, args=(child,), daemon=True)

    def short_thread() -> None:
        workers.start(proc)
        assert parent.poll(60) and parent.recv() == "armed"  # the signal is armed while this thread still runs

    t = threading.Thread(target=short_thread)
    t.start()
    t.join()
    time.sleep(1.0)
    try:
        assert proc.is_alive(), f"the worker {workers.exit_words(proc)} when the thread that started it ended"
    finally:
        proc.kill()
        proc.join(10)


# A fresh interpreter runs a worker's start-up; what it saw goes to a file, since its stdout may be gone.
CHILD = textwrap.dedent("""
    import ctypes, os, sys
    from ssd_chat.engine import processes as workers
    report = open(sys.argv[2], "w")
    ok = workers.child_start(int(sys.argv[1]))
    sig = ctypes.c_int(0)
    ctypes.CDLL("libc.so.6").prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
    print("to-stdout", flush=True)
    print("to-stderr", file=sys.stderr, flush=True)
    report.write(f"{ok}|{sig.value}")
    report.close()
""")

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _child_start(tmp_path, parent_pid, debug):
    env = {k: v for k, v in os.environ.items() if k != "SSD_CHAT_DEBUG"}
    if debug:
        env["SSD_CHAT_DEBUG"] = "1"
    report = tmp_path / "report"
    out = subprocess.run([sys.executable, "-c", CHILD, str(parent_pid), str(report)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    ok, sig = report.read_text().split("|")
    return ok == "True", int(sig), out.stdout + out.stderr


@linux_only
def test_child_start_quiets_the_worker_and_ties_it_to_its_parent(tmp_path):
    ok, sig, said = _child_start(tmp_path, os.getpid(), debug=False)
    assert ok and sig == 9  # SIGKILL when the parent dies
    assert "to-stdout" not in said and "to-stderr" not in said


@linux_only
def test_child_start_keeps_stdio_under_debug(tmp_path):
    ok, _, said = _child_start(tmp_path, os.getpid(), debug=True)
    assert ok and "to-stdout" in said and "to-stderr" in said


@linux_only
def test_child_start_says_stop_when_the_parent_is_gone(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    ok, _, said = _child_start(tmp_path, int(gone.stdout), debug=False)
    assert not ok
    assert "to-stdout" in said  # it returned before touching stdio


FIRST_WORKER = """
import signal
from ssd_chat.engine import processes as workers


def report(conn):
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    conn.send(signal.SIGINT in blocked and signal.SIGHUP in blocked)  # a terminal's Ctrl-C and hang-up


if __name__ == "__main__":
    ctx = workers.context()
    here, there = ctx.Pipe()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    proc = ctx.Process(target=report, args=(there,), daemon=True)
    workers.start(proc)  # the process's first: it also starts multiprocessing's resource tracker
    print("blocked" if here.poll(120) and here.recv() else "not blocked",
          "kept" if signal.pthread_sigmask(signal.SIG_BLOCK, []) == before else "changed")
    proc.join(30)
"""


def test_a_worker_starts_with_ctrl_c_blocked_and_the_caller_keeps_its_mask(tmp_path):
    """Ctrl-C goes to the terminal's whole process group: a worker still importing (before child_start
    ignores it) printed a KeyboardInterrupt traceback on the user's terminal.  Checked in a fresh
    process, whose first worker starts the resource tracker, which unblocks SIGINT in its caller."""
    import subprocess
    import sys

    script = tmp_path / "first_worker.py"
    script.write_text(FIRST_WORKER)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.stdout.split() == ["blocked", "kept"], r.stdout + r.stderr


def test_a_worker_that_said_goodbye_ends_without_the_interpreters_shutdown():
    """``exit_now`` (what the speculator and the TP ranks call after a clean close) ends the process with
    code 0, its atexit handlers run (the simulated padding's tallies are written there) and its output
    flushed, skipping the rest of the interpreter's shutdown (joining threads, tearing modules down)
    that took the speculator seconds, which ``stop`` waited out before terminating it."""
    script = textwrap.dedent("""
        import atexit, sys, threading, time
        from ssd_chat.engine import processes
        atexit.register(lambda: print(" atexit ran", end=""))
        threading.Thread(target=time.sleep, args=(60,)).start()  # a non-daemon thread shutdown would join
        print("served", end="")
        processes.exit_now()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout == "served atexit ran", (r.returncode, r.stdout, r.stderr)
