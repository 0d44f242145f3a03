"""`ssd-chat bench`: prompt sets, hardware plans, the race on tiny models, the report
(JSON schema, ratios from the same run, the physical bound, greedy exactness, a
deliberately mismatching decoder), the CLI on the packaged model, and the GPU preset."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from helpers.models import CharTokenizer, as_loaded, perturbed, tiny_llama
from ssd_chat.bench import BenchError
from ssd_chat.bench import render as br_render
from ssd_chat.bench import report as br
from ssd_chat.bench.prompts import FAMILIES, BenchPrompt, load_prompts
from ssd_chat.bench.protocols import Hardware, gpu_preset, make_plans
from ssd_chat.bench.report import build_report
from ssd_chat.bench.runner import BenchSettings, run_bench
from ssd_chat.cli import app
from ssd_chat.engine.engine import DECODERS, EngineConfig
from ssd_chat.engine.events import Done
from ssd_chat.engine.params import SamplingParams

TWO_CORES = Hardware((0, 1), 0)


# --- prompt sets --------------------------------------------------------------------------------


def test_every_family_has_at_least_16_distinct_prompts():
    for fam in FAMILIES:
        ps, source = load_prompts(fam)
        assert source == fam
        assert len(ps) >= 16, fam
        assert len({p.text for p in ps}) == len(ps) and len({p.id for p in ps}) == len(ps)
        assert {p.family for p in ps} == {fam}


def test_all_interleaves_families_and_limit_is_per_family():
    ps, _ = load_prompts("all", limit=2)
    assert [p.family for p in ps] == [*FAMILIES, *FAMILIES]
    ps, _ = load_prompts("math,code", limit=3)
    assert [p.family for p in ps] == ["math", "code"] * 3


def test_prompt_files(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "one", "family": "x"}\n\n"two"\n{"id": "p3", "prompt": "three"}\n')
    ps, source = load_prompts(str(f))
    assert [(p.text, p.family) for p in ps] == [("one", "x"), ("two", "mine"), ("three", "mine")]
    assert ps[2].id == "p3" and source == str(f)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "prompt": "one"}\n{"id": "a", "prompt": "two"}\n')
    assert len({p.id for p in load_prompts(str(dup))[0]}) == 2
    t = tmp_path / "lines.txt"
    t.write_text("a question\n\nanother\n")
    assert [p.text for p in load_prompts(str(t), limit=1)[0]] == ["a question"]


@pytest.mark.parametrize("content, message", [
    ('{"prompt": 3}\n', "non-empty"),
    ("{not json\n", "not valid JSON"),
    ("", "holds no prompts"),
])
def test_bad_prompt_files_are_clear_errors(tmp_path, content, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(BenchError, match=message):
        load_prompts(str(f))


def test_unknown_prompt_set():
    with pytest.raises(BenchError, match="neither a prompt set"):
        load_prompts("poems")


# --- hardware plans -------------------------------------------------------------------------------


def test_cpu_plans_follow_the_two_protocols():
    plans, notes = make_plans(("paper", "equal"), ("ar", "sd", "ssd"), "auto", "auto", TWO_CORES)
    by = {(p.protocol, p.mode): p for p in plans}
    assert notes == []
    for mode in ("ar", "sd"):
        assert (by["paper", mode].cores, by["paper", mode].threads) == ((0,), 1)
        assert (by["equal", mode].cores, by["equal", mode].threads) == ((0, 1), 2)
    for proto in ("paper", "equal"):
        assert (by[proto, "ssd"].cores, by[proto, "ssd"].threads, by[proto, "ssd"].draft_device) == ((0,), 1, "cpu:1")
    # SSD has the same placement in both protocols: one slot, run once
    assert by["paper", "ssd"].slot == by["equal", "ssd"].slot
    assert by["paper", "ar"].slot != by["equal", "ar"].slot


def test_single_core_plan_says_ssd_cannot_overlap():
    plans, notes = make_plans(("paper",), ("ar", "ssd"), "auto", "auto", Hardware((0,), 0))
    assert [p.cores for p in plans] == [(0,), (0,)]
    assert any("shares" in n for n in notes)


def test_gpu_plans_give_the_draft_its_own_gpu():
    plans, notes = make_plans(("paper", "equal"), ("ar", "sd", "ssd"), "auto", "auto", Hardware((0, 1), 2))
    by = {(p.protocol, p.mode): p for p in plans}
    assert notes == []
    assert (by["paper", "ar"].target_device, by["paper", "sd"].draft_device) == ("cuda:0", "cuda:0")
    assert (by["paper", "ssd"].target_device, by["paper", "ssd"].draft_device) == ("cuda:0", "cuda:1")
    assert by["equal", "ar"].target_device == "pipeline:cuda:0,cuda:1"  # AR/SD get the draft's GPU too (a device_map)
    assert all(p.cores is None for p in plans)


def test_gpu_plans_with_one_gpu_say_so():
    _, notes = make_plans(("paper",), ("ar", "ssd"), "cuda", "auto", Hardware((0, 1), 1))
    assert any("shares cuda:0" in n for n in notes)
    with pytest.raises(BenchError, match="no NVIDIA GPU"):
        make_plans(("paper",), ("ar",), "cuda:0", "auto", Hardware((0, 1), 0))


def test_cpu_plans_for_a_tensor_parallel_target_run_every_mode_on_its_ranks():
    plans, notes = make_plans(("paper", "equal"), ("ar", "sd", "ssd"), "cpu:0,cpu:1", "auto", Hardware((0, 1, 2, 3), 0))
    assert {p.target_device for p in plans} == {"cpu:0,cpu:1"} and {p.cores for p in plans} == {(0, 1)}
    assert {p.draft_device for p in plans if p.mode == "ssd"} == {"cpu:3"} and notes == []
    with pytest.raises(BenchError, match="no core 7"):
        make_plans(("paper",), ("ar",), "cpu:0,cpu:7", "auto", Hardware((0, 1), 0))


def test_the_memory_bound_counts_a_sharded_target_from_its_weightless_copy():
    import torch

    from ssd_chat.bench.machine import weight_bytes

    model = tiny_llama(seed=0)
    with torch.device("meta"):
        meta = type(model)(model.config)
    assert weight_bytes(meta.to(torch.float64)) == weight_bytes(model) > 0


def test_bad_core_is_a_clear_error():
    with pytest.raises(BenchError, match="core 5 is not available"):
        make_plans(("paper",), ("ssd",), "auto", "cpu:5", TWO_CORES)


# --- the GPU preset ---------------------------------------------------------------------------------


def test_gpu_preset_picks_a_local_pair_and_the_last_gpu_for_the_draft(monkeypatch):
    from ssd_chat.engine.load import models

    monkeypatch.setattr(models, "local_status", lambda: [{"alias": a, "local": True} for a in ("smollm2-1.7b", "smollm2-135m")])
    values, notes = gpu_preset({"target": "smollm2-135m-gguf"}, set(), Hardware((0, 1), 4))
    assert (values["target"], values["draft"], values["dtype"]) == ("smollm2-1.7b", "smollm2-135m", "bfloat16")
    assert (values["target_device"], values["draft_device"]) == ("cuda:0", "cuda:3")
    _, notes = gpu_preset({"target": "x"}, {"target"}, Hardware((0, 1), 1))
    assert any("one GPU" in n for n in notes)
    monkeypatch.setattr(models, "local_status", lambda: [])
    with pytest.raises(BenchError, match="no \\(target, draft\\) pair"):
        gpu_preset({}, set(), Hardware((0, 1), 2))
    with pytest.raises(BenchError, match="needs an NVIDIA GPU"):
        gpu_preset({}, set(), Hardware((0, 1), 0))


def test_preset_gpu_without_a_gpu_is_a_one_line_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = CliRunner().invoke(app, ["bench", "--preset", "gpu", "--dry-run"])
    assert r.exit_code == 1
    assert "needs an NVIDIA GPU" in r.stderr and "Traceback" not in r.output


def test_dry_run_prints_the_plan_before_loading(monkeypatch):
    from ssd_chat.cli import bench as command

    monkeypatch.setattr(command, "_estimate", lambda *a, **k: 0)  # the estimate loads the models: tested below
    r = CliRunner().invoke(app, ["bench", "--dry-run", "--limit", "2", "--protocol", "paper"])
    assert r.exit_code == 0, r.output
    assert "8 prompts" in r.stdout and "protocol paper" in r.stdout and "protocol equal" not in r.stdout
    assert "repeat(s), greedy\n" in r.stdout
    r = CliRunner().invoke(app, ["bench", "--dry-run", "--limit", "1", "--temperature", "0.8", "--repetition-penalty", "1.1"])
    assert r.exit_code == 0 and "temperature 0.8, repetition penalty 1.1\n" in r.stdout, r.output


@pytest.mark.parametrize("args, message", [
    (["--modes", "ar,xx"], "unknown mode"),
    (["--protocol", "fast"], "unknown protocol"),
    (["--preset", "tpu"], "unknown preset"),
])
def test_bad_arguments_are_usage_errors(args, message):
    r = CliRunner().invoke(app, ["bench", "--dry-run", *args])
    assert r.exit_code == 2
    assert message in r.output


# --- the race on tiny models ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair():
    """float64 target + a noisy copy as draft: mixed accept/reject, exact greedy agreement with AR."""
    base = tiny_llama(head_scale=3.0)
    draft = perturbed(base, 0.1)
    return as_loaded(base, CharTokenizer(64), "tiny-target"), as_loaded(draft, CharTokenizer(64), "tiny-draft")


PROMPTS = [BenchPrompt("code-01", "code", "abcde"), BenchPrompt("math-01", "math", "hello"),
           BenchPrompt("chat-01", "chat", "zyxwvu")]


def _encode(engine, p):  # noqa: ARG001 - the char tokenizer needs no chat template
    return [ord(c) - ord("a") for c in p.text], ()


def _race(pair, modes=("ar", "sd", "ssd"), protocols=("paper", "equal"), max_new=12, repeats=1):
    target, draft = pair
    plans, notes = make_plans(protocols, modes, "cpu", "auto", Hardware.detect())
    settings = BenchSettings(modes=modes, protocols=protocols, max_new_tokens=max_new, repeats=repeats, warmup_tokens=4)
    base = EngineConfig(target="tiny-target", draft="tiny-draft", mode="sd", k=3)
    result = run_bench(base, lambda plan: (target, draft), PROMPTS, plans, settings, encode=_encode)
    models = {"target": {"name": "tiny-target", "params": 1}, "draft": {"name": "tiny-draft", "params": 1}}
    machine = {"summary": "test", "cpu": "test"}
    report = build_report(result, plans, settings, PROMPTS, "test", models, {"k": 3}, machine, notes,
                          decode=target.tokenizer.decode)
    return result, report


@pytest.fixture(scope="module")
def race(tiny_pair):
    return _race(tiny_pair)


def test_every_mode_runs_every_prompt_interleaved(race):
    result, report = race
    slots = {r["slot"] for r in result.runs}
    assert len(slots) == 5  # ar, sd under each protocol; ssd once (same placement in both)
    assert len(result.runs) == len(PROMPTS) * 5
    assert not result.skipped
    for pid in {p.id for p in PROMPTS}:
        rs = [r for r in result.runs if r["prompt_id"] == pid]
        assert sorted(r["order"] for r in rs) == list(range(5))
    # the order rotates: the first configuration to run differs from prompt to prompt
    firsts = [next(r["run_id"] for r in result.runs if r["prompt_id"] == p.id and r["order"] == 0) for p in PROMPTS]
    assert len(set(firsts)) == len(PROMPTS)
    assert all(r["new_tokens"] == 12 and r["error"] is None for r in result.runs)


def test_report_json_schema(race, tmp_path):
    _, report = race
    path = tmp_path / "b.json"
    br.write_json(report, path)
    data = json.loads(path.read_text())
    assert data["schema"] == br.SCHEMA
    assert {"machine", "models", "settings", "protocols", "runs", "placements", "skipped_modes", "notes"} <= set(data)
    assert set(data["protocols"]) == {"paper", "equal"}
    for proto in data["protocols"].values():
        assert set(proto["modes"]) == {"ar", "sd", "ssd"}
        for m in proto["modes"].values():
            assert {"median", "p25", "p75", "min", "max", "n"} <= set(m["tok_per_s"])
            assert m["tok_per_s"]["p25"] <= m["tok_per_s"]["median"] <= m["tok_per_s"]["p75"]
            assert {"ttft_s", "mean_accepted_length", "acceptance_rate", "cache_hit_rate", "tok_per_s_by_family"} <= set(m)
        assert set(proto["ratios"]) == {"ssd/sd", "ssd/ar", "sd/ar"}
        assert proto["modes"]["ar"]["mean_accepted_length"] is None
        assert 1 <= proto["modes"]["sd"]["mean_accepted_length"] <= 4
        assert 0 <= proto["modes"]["ssd"]["cache_hit_rate"] <= 1
    assert data["channel_round_trip_ms"] > 0  # measured through the SSD decoder
    assert all("targets" not in p for p in data["protocols"].values())  # figures and bounds, no verdicts


def test_memory_bound_is_weight_bytes_over_the_measured_bandwidth(race, tiny_pair):
    """Each mode's ceiling: its tokens per target forward / (bytes of the target's weights / bandwidth its placement read at)."""
    from ssd_chat.bench.machine import weight_bytes

    result, report = race
    target = tiny_pair[0].model
    table = target.model.embed_tokens.weight  # untied: its rows are read, the table is not streamed
    w = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in [*target.parameters(), *target.buffers()]}.values())
    w -= table.numel() * table.element_size()
    assert result.weight_bytes == weight_bytes(target) == w
    for name, proto in report["protocols"].items():
        mb = proto["memory_bound"]
        assert mb["weight_bytes"] == w and set(mb["modes"]) == {"ar", "sd", "ssd"}
        for mode, b in mb["modes"].items():
            bw = result.bandwidth[report["placements"][name][mode]["slot"]]
            assert bw > 0 and b["bandwidth_bytes_per_s"] == bw
            assert b["forward_s_min"] == pytest.approx(w / bw)
            per_forward = proto["modes"][mode]["mean_accepted_length"] or 1.0
            assert b["tok_per_s_max"] == pytest.approx(per_forward * bw / w)
            assert b["measured_over_bound"] == pytest.approx(proto["modes"][mode]["tok_per_s"]["median"] / b["tok_per_s_max"])
    assert "memory bound on decode tok/s" in br_render.markdown(report)


def test_memory_bound_by_hand():
    modes = {"ar": br.summarize_mode([_rec("ar", "a", 10.0)]), "sd": br.summarize_mode([_rec("sd", "a", 15.0, 4, 0.4, 1.0)])}
    mb = br.memory_bound(modes, {"ar": "s-ar", "sd": "s-sd"}, 500_000_000, {"s-ar": 10e9, "s-sd": 20e9})
    assert mb["modes"]["ar"]["forward_s_min"] == pytest.approx(0.05) and mb["modes"]["ar"]["tok_per_s_max"] == pytest.approx(20.0)
    assert mb["modes"]["ar"]["measured_over_bound"] == pytest.approx(0.5)
    # SD: 1 + 4 accepted / 4 rounds = 2 tokens per target forward, at 20 GB/s a forward takes 25 ms
    assert mb["modes"]["sd"]["tok_per_s_max"] == pytest.approx(2 / 0.025)
    assert br.memory_bound(modes, {}, 500_000_000, {})["modes"] == {} and br.memory_bound(modes, {}, None, {}) is None


def test_ratios_and_bound_come_from_the_same_runs(race):
    result, report = race
    for name, proto in report["protocols"].items():
        runs = {m: [r for r in result.runs if r["slot"] == report["placements"][name][m]["slot"]] for m in ("ar", "sd", "ssd")}
        med = {m: statistics.median(r["tok_per_s"] for r in rs) for m, rs in runs.items()}
        assert len(runs["ar"]) == len(PROMPTS)
        for a, b in br.RATIOS:
            assert proto["ratios"][f"{a}/{b}"]["of_medians"] == pytest.approx(med[a] / med[b])
    # the bound: SD's draft/verify split on SSD's verifier hardware (paper), and the same SSD ceiling under equal
    paper_sd = [r for r in result.runs if r["slot"] == report["placements"]["paper"]["sd"]["slot"]]
    bound = 1 + sum(r["draft_s"] for r in paper_sd) / sum(r["verify_s"] for r in paper_sd)
    ceiling = statistics.median(r["tok_per_s"] for r in paper_sd) * bound
    ssd_med = statistics.median(r["tok_per_s"] for r in result.runs if r["mode"] == "ssd")
    for name, proto in report["protocols"].items():
        sd_med = statistics.median(r["tok_per_s"] for r in result.runs if r["slot"] == report["placements"][name]["sd"]["slot"])
        b = proto["bound"]
        assert b["ssd_tok_per_s_max"] == pytest.approx(ceiling)
        assert b["ssd_over_sd_max"] == pytest.approx(ceiling / sd_med)
        assert b["measured_over_bound"] == pytest.approx(ssd_med / ceiling)
    assert report["protocols"]["paper"]["bound"]["ssd_over_sd_max"] == pytest.approx(bound)


def test_markdown_summary(race):
    _, report = race
    md = br_render.markdown(report)
    for proto in ("paper", "equal"):
        for mode in ("AR", "SD", "SSD"):
            assert f"| {proto} | {mode} |" in md
    med = report["protocols"]["paper"]["modes"]["ssd"]["tok_per_s"]["median"]
    assert f"**{med:.1f}**" in md and "3/3" in md


def test_the_greedy_equals_ar_cell():
    """The "= AR" column of both tables: unchecked, AR itself, all identical, a mismatch."""
    ex = {"checked": True, "modes": {"sd": {"compared": 3, "identical": 3}, "ssd": {"compared": 3, "identical": 1}}}
    assert br_render._vs_ar({"checked": False}, "sd", "ref") == ("n/a", None)
    assert br_render._vs_ar(ex, "ar", "reference") == ("reference", None)
    assert br_render._vs_ar(ex, "sd", "ref") == ("3/3", True)
    assert br_render._vs_ar(ex, "ssd", "ref") == ("1/3", False)


def test_greedy_exactness_is_asserted(race):
    _, report = race
    for proto in report["protocols"].values():
        ex = proto["exactness"]
        assert ex["checked"] and ex["all_identical"]
        assert {m: (v["compared"], v["identical"]) for m, v in ex["modes"].items()} == {"sd": (3, 3), "ssd": (3, 3)}


class _Corrupting:
    """An SD decoder that changes the 4th token of every reply: a deliberately wrong decoder."""

    def __init__(self, engine):
        from ssd_chat.engine.decode.sd import SDDecoder

        self.inner = SDDecoder(engine)

    def stream(self, ids, params, stop=None):
        for ev in self.inner.stream(ids, params, stop):
            if isinstance(ev, Done):
                t = ev.token_ids
                ev = replace(ev, token_ids=(*t[:3], (t[3] + 1) % 64, *t[4:]))
            yield ev


def test_a_mismatching_decoder_is_reported_loudly(tiny_pair, monkeypatch):
    from rich.console import Console

    monkeypatch.setitem(DECODERS, "sd", _Corrupting)
    _, report = _race(tiny_pair, modes=("ar", "sd"), protocols=("paper",), max_new=8)
    ex = report["protocols"]["paper"]["exactness"]
    assert not ex["all_identical"]
    mm = ex["modes"]["sd"]["mismatches"]
    assert len(mm) == len(PROMPTS) and {m["position"] for m in mm} == {3}
    assert all(m["token"] == (m["ar_token"] + 1) % 64 for m in mm)
    console = Console(record=True, width=200)
    br_render.render(report, console)
    text = console.export_text()
    assert "GREEDY MISMATCH" in text and "at token 3" in text and "token-for-token identical" not in text
    assert f"0/{len(PROMPTS)}" in text and "ref" in text  # the table's "= AR" column


def test_an_unavailable_mode_is_skipped_with_a_message(tiny_pair, monkeypatch):
    def missing(engine):  # noqa: ARG001
        raise ImportError("No module named 'ssd_chat.engine.decode.ssd'")

    monkeypatch.setitem(DECODERS, "ssd", missing)
    result, report = _race(tiny_pair, modes=("ar", "ssd"), protocols=("paper",), max_new=4)
    assert "not available in this build" in result.skipped["ssd"]
    assert set(report["protocols"]["paper"]["modes"]) == {"ar"}
    assert report["skipped_modes"] == result.skipped


def test_a_draft_the_mode_refuses_skips_that_mode_with_its_message(tiny_pair, monkeypatch):
    """E.g. `bench -d features`: SD runs, SSD is skipped with the engine's own message."""
    from ssd_chat.engine import engine as engine_mod
    from ssd_chat.engine.errors import ParamError

    def refuse(mode, draft):  # noqa: ARG001
        if mode == "ssd":
            raise ParamError("draft 'tiny-draft' is a feature draft")

    monkeypatch.setattr(engine_mod, "check_draft_for_mode", refuse)
    result, report = _race(tiny_pair, modes=("ar", "sd", "ssd"), protocols=("paper",), max_new=4)
    assert "is a feature draft" in result.skipped["ssd"]
    assert set(report["protocols"]["paper"]["modes"]) == {"ar", "sd"}


