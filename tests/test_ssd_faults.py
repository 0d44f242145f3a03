"""SSD reliability: the speculator dies, raises or hangs; the reply goes on exactly; no process is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from helpers import env_with_helpers
from helpers.models import CharTokenizer, as_loaded, perturbed, tiny_llama
from ssd_chat.engine.decode.ar import ARDecoder
from ssd_chat.engine.events import Done, Notice, Round
from ssd_chat.engine.params import SamplingParams
from helpers.decoding import PROMPTS, run, ssd


@pytest.fixture(scope="module")
def seed2_pair():
    base = tiny_llama(seed=2, head_scale=3.0)
    return as_loaded(base, CharTokenizer(64), "t"), as_loaded(perturbed(base, 0.1), CharTokenizer(64), "d")


def gone(pid: int, within_s: float = 10.0) -> bool:
    """True once ``pid`` no longer exists (or is a zombie nobody will run again)."""
    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def check_exact_with_notice(seed2_pair, evs, done, prompt, n, notice_re):
    target, _ = seed2_pair
    ref = run(ARDecoder(target), prompt, max_new_tokens=n)[1]
    assert done.reason == "length" and done.token_ids == ref.token_ids and done.text == ref.text
    notices = [e for e in evs if isinstance(e, Notice)]
    assert len(notices) == 1 and notices[0].level == "warning", notices
    assert notice_re in notices[0].message and "as SD" in notices[0].message, notices[0].message


def killed_at_round(dec, index: int, prompt: list[int], max_new_tokens: int) -> tuple[list, int]:
    """A reply whose speculator process is killed (SIGKILL) at round ``index``: (its events, that pid)."""
    dec.ping()
    pid = dec.worker_pid
    evs = []
    for ev in dec.stream(prompt, SamplingParams(max_new_tokens=max_new_tokens)):
        evs.append(ev)
        if isinstance(ev, Round) and ev.index == index:
            os.kill(pid, signal.SIGKILL)
    return evs, pid


def test_killed_mid_reply(seed2_pair):
    dec = ssd(*seed2_pair, k=3, fan_out="uniform:2")
    try:
        evs, pid = killed_at_round(dec, 2, PROMPTS[1], 60)
        check_exact_with_notice(seed2_pair, evs, evs[-1], PROMPTS[1], 60, "")
        assert gone(pid)
        # the reply says what produced it: SSD for the rounds before the kill, SD after
        stats, notice = evs[-1].stats, next(e for e in evs if isinstance(e, Notice))
        assert notice.mode == "sd" and stats.ran_as == "sd" and stats.switched_after == notice.after_round >= 3
        assert stats.label == f"SSD → SD after round {stats.switched_after}"
        rounds = [e for e in evs if isinstance(e, Round)]
        assert rounds[-1].cache_hit is None and len(rounds[-1].drafted) == 3  # SD rounds after the failure
        # the next reply starts a fresh speculator and is SSD again
        evs2, done2 = run(dec, PROMPTS[1], max_new_tokens=60)
        assert done2.token_ids == evs[-1].token_ids and dec.worker_pid not in (None, pid)
        assert not [e for e in evs2 if isinstance(e, Notice)] and done2.stats.cache_hit_rate > 0
        assert done2.stats.ran_as is None and done2.stats.label == "SSD"
    finally:
        new = dec.worker_pid
        dec.close()
    assert new is None or gone(new)


@pytest.mark.parametrize(("fault", "timeout", "message"), [
    ("raise:3", 30.0, "injected fault"),
    ("exit:2", 30.0, "exited unexpectedly"),
    ("sleep:3:60", 1.0, "did not answer within 1 s"),
])
def test_speculator_fault(seed2_pair, fault, timeout, message):
    target, draft = seed2_pair
    from ssd_chat.engine.engine import Engine, EngineConfig
    from ssd_chat.engine.decode.ssd import SSDDecoder

    class Faulty(SSDDecoder):
        pass

    Faulty.fault = fault
    dec = Faulty(Engine(EngineConfig(mode="ssd", k=2, speculator_timeout_s=timeout), target, draft))
    try:
        dec.ping()
        pid = dec.worker_pid
        t0 = time.perf_counter()
        evs, done = run(dec, PROMPTS[2], max_new_tokens=40)
        elapsed = time.perf_counter() - t0
        check_exact_with_notice(seed2_pair, evs, done, PROMPTS[2], 40, message)
        assert gone(pid)  # a hung speculator is terminated, not left behind
        assert elapsed < 50  # the 60 s sleep was not waited out
    finally:
        dec.close()


def test_no_draft_in_process_continues_as_ar(seed2_pair, monkeypatch):
    dec = ssd(*seed2_pair, k=2)
    monkeypatch.setattr(type(dec), "_has_local_draft", lambda self: False)
    try:
        evs, pid = killed_at_round(dec, 1, PROMPTS[0], 40)
        done = evs[-1]
        assert isinstance(done, Done) and done.token_ids == run(ARDecoder(seed2_pair[0]), PROMPTS[0], max_new_tokens=40)[1].token_ids
        assert any(isinstance(e, Notice) and "as AR" in e.message for e in evs)
        assert done.stats.ran_as == "ar" and done.stats.label.startswith("SSD → AR after round ")
        # close() ends the (restarted) worker
        run(dec, PROMPTS[0], max_new_tokens=4)
        pid = dec.worker_pid
        assert pid is not None and psutil.pid_exists(pid)
        dec.close()
        assert gone(pid, 5) and dec.worker_pid is None
    finally:
        dec.close()


APP = textwrap.dedent("""
    import os, sys, time
    from helpers.models import CharTokenizer, as_loaded, tiny_llama
    from helpers.decoding import ssd
    from ssd_chat.engine.params import SamplingParams

    if __name__ == "__main__":
        t = as_loaded(tiny_llama(head_scale=3.0), CharTokenizer(64), "t")
        dec = ssd(t, as_loaded(tiny_llama(seed=1, head_scale=3.0), CharTokenizer(64), "d"), k=2)
        dec.ping()
        print(dec.worker_pid, flush=True)
        how = sys.argv[1]
        if how == "exception":
            raise RuntimeError("the app crashed")
        if how in ("sigint", "sigkill"):
            while True:  # replying until interrupted
                for _ in dec.stream([1, 2, 3], SamplingParams(max_new_tokens=400)):
                    pass
        # "normal": exit without closing anything
""")


@pytest.mark.parametrize("how", ["normal", "exception", "sigint", "sigkill"])
def test_no_worker_outlives_the_app(how, repo_root):
    proc = subprocess.Popen([sys.executable, "-c", APP, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=repo_root,
                            env=env_with_helpers())
    try:
        line = proc.stdout.readline()
        assert line.strip(), f"the app script died before starting its worker: {proc.communicate(timeout=30)[1][-2000:]}"
        pid = int(line)
        if how == "sigint":
            time.sleep(1.0)
            proc.send_signal(signal.SIGINT)
        elif how == "sigkill":
            time.sleep(1.0)
            proc.kill()
        proc.wait(60)
        assert gone(pid, 10), f"speculator {pid} outlived the app ({how})"
        err = proc.stderr.read()
        if how == "sigint":
            assert "KeyboardInterrupt" in err and err.count("Traceback") == 1  # the app's, none from the worker
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
