"""--target-device / --draft-device for tensor parallelism (engine/load/placement.py), with the GPU count and
the CPU cores given, so every case runs on a machine without GPUs."""

from __future__ import annotations

import pytest

from ssd_chat.engine.errors import DeviceError, ModelError, ParamError
from ssd_chat.engine.load.placement import CPU_TP_NOTE, plan_target
from ssd_chat.engine.tp.shard import check

CORES = [0, 1, 2, 3]


def plan(target: str, draft: str = "auto", gpus: int = 0, **kw):
    return plan_target(target, draft, gpus=gpus, cpu_cores=CORES, **kw)


def test_gpu_lists_and_ranges_mean_tensor_parallelism():
    p = plan("cuda:0-3", gpus=5)
    assert (p.kind, p.devices, p.backend, p.world) == ("tp", ("cuda:0", "cuda:1", "cuda:2", "cuda:3"), "nccl", 4)
    assert p.draft_device == "cuda:4" and p.note == ""  # the first GPU the target does not use
    p = plan("cuda:0,cuda:2", gpus=3)
    assert p.devices == ("cuda:0", "cuda:2") and p.draft_device == "cuda:1"
    assert p.label == "tensor-parallel over 2 ranks (cuda:0, cuda:2)"
    one = plan("cuda:1", gpus=2)
    assert (one.kind, one.devices, one.draft_device) == ("single", ("cuda:1",), "cuda:0")


def test_every_gpu_for_the_target_shares_one_with_the_draft():
    p = plan("cuda:0-1", gpus=2)
    assert p.draft_device == "cuda:1" and "the draft shares cuda:1" in p.note
    p = plan("cuda:0-1", "cuda:1", gpus=3)
    assert p.draft_device == "cuda:1" and p.note == "the draft shares cuda:1 with the target"


@pytest.mark.parametrize("gpus, kv, kind, devices, draft, says", [
    (5, None, "tp", ("cuda:0", "cuda:1", "cuda:2", "cuda:3"), "cuda:4", "tensor parallelism over cuda:0-3, the draft on cuda:4"),
    (4, None, "tp", ("cuda:0", "cuda:1", "cuda:2"), "cuda:3", "tensor parallelism over cuda:0-2"),
    (4, 8, "tp", ("cuda:0", "cuda:1"), "cuda:2", "over cuda:0-1, the draft on cuda:2"),  # 8 kv heads: 2 ranks, not 3
    (2, None, "single", ("cuda:0",), "cuda:1", "the target on cuda:0, the draft on cuda:1"),
    (1, None, "single", ("cuda:0",), "cuda:0", "cuda:0 (the only GPU)"),
    (0, None, "single", ("cpu",), "auto", "the CPU (no CUDA GPU)"),
])
def test_auto_says_what_it_chose(gpus, kv, kind, devices, draft, says):
    p = plan("auto", gpus=gpus, kv_heads=kv)
    assert (p.kind, p.devices, p.draft_device) == (kind, devices, draft)
    assert p.note.startswith("--target-device auto: ") and says in p.note


def test_cpu_cores_listed_are_ranks_over_gloo_for_testing():
    p = plan("cpu:0,cpu:1")
    assert (p.kind, p.devices, p.cores, p.backend) == ("tp", ("cpu", "cpu"), ((0,), (1,)), "gloo")
    assert p.note == CPU_TP_NOTE and "for testing" in p.note and "not for speed" in p.note
    assert p.label == "tensor-parallel over 2 ranks (cpu core 0, cpu core 1)"
    p = plan("cpu:0-1,cpu:2-3")
    assert p.cores == ((0, 1), (2, 3)) and p.label == "tensor-parallel over 2 ranks (cpu cores 0-1, cpu cores 2-3)"
    single = plan("cpu:1-2")
    assert (single.kind, single.cores, single.label) == ("single", ((1, 2),), "cpu (cores 1-2)")
    assert plan("cpu").cores is None and plan("cpu").draft_device == "auto"