def test_pinning_is_restored(tiny_pair):
    threads = torch.get_num_threads()
    affinity = os.sched_getaffinity(0)
    _race(tiny_pair, modes=("ar",), max_new=4)
    assert torch.get_num_threads() == threads and os.sched_getaffinity(0) == affinity


def test_sampling_runs_skip_the_exactness_check(tiny_pair):
    target, draft = tiny_pair
    plans, notes = make_plans(("paper",), ("ar", "sd"), "cpu", "auto", Hardware.detect())
    settings = BenchSettings(modes=("ar", "sd"), protocols=("paper",), max_new_tokens=6, sampling=SamplingParams(0.8, ignore_eos=True), warmup_tokens=2)
    result = run_bench(EngineConfig(mode="sd", k=2), lambda p: (target, draft), PROMPTS[:1], plans, settings, encode=_encode)
    report = build_report(result, plans, settings, PROMPTS[:1], "t", {"target": {"name": "t"}}, {"k": 2}, {"summary": ""}, notes)
    assert report["protocols"]["paper"]["exactness"]["checked"] is False


def test_penalties_reach_every_mode_and_greedy_runs_stay_exact(tiny_pair, race):
    """`bench --repetition-penalty`: the penalty changes AR's greedy tokens, SD and SSD still equal them, and the
    report says which penalty ran."""
    from ssd_chat.bench.render import markdown

    target, draft = tiny_pair
    plans, notes = make_plans(("paper",), ("ar", "sd", "ssd"), "cpu", "auto", Hardware.detect())
    settings = BenchSettings(modes=("ar", "sd", "ssd"), protocols=("paper",), max_new_tokens=12, warmup_tokens=4,
                             sampling=SamplingParams(repetition_penalty=8.0, ignore_eos=True))
    result = run_bench(EngineConfig(mode="sd", k=3), lambda p: (target, draft), PROMPTS, plans, settings, encode=_encode)
    report = build_report(result, plans, settings, PROMPTS, "t", {"target": {"name": "t"}}, {"k": 3}, {"summary": ""}, notes)
    ex = report["protocols"]["paper"]["exactness"]
    assert ex["checked"] and ex["all_identical"] and ex["modes"]["ssd"]["compared"] == 3

    def ar_tokens(run):
        return {r["prompt_id"]: run.tokens[r["run_id"]] for r in run.runs if r["mode"] == "ar" and r["repeat"] == 0}

    plain, penalised = ar_tokens(race[0]), ar_tokens(result)
    assert sorted(plain) == sorted(penalised) == sorted(p.id for p in PROMPTS) and plain != penalised
    assert report["settings"]["repetition_penalty"] == 8.0 and "greedy, repetition penalty 8.0" in markdown(report)


