"""Trained drafts: distillation on a tiny random target, the draft folder format, use in SD."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.models import as_loaded, CharTokenizer, random_prompts, saved_draft, tiny_llama
from ssd_chat import train as distill
from ssd_chat.engine.drafts import folder as draft_folder, model as draft_model, shipped as drafts
from ssd_chat.engine.model import runner as kv
from ssd_chat.engine.engine import Engine, EngineConfig
from ssd_chat.engine.errors import ModelError, ParamError
from ssd_chat.engine.events import Done, Round
from ssd_chat.engine.params import SamplingParams


def _target(seed: int = 0):
    """A 4-layer random Llama whose upper layers matter: a draft made of its first layer
    plus a copy of its last layer starts far from it (about half agreement)."""
    m = tiny_llama(seed=seed, layers=4, hidden=32)
    with torch.no_grad():
        m.model.embed_tokens.weight.div_(4.0)  # undo the fixture's input sharpening ...
        m.model.norm.weight.mul_(16.0)  # ... and sharpen the output instead
        for layer in m.model.layers[1:]:
            layer.mlp.down_proj.weight.mul_(8.0)
            layer.self_attn.o_proj.weight.mul_(8.0)
    return as_loaded(m, CharTokenizer(64), f"tiny-{seed}")


CFG = distill.TrainConfig(num_shared=1, init_from=(3,), num_vocab=64, steps=60, batch_size=8, lr=1e-2, warmup=5,
                          max_new_tokens=16, gen_batch=64, temperature=1.0, eval_every=20, seed=0)


@pytest.fixture(scope="module")
def trained():
    """One tiny end-to-end run (seconds): answers, vocabulary, training."""
    target = _target()
    examples, feats = distill.generate(target, random_prompts(256), CFG, capture=(1,))
    feats = feats[1]
    held = (examples[:32], distill.with_top1(target, distill.Features(feats.trunk[:32], feats.final[:32])))
    train = (examples[32:], distill.Features(feats.trunk[32:], feats.final[32:]))
    vocab = distill.choose_vocab(target, train[0], train[1], CFG.num_vocab)
    before = distill.heldout_metrics(draft_model.build(target.model, CFG.shape(4), vocab), held[1], held[0])
    result = distill.train_draft(target, train, held, vocab, CFG)
    return target, result, before, held


def test_training_reduces_the_distillation_loss_and_raises_agreement(trained):
    _, result, before, _ = trained
    after = result.history[-1]
    assert [h["step"] for h in result.history] == [20, 40, 60]
    assert after["kl"] < 0.5 * before["kl"], (before, after)
    assert after["agreement"] > before["agreement"] + 0.05, (before, after)
    assert result.heldout_agreement == pytest.approx(after["agreement"])


def test_training_is_deterministic_and_resumes_from_its_checkpoint(tmp_path):
    target = _target()
    cfg = distill.TrainConfig(**{**{f: getattr(CFG, f) for f in CFG.__slots__}, "steps": 12, "eval_every": 4})
    examples, feats = distill.generate(target, random_prompts(64, seed=1), cfg, capture=(1,))
    feats = feats[1]
    held = (examples[:8], distill.Features(feats.trunk[:8], feats.final[:8]))
    train = (examples[8:], distill.Features(feats.trunk[8:], feats.final[8:]))
    vocab = distill.choose_vocab(target, *train, cfg.num_vocab)
    whole = distill.train_draft(target, train, held, vocab, cfg)
    # stop after 8 steps (the checkpoint is written every 4), then resume to 12
    ck = tmp_path / "ck.pt"
    seen: list[int] = []

    def stop_at_8(stage, done, total, info):
        seen.append(done)
        if done == 8:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill.train_draft(target, train, held, vocab, cfg, ck, stop_at_8)
    resumed_from: list[int] = []
    resumed = distill.train_draft(target, train, held, vocab, cfg, ck, lambda s, d, t, i: resumed_from.append(d))
    assert resumed_from[0] == 8
    a, b = draft_model.trainable_state(whole.draft), draft_model.trainable_state(resumed.draft)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-12)


def test_features_recorded_while_generating_equal_a_teacher_forced_pass():
    target = _target()
    examples, feats = distill.generate(target, random_prompts(6, seed=3), CFG, capture=(1, 2))
    for i in (0, 5):
        ids = examples[i].ids
        for n in (1, 2):
            trunk, final = distill.trunk_output(target.model, ids[None], n)
            torch.testing.assert_close(feats[n].trunk[i], trunk[0, :-1].float(), rtol=0, atol=1e-6)
            torch.testing.assert_close(feats[n].final[i], final[0, :-1].float(), rtol=0, atol=1e-6)


def test_training_path_equals_the_cached_inference_path(trained):
    target, result, _, held = trained
    draft = result.draft
    ids = held[0][0].ids
    vocab = draft.lm_head.ids
    full = kv.forward(draft, ids, kv.new_cache(draft))  # one prefill
    cache = kv.new_cache(draft)
    steps = torch.cat([kv.forward(draft, ids[:5], cache)] + [kv.forward(draft, ids[j : j + 1], cache) for j in range(5, len(ids))])
    assert len(cache.layers) == 2  # one shared layer + one new layer
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-9)
    assert torch.isinf(full).sum(-1).eq(64 - len(vocab)).all()  # -inf outside the reduced vocabulary
    trunk, _ = distill.trunk_output(target.model, ids[None], 1)
    tail = distill.tail(draft)
    with torch.no_grad():
        h = tail(inputs_embeds=trunk, position_ids=torch.arange(len(ids))[None], use_cache=False).last_hidden_state
        sub = draft.lm_head.sub_logits(h[0])
    torch.testing.assert_close(sub, full[:, vocab], rtol=0, atol=1e-9)


def test_save_and_load_round_trip_gives_identical_logits(trained, tmp_path):
    target, result, _, held = trained
    distill.save(result.draft, tmp_path / "d", target.name, target.model, dtype=torch.float64)
    manifest = json.loads((tmp_path / "d" / draft_folder.MANIFEST).read_text())
    assert manifest["target"]["name"] == target.name and manifest["num_shared"] == 1 and manifest["init_from"] == [3]
    assert drafts.is_derived(str(tmp_path / "d"))
    loaded = drafts.derive(str(tmp_path / "d"), target)
    ids = held[0][1].ids
    want = kv.forward(result.draft, ids, kv.new_cache(result.draft))
    got = kv.forward(loaded.model, ids, kv.new_cache(loaded.model))
    assert torch.equal(want, got)
    # the shared trunk is the target's own modules, not a copy
    assert loaded.model.model.embed_tokens is target.model.model.embed_tokens
    assert loaded.model.model.layers[0] is target.model.model.layers[0]
    # the folder holds only the draft's own tensors: no embedding, no shared layer
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "d" / draft_folder.WEIGHTS)))
    assert names == set(draft_model.trainable_state(result.draft)) | {"vocab_ids"}
    # the default half-precision save stays close
    half = saved_draft(result, target, tmp_path / "h")
    torch.testing.assert_close(kv.forward(half.model, ids, kv.new_cache(half.model))[:, result.draft.lm_head.ids],
                               want[:, result.draft.lm_head.ids], rtol=0, atol=0.05)


def test_a_draft_refuses_a_target_it_was_not_trained_for(trained, tmp_path):
    target, result, _, _ = trained
    distill.save(result.draft, tmp_path / "d", target.name, target.model)
    other = _target(seed=1)
    with pytest.raises(ModelError, match="was trained for target 'tiny-0' and does not fit 'tiny-1'"):
        drafts.derive(str(tmp_path / "d"), other)
    # one changed weight in a shared layer is enough
    changed = _target()
    with torch.no_grad():
        changed.model.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0
    with pytest.raises(ModelError, match="does not fit"):
        drafts.derive(str(tmp_path / "d"), changed)
    # ... but a change above the shared layers is not (the draft never reads them)
    above = _target()
    with torch.no_grad():
        above.model.model.layers[2].mlp.up_proj.weight[0, 0] += 1.0
    drafts.derive(str(tmp_path / "d"), above)


def test_a_broken_draft_folder_is_a_clear_error(tmp_path):
    (tmp_path / draft_folder.MANIFEST).write_text("{not json")
    with pytest.raises(ModelError, match="not a readable ssd-chat draft"):
        drafts.derive(str(tmp_path), _target())
    (tmp_path / draft_folder.MANIFEST).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ModelError, match="not an ssd-chat draft manifest"):
        drafts.derive(str(tmp_path), _target())


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_sd_with_the_trained_draft_equals_ar(trained, tmp_path, k):
    target, result, _, _ = trained
    draft = saved_draft(result, target, tmp_path / "d")
    params = SamplingParams(max_new_tokens=40)
    for prompt in random_prompts(3, seed=9):
        out = {}
        for mode in ("ar", "sd"):
            engine = Engine(EngineConfig(mode=mode, k=k), target, draft)
            done = [e for e in engine.stream(prompt, params) if isinstance(e, Done)]
            out[mode] = done[0].token_ids
        assert len(out["ar"]) == 40
        assert out["sd"] == out["ar"]


def test_measure_counts_agreement_and_tokens_per_round():
    target = _target()
    same = as_loaded(target.model, target.tokenizer, "copy")  # the target itself: every token agrees
    stats = distill.measure(target, same, [[0, 1, 2], [7, 4, 11, 11, 14]], max_new_tokens=12, ks=(2, 4))
    assert stats["agreement"] == 1.0 and stats["num_tokens"] == 24
    assert stats["tokens_per_round_k2"] == pytest.approx(24 / 8)  # rounds of 3 tokens per 12-token reply
    assert stats["tokens_per_round_k4"] == pytest.approx(24 / 6)  # 5 + 5 + 2


def test_bad_shapes_and_prompt_files_are_clear_errors(tmp_path):
    target = _target()
    with pytest.raises(ModelError, match="the target has 4 layers"):
        draft_model.check_shape(target.model, draft_model.DraftShape(4, (3,)))
    with pytest.raises(ModelError, match="layers 0-3"):
        draft_model.check_shape(target.model, draft_model.DraftShape(1, (7,)))
    with pytest.raises(ParamError, match="--vocab"):
        distill.TrainConfig(num_vocab=1)
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "hi"}\nnot json\n')
    with pytest.raises(ParamError, match="p.jsonl:2"):
        distill.load_prompts(bad)
    with pytest.raises(ParamError, match="cannot read prompt file"):
        distill.load_prompts(tmp_path / "missing.jsonl")


def test_packaged_prompt_sets_are_disjoint():
    train, held = distill.load_prompts(), distill.load_prompts(heldout=True)
    assert len(train) >= 300 and len(held) >= 30
    assert not set(train) & set(held)


def test_cli_errors_are_one_line(tmp_path):
    from typer.testing import CliRunner

    from ssd_chat.cli import app

    r = CliRunner().invoke(app, ["draft", "train", "--out", str(tmp_path / "d"), "--prompts", str(tmp_path / "none.jsonl")])
    assert r.exit_code == 2
    assert r.stderr.strip().startswith("ssd-chat: error: cannot read prompt file") and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["draft", "train", "--out", str(tmp_path / "d"), "--init-from", "x"])
    assert r.exit_code == 2 and "--init-from" in r.stderr


# --- the shipped draft for the packaged target ----------------------------------------------------


SHIPPED = "smollm2-135m-instruct"


@pytest.mark.slow
def test_shipped_draft_loads_on_the_packaged_target_and_decodes_exactly(smollm2):
    from importlib.resources import files

    folder = str(files("ssd_chat.assets") / "drafts" / SHIPPED)
    assert draft_folder.is_draft_dir(folder)
    draft = drafts.derive(folder, smollm2)
    assert draft.model.model.embed_tokens is smollm2.model.model.embed_tokens
    stats = distill.measure(smollm2, draft, distill.load_prompts(heldout=True)[:4], max_new_tokens=48)
    assert stats["agreement"] >= 0.2, stats  # measured 37 % on 10 held-out prompts (README)
    prompt = distill.prompt_ids(smollm2, ["Write a haiku about snow."])[0]
    params = SamplingParams(max_new_tokens=32)
    out = {}
    for mode in ("ar", "sd"):
        engine = Engine(EngineConfig(mode=mode, k=3), smollm2, draft)
        out[mode] = [e for e in engine.stream(prompt, params) if isinstance(e, Done)][0].token_ids
    assert out["sd"] == out["ar"]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # AR on the thread count of SSD's verifier: the same compiled graphs
def test_the_packaged_target_loads_its_trained_draft_by_default_and_ssd_stays_exact():
    """No --draft on the packaged model: the shipped layers draft, in SSD as well (a speculator process)."""
    from ssd_chat.engine.load import models

    engine = Engine.load(EngineConfig(target=models.PACKAGED, mode="ssd", k=2, target_device="cpu", draft_device="cpu"))
    try:
        assert engine.draft.name.startswith("trained (2 shared layers") and engine.draft.folder.name == SHIPPED
        assert draft_folder.is_draft_dir(engine.draft.folder)
        prompt = distill.prompt_ids(engine.target, ["Name three moons of Jupiter."])[0]
        params = SamplingParams(max_new_tokens=32)
        ssd = [e for e in engine.stream(prompt, params) if isinstance(e, Done)][0]
        # AR on the path SSD's reply took: until ``auto``'s background builds are done replies run eagerly,
        # and the eager and compiled forwards differ in the last bits
        compile = "off" if ssd.stats.path == "eager" else "auto"
        ar = [e for e in Engine(EngineConfig(mode="ar", compile=compile), engine.target, None).stream(prompt, params)
              if isinstance(e, Done)][0]
        assert ar.stats.path == ssd.stats.path
        assert ssd.token_ids == ar.token_ids and ssd.stats.mode == "ssd"
    finally:
        engine.close()


@pytest.mark.slow
def test_shipped_feature_draft_is_found_by_alias_and_decodes_exactly(smollm2):
    """`--draft features`: the EAGLE-style draft shipped for the packaged target (SD only)."""
    from ssd_chat.engine.drafts.feature import is_feature_draft

    folder = drafts.shipped_draft("features", smollm2)
    assert folder.endswith("smollm2-135m-instruct-features")
    assert drafts.shipped_draft("trained", smollm2).endswith(SHIPPED)
    draft = drafts.derive("features", smollm2)
    assert is_feature_draft(draft.model)
    prompt = distill.prompt_ids(smollm2, ["Give me two tips for learning to cook."])[0]
    params = SamplingParams(max_new_tokens=40)
    out, rounds = {}, []
    for mode in ("ar", "sd"):
        engine = Engine(EngineConfig(mode=mode, k=1), smollm2, draft)
        events = list(engine.stream(prompt, params))
        out[mode] = [e for e in events if isinstance(e, Done)][0].token_ids
        rounds += [e for e in events if isinstance(e, Round)]
    assert out["sd"] == out["ar"]
    assert sum(r.accepted for r in rounds) > 0  # measured 42.9 % incremental agreement (README)


class _ModTokenizer(CharTokenizer):
    """Any text -> ids below 64 (the plain chat format has capitals and punctuation)."""

    def __call__(self, text, add_special_tokens=True):  # noqa: ARG002
        return {"input_ids": [ord(c) % 64 for c in text]}


def test_sampled_answers_need_a_temperature():
    with pytest.raises(ParamError, match="--temperature"):
        distill.TrainConfig(samples=2, temperature=0.0)
    with pytest.raises(ParamError, match="--samples"):
        distill.TrainConfig(samples=-1)


def test_run_writes_a_loadable_draft_and_reuses_its_cache(tmp_path):
    target = _target()
    target.tokenizer = _ModTokenizer(64)
    cfg = distill.TrainConfig(**{**{f: getattr(CFG, f) for f in CFG.__slots__}, "steps": 4, "eval_every": 2, "max_new_tokens": 6,
                                 "samples": 2, "temperature": 4.0})  # hot: the tiny target is very peaked
    prompts, held = [f"prompt {i}" for i in range(12)], ["held one", "held two"]
    result, work = distill.run(target, tmp_path / "d", cfg, prompts, held, work=tmp_path / "w")
    answers = work / "answers-1.pt"
    stamp = answers.stat().st_mtime_ns
    greedy = torch.load(answers, weights_only=True)  # the cache is plain tensors
    rounds = [torch.load(work / f"sampled-1-t4-{i}.pt", weights_only=True) for i in range(2)]
    # one greedy answer per prompt plus two sampled rounds, each round its own random stream
    assert [a.tolist() for a in rounds[0]["ids"]] != [a.tolist() for a in rounds[1]["ids"]]
    assert [a.tolist() for a in rounds[0]["ids"]] != [a.tolist() for a in greedy["train"]["ids"]]
    manifest = json.loads((tmp_path / "d" / draft_folder.MANIFEST).read_text())
    assert manifest["training"]["num_prompts"] == 12 and manifest["heldout"]["num_prompts"] == 2
    assert manifest["training"]["num_answers"] == 36 and manifest["training"]["samples"] == 2
    loaded = drafts.derive(str(tmp_path / "d"), target)
    assert loaded.model.lm_head.ids.tolist() == result.draft.lm_head.ids.tolist()
    again, _ = distill.run(target, tmp_path / "d2", cfg, prompts, held, work=tmp_path / "w")
    assert answers.stat().st_mtime_ns == stamp  # answers reused, not regenerated
    for name, p in draft_model.trainable_state(again.draft).items():
        torch.testing.assert_close(p, draft_model.trainable_state(result.draft)[name], rtol=0, atol=0)


class _TemplateTokenizer(_ModTokenizer):
    """A chat tokenizer for the tiny target: a toy template, and words (one per token) when decoding."""

    def __init__(self, vocab_size: int, eos_id: int) -> None:
        super().__init__(vocab_size, eos_id)
        self.chat_template = "toy"

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):  # noqa: ARG002
        return "".join(f"<{m['role']}>{m['content']}|" for m in messages) + ("<assistant>" if add_generation_prompt else "")

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):  # noqa: ARG002
        return " ".join(chr(ord("a") + (i % 26)) for i in ids if i != self.eos_token_id)


def _chat_target(eos: int = 30):  # 30: a token the tiny target samples often at T=4 (turns of ~7 tokens)
    target = _target()
    target.tokenizer = _TemplateTokenizer(64, eos)
    target.eos_ids = frozenset({eos})
    return target


def test_the_target_writes_its_own_prompts_self_prompts_distinct_and_reproducible():
    target = _chat_target()
    assert distill.user_turn_prefix(target.tokenizer) == [ord(c) % 64 for c in "<user>"]
    first = distill.write_prompts(target, 12, seed=0, temperature=4.0)  # hot: the tiny target is very peaked
    exclude = set(first[:3])
    again = distill.write_prompts(target, 12, seed=0, temperature=4.0)
    assert again == first  # deterministic for a seed
    assert len(set(first)) == 12 and all(len(p.split()) >= 3 for p in first)
    assert distill.write_prompts(target, 12, seed=1, temperature=4.0) != first
    fewer = distill.write_prompts(target, 12, seed=0, exclude=exclude, temperature=4.0)
    assert not exclude & set(fewer) and len(set(fewer)) == 12  # never one of the packaged / held-out prompts


def test_self_prompts_need_a_chat_template_and_an_end_of_turn():
    with pytest.raises(ParamError, match="--self-prompts"):
        distill.TrainConfig(self_prompts=-1)
    with pytest.raises(ParamError, match="chat template"):
        distill.write_prompts(_target(), 4, seed=0)
    target = _chat_target()
    target.eos_ids = frozenset()
    with pytest.raises(ParamError, match="end-of-turn"):
        distill.write_prompts(target, 4, seed=0)


def test_run_with_self_written_prompts_trains_on_them_and_caches_them(tmp_path, monkeypatch):
    monkeypatch.setattr(distill, "PROMPT_TEMPERATURE", 4.0)  # hot: the tiny target is very peaked
    target = _chat_target()
    cfg = distill.TrainConfig(**{**{f: getattr(CFG, f) for f in CFG.__slots__}, "steps": 4, "eval_every": 2, "max_new_tokens": 6,
                                 "samples": 0, "self_prompts": 6})
    prompts, held = [f"prompt {i}" for i in range(12)], ["held one", "held two"]
    result, work = distill.run(target, tmp_path / "d", cfg, prompts, held, work=tmp_path / "w")
    own = torch.load(work / "self-prompts-6-s0.pt", weights_only=True)["prompts"]
    assert len(own) == 6 and not set(own) & (set(prompts) | set(held))
    answers = torch.load(work / "self-answers-1-6-s0.pt", weights_only=True)
    want = [distill.prompt_ids(target, [p])[0] for p in own]
    assert sorted(a[:s].tolist() for a, s in zip(answers["ids"], answers["start"])) == sorted(want)  # answers to exactly those
    manifest = json.loads((tmp_path / "d" / draft_folder.MANIFEST).read_text())
    assert manifest["training"]["num_prompts"] == 18 and manifest["training"]["num_answers"] == 18
    assert manifest["training"]["self_prompts"] == 6
    stamps = {p.name: p.stat().st_mtime_ns for p in work.glob("self-*.pt")}
    distill.run(target, tmp_path / "d2", cfg, prompts, held, work=tmp_path / "w")
    assert {p.name: p.stat().st_mtime_ns for p in work.glob("self-*.pt")} == stamps  # reused, not rewritten


def test_smollm2_writes_user_turns(smollm2):
    prefix = smollm2.tokenizer.decode(distill.user_turn_prefix(smollm2.tokenizer))
    assert prefix.endswith("<|im_start|>user\n") and "system" in prefix
    own = distill.write_prompts(smollm2, 3, seed=0, batch=8)
    assert len(set(own)) == 3
    assert all(len(p.split()) >= 3 and "<|im_" not in p and p == p.strip() for p in own)


def test_draft_train_options_default_to_the_training_config():
    """The CLI spells the defaults out for --help; they must be TrainConfig's, which the recipes in the README name."""
    import dataclasses

    import typer.main

    from ssd_chat.cli.draft import draft_app

    train = typer.main.get_command(draft_app).commands["train"]
    cli = {p.name: p.default for p in train.params}
    names = {"num_shared": "layers", "num_vocab": "vocab"}
    for f in dataclasses.fields(distill.TrainConfig):
        if f.name == "init_from":
            assert cli["init_from"] is None and f.default is None
            continue
        if f.name == "warmup":  # not a CLI option
            continue
        assert cli[names.get(f.name, f.name)] == f.default, f.name
