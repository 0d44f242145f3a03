"""Simulated GPU hardware (engine/model/simulate.py, ssd_chat/bench/simulate.py): the padding gives the
modelled times, the race stays exact and is labelled a simulation everywhere."""

from __future__ import annotations

import json
import time

import pytest
import torch
from typer.testing import CliRunner

from ssd_chat.bench import simulate as sim
from ssd_chat.cli import app
from ssd_chat.engine.model import simulate
from ssd_chat.engine.model.forward import Forwards

pytestmark = pytest.mark.usefixtures("one_thread")


def _profile(tmp_path, **over) -> str:
    raw = {"name": "test", "title": "a test machine", "target": {"step_ms": 12.0, "flat_rows": 4, "per_row_ms": 0.5},
           "draft": {"step_ms": 3.0, "flat_rows": 32}, "k": 3, "fan_out": "uniform:2", "acceptance": 0.7,
           "acceptance_source": "a test", "shared_device": False, "paper": None}
    raw.update(over)
    path = tmp_path / "test.json"
    path.write_text(json.dumps(raw))
    return str(path)


@pytest.fixture
def no_simulation():
    yield
    simulate.deactivate()


def expected_accepted(alpha: float, k: int) -> float:
    """Mean tokens a round emits (accepted + bonus) at i.i.d. per-token acceptance ``alpha``."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def test_the_shipped_profiles_load_and_the_paper_setup_reproduces_its_figures():
    assert {"h100-70b-1b", "h200-8b-1b", "rtx4090-8b-1b"} <= set(simulate.names())
    p = simulate.load_profile("h100-70b-1b")
    b = simulate.bounds(p, expected_accepted(p.acceptance, p.k), p.k, 0.861)  # the paper's hit rate
    assert b["ar"] == pytest.approx(p.paper["ar"], rel=0.01)
    assert b["sd"] == pytest.approx(p.paper["sd"], rel=0.02)
    assert b["ssd"] == pytest.approx(p.paper["ssd"], rel=0.02)
    assert simulate.load_profile("rtx4090-8b-1b").shared_device and p.sources and p.derivation


def test_cost_model():
    c = simulate.Cost(step_ms=10.0, flat_rows=4, per_row_ms=0.5)
    assert [c.ms(r) for r in (1, 4, 5, 8)] == [10.0, 10.0, 10.5, 12.0]


@pytest.mark.parametrize(("over", "why"), [({"acceptance": 1.2}, "acceptance"), ({"k": 0}, "k >= 1"),
                                           ({"target": {"step_ms": 1, "bogus": 2}}, "bogus")])
def test_a_bad_profile_is_one_clear_error(tmp_path, over, why):
    with pytest.raises(simulate.ProfileError, match=why):
        simulate.load_profile(_profile(tmp_path, **over))
    with pytest.raises(simulate.ProfileError, match="unknown profile 'nope'"):
        simulate.load_profile("nope")


def test_padding_gives_the_modelled_times_and_counts_overruns(tmp_path):
    pad = simulate.Padding(simulate.load_profile(_profile(tmp_path)), None)
    for role, rows, want in (("target", 1, 0.012), ("target", 6, 0.013), ("draft", 20, 0.003)):
        t0 = time.perf_counter()
        with pad.forward(role, rows):
            pass  # compute takes ~nothing: the forward lasts the modelled time
        assert time.perf_counter() - t0 >= want
    t = pad.tallies["target"]
    assert t.forwards == 2 and t.modelled_s == pytest.approx(0.025) and t.overruns == 0
    t0 = time.perf_counter()
    with pad.forward("draft", 1):
        time.sleep(0.006)  # compute longer than the model: no padding, counted
    assert pad.tallies["draft"].overruns == 1 and pad.tallies["draft"].compute_s >= 0.006


def test_a_shared_device_makes_forwards_take_turns(tmp_path):
    """Two padders on one lock (as the verifier and the speculator process): two 12 ms forwards at
    once take at least 24 ms, one waited for the device."""
    import threading

    path = _profile(tmp_path, shared_device=True)
    pads = [simulate.Padding(simulate.load_profile(path), str(tmp_path / "lock")) for _ in range(2)]

    both = threading.Barrier(2)

    def one(pad):
        both.wait()
        with pad.forward("target", 1):
            pass

    t0 = time.perf_counter()
    ts = [threading.Thread(target=one, args=(p,)) for p in pads]
    [t.start() for t in ts], [t.join() for t in ts]
    assert time.perf_counter() - t0 >= 0.024
    assert max(p.tallies["target"].device_wait_s for p in pads) >= 0.006  # one waited for most of the other's 12 ms


def test_cores_get_the_hook_only_while_simulating(tmp_path, no_simulation):
    model = Forwards(sim.build_target(0))
    assert model.runner("target").core.latency is None
    simulate.activate(_profile(tmp_path), None)
    core = model.runner("target").core
    assert core.latency is not None
    core.append([1, 2, 3])
    assert simulate.active().tallies["target"].forwards == 1
    simulate.deactivate()
    assert model.runner("target").core.latency is None


def test_calibration_hits_the_asked_acceptance():
    target = sim.build_target(0)
    plist = sim.prompts(2, 0)
    seqs = [p + torch.randint(0, sim.VOCAB, (40,), generator=torch.Generator().manual_seed(i)).tolist() for i, p in enumerate(plist)]
    for alpha in (0.5, 0.9):
        _, eps, got = sim.calibrate(target, alpha, seqs, [len(p) for p in plist], seed=1)
        assert abs(got - alpha) < 0.08 and eps > 0


def test_a_simulated_race_is_exact_labelled_and_pads_the_speculator_too(tmp_path, no_simulation):
    prof = _profile(tmp_path)
    report = sim.race(prof, [0.8], n_prompts=2, max_new=24, seed=0, say=lambda s: None)
    assert report["simulated"] is True and report["kind"] == "simulation" and report["label"].startswith("SIMULATED")
    (row,) = report["rows"]
    assert row["sd"]["greedy_equal_ar"] and row["ssd"]["greedy_equal_ar"]
    assert row["ssd"]["cache_hit_rate"] > 0 and row["ssd"]["overhead"]["rounds"] > 0
    assert report["padding"]["speculators"]["draft"]["forwards"] > 0  # the speculator process padded its forwards
    assert report["padding"]["verifier"]["target"]["forwards"] > 0
    assert simulate.active() is None  # switched off again


def test_the_command_says_simulated_and_fails_on_a_greedy_mismatch(tmp_path, monkeypatch, no_simulation):
    real = sim.race

    def planted(*a, **k):  # a decoder bug: SSD's tokens differ from AR's
        rep = real(*a, **k)
        rep["rows"][0]["ssd"]["greedy_equal_ar"] = False
        return rep

    prof = _profile(tmp_path)
    args = ["bench", "--simulate", prof, "--acceptance", "0.8", "--limit", "1", "-n", "16", "-q"]
    r = CliRunner().invoke(app, [*args, "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md")])
    assert r.exit_code == 0, r.output
    assert "SIMULATED" in r.output and "not a GPU measurement" in r.output
    assert json.loads((tmp_path / "r.json").read_text())["simulated"] is True
    assert "SIMULATED" in (tmp_path / "r.md").read_text()
    monkeypatch.setattr(sim, "race", planted)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 3


@pytest.mark.parametrize(("args", "msg"), [(["--simulate", "nope"], "unknown profile 'nope'"),
                                           (["--simulate", "h100-70b-1b", "--acceptance", "0,7"], "--acceptance"),
                                           (["--simulate", "h100-70b-1b", "--target", "x"], "does not apply")])
def test_bad_simulate_usage_is_one_line(args, msg):
    r = CliRunner().invoke(app, ["bench", *args])
    assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output


def test_dry_run_prints_the_plan_and_runs_nothing(monkeypatch):
    def ran(*a, **k):
        raise AssertionError("the race ran")

    monkeypatch.setattr(sim, "race", ran)
    r = CliRunner().invoke(app, ["bench", "--simulate", "h100-70b-1b", "--dry-run", "--acceptance", "0.6,0.8", "--limit", "2"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert "SIMULATED" in text and "k=7" in text and "acceptance 0.6, 0.8" in text and "2 prompts x 128 tokens" in text
    assert "dry run: nothing was run" in text
    assert simulate.active() is None
    r = CliRunner().invoke(app, ["bench", "--simulate", "nope", "--dry-run"])  # still checked first
    assert r.exit_code == 2 and "unknown profile 'nope'" in r.output