def test_a_background_build_is_waited_for_and_every_configuration_warmed_again(tiny_pair, monkeypatch):
    """A warm-up that starts building graphs (``--compile auto``, a cold cache): the race waits for the build, says
    so, and warms every configuration up again, so that no timed reply runs eagerly beside a compile."""
    from ssd_chat.engine.engine import Engine

    target, draft = tiny_pair
    building = iter(["compiling t for 3 rows in the background, 40%"] * 3)
    monkeypatch.setattr(target.forwards, "status", lambda: next(building, None))
    streams: list[int] = []
    real = Engine.stream
    monkeypatch.setattr(Engine, "stream", lambda self, *a, **k: (streams.append(1), real(self, *a, **k))[1])
    said: list[str] = []
    plans, _ = make_plans(("paper",), ("ar", "sd"), "cpu", "auto", Hardware.detect())
    settings = BenchSettings(modes=("ar", "sd"), protocols=("paper",), max_new_tokens=4, warmup_tokens=2)
    result = run_bench(EngineConfig(mode="sd", k=2), lambda p: (target, draft), PROMPTS[:1], plans, settings,
                       encode=_encode, progress=said.append)
    assert said[0] == "waiting for the graphs the replies will run: compiling t for 3 rows in the background, 40%"
    assert len(streams) == 2 * 2 + 2 and len(result.runs) == 2  # two warm-ups per configuration, then the race