def test_pipeline_is_the_explicit_device_map_fallback():
    p = plan("pipeline:cuda:0,cuda:1", gpus=3)
    assert (p.kind, p.devices, p.world, p.backend) == ("pipeline", ("cuda:0", "cuda:1"), 1, None)
    assert p.draft_device == "cuda:2" and "one GPU works at a time" in p.note


@pytest.mark.parametrize("target, draft, gpus, words", [
    ("cuda:0-3", "auto", 2, "--target-device cuda:0-3: no cuda:2, this machine has 2 CUDA GPU(s) (cuda:0-1)"),
    ("cuda:0,cuda:1", "auto", 0, "no CUDA GPU is available; use --target-device cpu (or cpu:0,cpu:1"),
    ("cuda:3-1", "auto", 4, "the range runs backwards"),
    ("cuda:0,cuda:0", "auto", 2, "a GPU is listed twice"),
    ("cpu:0,cuda:1", "auto", 2, "on CPU cores or on GPUs, not on both"),
    ("cpu:0,cpu:7", "auto", 0, "this machine has CPU cores 0-3 only (no core 7)"),
    ("cpu:0-1,cpu:1", "auto", 0, "a core is listed for two ranks"),
    ("cpu,cpu", "auto", 0, "name each rank's core (cpu:0,cpu:1)"),
    ("pipeline:cpu:0,cpu:1", "auto", 0, "pipeline: spreads a model over GPUs only"),
    ("pipeline:cuda:0", "auto", 2, "pipeline: needs at least two GPUs"),
    ("tpu:0", "auto", 0, "unknown device 'tpu:0'"),
    ("cuda:0,", "auto", 2, "invalid device 'cuda:0,'"),
    ("mps,cpu", "auto", 0, "mps is one device"),
    ("cuda:0-1", "cuda:2-3", 4, "--draft-device cuda:2-3: the draft runs on one device"),
    ("cpu:0", "cuda:0", 0, "--draft-device cuda:0: no CUDA GPU is available"),
])
def test_bad_placements_are_one_line_errors(target, draft, gpus, words):
    with pytest.raises(DeviceError) as err:
        plan(target, draft, gpus=gpus)
    assert words in str(err.value) and "\n" not in str(err.value)


def check_target(p, config, name):
    """What the tensor-parallel load does once the config is read, before any weights (a pipeline takes any model)."""
    if p.kind == "tp":
        check(config, p.world, name)


def test_the_model_is_checked_against_the_plan_before_its_weights_load():
    from transformers import GPT2Config, LlamaConfig

    llama = LlamaConfig(num_attention_heads=64, num_key_value_heads=8, hidden_size=8192, intermediate_size=28672)
    check_target(plan("cuda:0-3", gpus=4), llama, "llama-3-70b")
    check_target(plan("cpu:0,cpu:1,cpu:2"), llama, "llama-3-70b")  # uneven (3, 3, 2 kv heads) but splits
    with pytest.raises(ModelError, match="'llama-3-70b' has 8 key/value heads, so it splits over at most 8"):
        check_target(plan_target("cuda:0-15", gpus=16), llama, "llama-3-70b")
    with pytest.raises(ModelError, match="pipeline:cuda:0,cuda:1"):
        check_target(plan("cuda:0-1", gpus=2), GPT2Config(), "gpt2")
    assert plan("pipeline:cuda:0,cuda:1", gpus=2).kind == "pipeline"  # the fallback takes any model