# --- the report from hand-made records ---------------------------------------------------------------


def test_a_load_stage_is_printed_once_however_often_the_load_reports_it(tiny_pair, monkeypatch):
    """The load reports a stage at each step of its fraction (a conversion about 20 times): bench's log says it once."""
    from types import SimpleNamespace

    from ssd_chat.bench.runner import ModelPool
    from ssd_chat.chat.settings import DEFAULTS
    from ssd_chat.engine import Engine

    def load(cfg, progress):  # noqa: ARG001
        for f in (0.0, 0.25, 0.5, 1.0):
            progress("converting m.gguf to safetensors (once)", f)
        progress("loading the target", None)
        progress("loading the target", 1.0)
        return SimpleNamespace(target=tiny_pair[0], draft=tiny_pair[1])

    monkeypatch.setattr(Engine, "load", staticmethod(load))
    said: list[str] = []
    ModelPool({**DEFAULTS, "target": "tiny-target", "draft": "layers:1"}, make_plans(("paper",), ("ar", "sd"), "cpu", "cpu", Hardware((0, 1), 0))[0],
              progress=said.append)
    assert said == ["converting m.gguf to safetensors (once)", "loading the target"]


def _rec(mode, pid, tps, rounds=0, draft_s=0.0, verify_s=0.0, **kw):
    r = {"run_id": f"{mode}|x|{pid}|0", "mode": mode, "prompt_id": pid, "family": "f", "repeat": 0, "tok_per_s": tps,
         "ttft_s": 0.1, "elapsed_s": 1.0, "new_tokens": 10, "rounds": rounds, "drafted": 3 * rounds, "accepted": rounds,
         "ssd_rounds": 0, "hits": 0, "draft_s": draft_s, "verify_s": verify_s, "wait_s": 0.0, "wait_on_hit_s": 0.0,
         "verify_on_hit_s": 0.0, "speculator_busy_s": 0.0, "fallback_rounds": 0, "error": None, "background_cpu_s": None}
    r.update(kw)
    return r


def test_bound_and_paired_ratios_by_hand():
    runs = {
        "ar": [_rec("ar", "a", 10.0), _rec("ar", "b", 20.0)],
        "sd": [_rec("sd", "a", 12.0, 5, 0.5, 1.0), _rec("sd", "b", 30.0, 5, 0.5, 1.0)],
        "ssd": [_rec("ssd", "a", 18.0, 4, 0.0, 0.8, ssd_rounds=4, hits=3, wait_s=0.06, wait_on_hit_s=0.03, verify_on_hit_s=0.6),
                _rec("ssd", "b", 39.0, 4, 0.0, 0.8, ssd_rounds=4, hits=2, wait_s=0.05, wait_on_hit_s=0.02, verify_on_hit_s=0.4)],
    }
    p = br.summarize_protocol("paper", runs, True, {})
    assert p["ratios"]["ssd/sd"]["of_medians"] == pytest.approx(28.5 / 21.0)
    assert p["ratios"]["ssd/sd"]["paired_median"] == pytest.approx((18 / 12 + 39 / 30) / 2)
    assert p["bound"]["ssd_over_sd_max"] == pytest.approx(1.5)  # 1 + 1.0 s draft / 2.0 s verify
    assert p["bound"]["measured_over_bound"] == pytest.approx(28.5 / 21.0 / 1.5)
    ssd = p["modes"]["ssd"]
    assert ssd["cache_hit_rate"] == pytest.approx(5 / 8)
    assert ssd["mean_accepted_length"] == pytest.approx(1 + 8 / 8)
    assert ssd["wait_on_hit_over_verify"] == pytest.approx((0.05 / 5) / (1.0 / 5))
    assert "bound" in p and "targets" not in p