def test_the_chat_reads_device_lists_as_tensor_parallel_ranks(monkeypatch):
    """models.parse_placement (what Engine.load calls) reads CPU and GPU lists and ranges with the same rules as
    plan_target: tensor-parallel ranks, ``pipeline:`` a device_map; ``auto`` with 3+ GPUs is TP over all but the last."""
    import torch

    from ssd_chat.engine.load import models, placement
    from ssd_chat.engine.startup import preflight
    from ssd_chat.engine.config import EngineConfig

    cpu = models.parse_placement("cpu:0,cpu:1")
    assert cpu.ranks == ("cpu", "cpu") and cpu.rank_cores == ((0,), (1,)) and cpu.cores == (0, 1) and not cpu.device_map
    assert cpu.label == "tensor-parallel over 2 ranks (cpu core 0, cpu core 1) float32"
    assert any("for testing" in w for w in preflight.check(EngineConfig(mode="ar", target_device="cpu:0,cpu:1")).warnings)
    with pytest.raises(DeviceError, match="no CUDA GPU is available"):
        models.parse_placement("cuda:0-3")
    monkeypatch.setattr(placement, "_gpu_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    p = models.parse_placement("cuda:0-2", "bf16")
    assert p.ranks == ("cuda:0", "cuda:1", "cuda:2") and not p.device_map and p.device == torch.device("cuda", 0)
    assert p.dtype == torch.bfloat16
    assert models.parse_placement("auto").ranks == ("cuda:0", "cuda:1", "cuda:2")  # the draft gets cuda:3
    assert models.parse_placement("auto", option="--draft-device").ranks is None
    assert models.parse_placement("pipeline:cuda:1,cuda:3").device_map == ("cuda:1", "cuda:3")
    with pytest.raises(DeviceError, match="--draft-device cuda:2,cuda:3: the draft runs on one device"):
        models.parse_placement("cuda:2,cuda:3", option="--draft-device")
    pre = preflight.check(EngineConfig(mode="ar", target_device="cuda:0-2"))
    assert pre.config.draft_device == "cuda:3" and not pre.warnings  # the first GPU the ranks leave
    pre = preflight.check(EngineConfig(mode="ar", target_device="auto"))
    assert pre.warnings == ("--target-device auto: tensor parallelism over cuda:0-2, the draft on cuda:3",)
    pre = preflight.check(EngineConfig(mode="ar", target_device="cuda:0-3"))
    assert pre.config.draft_device == "cuda:3" and "shares cuda:3" in pre.warnings[0]
    with pytest.raises(ParamError, match="a tensor-parallel target does not return"):
        preflight.check(EngineConfig(mode="sd", target_device="cpu:0,cpu:1", draft="features"))


# -- the command line checks the spelling before anything loads or the app opens --------------------

FORMS = [
    ("--target-device", "gpu", "--target-device: unknown device 'gpu'"),
    ("--target-device", "cpu:0,,cpu:1", "--target-device: invalid device 'cpu:0,,cpu:1'"),
    ("--target-device", "cpu:1-0", "--target-device cpu:1-0: the range runs backwards"),
    ("--target-device", "cuda:0,cpu:1", "on CPU cores or on GPUs, not on both"),
    ("--target-device", "cpu:0,cpu:0", "a core is listed for two ranks"),
    ("--target-device", "cpu,cpu", "name each rank's core (cpu:0,cpu:1)"),
    ("--target-device", "cuda:1,cuda:1", "--target-device cuda:1,cuda:1: a GPU is listed twice"),
    ("--target-device", "pipeline:cpu:0,cpu:1", "pipeline: spreads a model over GPUs only"),
    ("--target-device", "pipeline:cuda:0", "pipeline: needs at least two GPUs"),
    ("--target-device", "mps,cpu", "mps is one device"),
    ("--draft-device", "cuda:0,cuda:1", "--draft-device cuda:0,cuda:1: the draft runs on one device"),
    ("--draft-device", "cpu:0-1,cpu:2", "--draft-device cpu:0-1,cpu:2: the draft runs on one device"),
]


@pytest.mark.parametrize("option, value, words", FORMS)
@pytest.mark.parametrize("command", [["ask", "hi"], []], ids=["ask", "app"])
def test_a_misspelt_placement_is_a_usage_error_before_anything_loads(monkeypatch, option, value, words, command):
    """Exit 2 in one line from the settings check: no model loads (ask) and the app never opens."""
    from typer.testing import CliRunner

    from ssd_chat import cli
    from ssd_chat.cli import ask
    from ssd_chat.cli import chat as tui_launch

    def never(*_a, **_k):
        raise AssertionError("got past the settings check")

    monkeypatch.setattr(ask, "load_engine", never)
    monkeypatch.setattr(tui_launch, "launch", never)
    r = CliRunner().invoke(cli.app, [*command[:1], option, value, *command[1:]])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("ssd-chat: error: ") and words in r.stderr and r.stderr.count("\n") == 1


def test_a_misspelt_placement_in_the_environment_names_the_variable(monkeypatch):
    from typer.testing import CliRunner

    from ssd_chat import cli
    from ssd_chat.cli import ask

    monkeypatch.setattr(ask, "load_engine", lambda *_a, **_k: pytest.fail("loaded"))
    monkeypatch.setenv("SSD_CHAT_TARGET_DEVICE", "cuda:0;cuda:1")
    r = CliRunner().invoke(cli.app, ["ask", "hi"])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1
    assert "unknown device 'cuda:0;cuda:1'" in r.stderr and "(target_device from environment variable SSD_CHAT_TARGET_DEVICE)" in r.stderr


@pytest.mark.parametrize("value", ["auto", "cpu", "cpu:0", "cpu:0-63", "cuda", "cuda:7", "cuda:0-3", "cuda:0,cuda:2",
                                   "pipeline:cuda:0,cuda:1", "mps", " CUDA:0-1 "])
def test_the_spelling_check_leaves_the_hardware_to_the_load(value):
    """Forms that are right but may not fit this machine (no GPU here, 2 cores) pass: preflight checks the hardware."""
    from ssd_chat.engine.load.placement import check_forms

    check_forms(value, "cpu:5" if value.startswith("cpu") else "cuda:9")


def test_the_app_in_a_terminal_refuses_a_misspelt_rank_list_before_it_opens(tmp_path):
    """The real entry point in a pty: one error line, exit 2, and no full-screen app drawn (no alternate screen)."""
    import os
    import sys

    pexpect = pytest.importorskip("pexpect")
    env = dict(os.environ, TERM="xterm-256color", SSD_CHAT_CONFIG_DIR=str(tmp_path / "cfg"), XDG_DATA_HOME=str(tmp_path / "d"))
    child = pexpect.spawn(sys.executable, ["-m", "ssd_chat", "--target-device", "cpu:0,cpu:0"], env=env,
                          dimensions=(45, 200), encoding="utf-8", timeout=60)
    out = child.read()
    child.close()
    assert child.exitstatus == 2, out
    assert out.strip().startswith("ssd-chat: error: --target-device cpu:0,cpu:0: a core is listed for two ranks")
    assert out.strip().count("\n") == 0 and "\x1b[?1049h" not in out and "Traceback" not in out


@pytest.mark.parametrize(("target", "gpus", "want", "shared"), [
    ("cuda:0,cuda:1", 4, "cuda:2", False), ("cuda:0-3", 5, "cuda:4", False), ("auto", 4, "cuda:3", False),
    ("cuda:1", 2, "cuda:0", False), ("cuda:0", 1, "cuda:0", True), ("cuda:0,cuda:1", 2, "cuda:1", True)])
def test_ssd_speculator_goes_to_the_first_gpu_the_target_leaves(monkeypatch, target, gpus, want, shared):
    import torch

    from ssd_chat.engine.config import EngineConfig
    from ssd_chat.engine.speculate.plan import plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    p = plan(EngineConfig(mode="ssd", target_device=target), torch.device("cuda", 0), None)
    assert (p.draft_device, p.shared) == (want, shared)