def test_busy_machine_note():
    from ssd_chat.bench.machine import busy_note

    assert busy_note({"loadavg_start": [3.0, 2.0, 1.0]}, TWO_CORES).startswith("the machine is busy (load average 3.0 on 2 cores")
    assert busy_note({"loadavg_start": [0.4, 2.0, 1.0]}, TWO_CORES) is None


def test_first_divergence():
    assert br.first_divergence((1, 2, 3), (1, 2, 3)) is None
    assert br.first_divergence((1, 2, 3), (1, 5, 3)) == 1
    assert br.first_divergence((1, 2, 3), (1, 2)) == 2


# --- the CLI on the packaged model -----------------------------------------------------------------


@pytest.mark.slow
def test_cli_bench_on_the_packaged_model(smollm2, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "q1", "family": "chat", "prompt": "What is the capital of France?"}\n')
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    r = CliRunner().invoke(app, ["bench", "--modes", "ar,sd,ssd", "--prompts", str(f), "-n", "6", "--protocol", "paper",
                                 "--json", str(out), "--plot", str(png), "--quiet", "--target-device", "cpu", "--compile", "off"])
    assert r.exit_code == 0, r.output
    assert "protocol paper" in r.stdout and "SSD/SD" in r.stdout and "physical bound" in r.stdout
    assert "memory bound" in r.stdout and "MB of target weights" in r.stdout
    data = json.loads(out.read_text())
    mb = data["protocols"]["paper"]["memory_bound"]
    params = data["models"]["target"]["params"]
    # the default: Q4_1 blocks (0.625 byte per weight) and the Q8_0 head tied to the embedding (1.06), read once
    assert data["models"]["target"]["precision"] == "gguf Q4_1" and 0.6 * params <= mb["weight_bytes"] < 0.75 * params
    assert all(b["bandwidth_bytes_per_s"] > 0 and b["tok_per_s_max"] > 0 for b in mb["modes"].values())
    assert data["models"]["target"]["name"] == "smollm2-135m-gguf"
    assert set(data["protocols"]["paper"]["modes"]) == {"ar", "sd", "ssd"}
    assert data["protocols"]["paper"]["exactness"]["all_identical"] is True
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the prepared GPU script (no GPU is lent to CI: its guards and its bench arguments) -------------------


def test_gpu_check_usage_and_no_gpu(tmp_path, repo_root):
    import shutil
    import subprocess

    script = repo_root / ".ci" / "gpu-check"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    r = subprocess.run([str(script)], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
    if shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi is present")
    out = tmp_path / "gpu"
    r = subprocess.run([str(script), str(out)], capture_output=True, text=True, env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1 and "no NVIDIA GPU" in r.stderr
    assert "no NVIDIA GPU" in (out / "summary.txt").read_text()


@pytest.mark.slow
def test_cli_bench_mismatch_exits_3(smollm2, tmp_path, monkeypatch):
    monkeypatch.setitem(DECODERS, "sd", _Corrupting)
    f = tmp_path / "p.txt"
    f.write_text("Name three colours.\n")
    r = CliRunner().invoke(app, ["bench", "--modes", "ar,sd", "--prompts", str(f), "-n", "6", "--protocol", "paper", "--quiet",
                                 "--json", str(tmp_path / "r.json"), "--compile", "off"])  # compiling is not what it tests
    assert r.exit_code == 3, r.output
    assert "GREEDY MISMATCH" in r.stdout and "differs from AR" in r.stderr
    ex = json.loads((tmp_path / "r.json").read_text())["protocols"]["paper"]["exactness"]
    assert ex["modes"]["sd"]["mismatches"][0]["position"] == 3


# --- --dry-run's estimate ---------------------------------------------------------------------------


def test_the_estimate_scales_a_probe_of_each_configuration(tiny_pair):
    """A few timed decode steps per configuration, scaled by prompts x repeats x tokens, plus each warm-up and the load."""
    from ssd_chat.bench.estimate import probe, render

    target, draft = tiny_pair
    plans, _ = make_plans(("paper",), ("ar", "sd"), "cpu", "auto", Hardware.detect())
    settings = BenchSettings(modes=("ar", "sd"), protocols=("paper",), max_new_tokens=40, repeats=2, warmup_tokens=4)
    base = EngineConfig(target="tiny-target", draft="tiny-draft", mode="sd", k=3)
    est = probe(base, lambda plan: (target, draft), PROMPTS, plans, settings, load_s=7.0, encode=_encode)
    assert [p.mode for p in est.probes] == ["ar", "sd"] and est.runs == 2 * len(PROMPTS) * 2
    for p in est.probes:
        assert p.prefill_s > 0 and p.per_token_s > 0
        assert p.run_s == pytest.approx(p.prefill_s + 39 * p.per_token_s)
    warm = sum(p.prefill_s + 3 * p.per_token_s for p in est.probes)
    assert est.total_s > 7.0 + warm + len(PROMPTS) * 2 * sum(p.run_s for p in est.probes)  # + the bandwidth readings
    lines = render(est)
    assert lines[0].startswith("estimate: about ") and "40 tokens" in lines[0] and len(lines) == 3


def test_dry_run_prints_an_estimate_and_does_not_run_the_bench(tiny_dir, monkeypatch):
    from ssd_chat.cli import bench as command

    def no_race(*a, **k):
        raise AssertionError("--dry-run ran the bench")

    monkeypatch.setattr(command, "run_bench", no_race)
    r = CliRunner().invoke(app, ["bench", "--dry-run", "--target", str(tiny_dir), "--draft", "int8", "--modes", "ar,sd",
                                 "--protocol", "paper", "--limit", "1", "-n", "16", "-q"])
    assert r.exit_code == 0, r.output
    assert "protocol paper" in r.stdout and "estimate: about " in r.stdout and "16 tokens" in r.stdout
    assert "AR: target on" in r.stdout.split("estimate:")[1] and "SD: target on" in r.stdout.split("estimate:")[1]
