"""Feature drafts (EAGLE-style): training on a tiny random target, the cached decoding path,
the folder format, and exactness of SD with one (greedy == AR; sampling == the target's distribution)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.models import as_loaded, CharTokenizer, random_prompts, saved_draft, tiny_llama
from helpers.distribution import compare, exact_distribution, sample_outcomes
from ssd_chat import train as distill
from ssd_chat.engine.drafts import folder as draft_folder, model as draft_model, shipped as drafts
from ssd_chat.engine.engine import Engine, EngineConfig
from ssd_chat.engine.errors import ModelError, ParamError
from ssd_chat.engine.events import Done, Round
from ssd_chat.engine.model import runner as kv
from ssd_chat.engine.drafts.drafter import FeatureDrafter, target_features
from ssd_chat.engine.drafts.feature import FeatureDraft, is_feature_draft
from ssd_chat.engine.params import SamplingParams


def _target(seed: int = 0):
    """A 2-layer random Llama whose random-looking text an untrained feature draft predicts
    badly (about 10 % agreement)."""
    return as_loaded(tiny_llama(seed=seed, layers=2, hidden=64), CharTokenizer(64), f"tiny-{seed}")


CFG = distill.TrainConfig(kind="features", init_from=(1,), num_vocab=48, steps=60, batch_size=8, lr=1e-2, warmup=5,
                          max_new_tokens=16, gen_batch=64, temperature=1.0, eval_every=20, seed=0)


pytestmark = pytest.mark.usefixtures("one_thread")


def interrupted_at(step: int, train) -> None:
    """Run ``train(progress)`` and stop it with a KeyboardInterrupt (as Ctrl-C would) once ``step`` is done."""

    def progress(stage, done, total, info):
        if done == step:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(progress)


def tiny_run(cfg: distill.TrainConfig):
    """One tiny end-to-end run (seconds): answers with the target's features (32 held out),
    vocabulary, the untrained draft's held-out metrics, training."""
    target = _target()
    examples, feats = distill.generate(target, random_prompts(256), cfg, capture=(cfg.capture,))
    feats = feats[cfg.capture]
    held = (examples[:32], distill.with_top1(target, distill.Features(feats.trunk[:32], feats.final[:32])))
    train = (examples[32:], distill.Features(feats.trunk[32:], feats.final[32:]))
    vocab = distill.choose_vocab(target, train[0], train[1], cfg.num_vocab)
    before = distill.feature_heldout_metrics(FeatureDraft(target.model, (1,), vocab, cfg.fuse_layer), held[1], held[0])
    result = distill.train_draft(target, train, held, vocab, cfg)
    return target, result, before, held


@pytest.fixture(scope="module")
def trained():
    return tiny_run(CFG)


def test_training_reduces_the_distillation_loss_and_raises_agreement(trained):
    _, result, before, _ = trained
    after = result.history[-1]
    assert is_feature_draft(result.draft)
    assert [h["step"] for h in result.history] == [20, 40, 60]
    assert after["kl"] < 0.6 * before["kl"], (before, after)
    assert after["agreement"] > before["agreement"] + 0.04, (before, after)
    assert after["agreement_own"] > before["agreement_own"], (before, after)  # drafting on its own features
    assert result.heldout_agreement == pytest.approx(after["agreement"])


def test_training_is_deterministic_and_resumes_from_its_checkpoint(trained, tmp_path):
    target, _, _, held = trained
    cfg = distill.TrainConfig(**{**{f: getattr(CFG, f) for f in CFG.__slots__}, "steps": 8, "eval_every": 4, "chain": True})
    examples, feats = distill.generate(target, random_prompts(32, seed=1), cfg, capture=(0,))
    train = (examples, feats[0])
    vocab = distill.choose_vocab(target, *train, cfg.num_vocab)
    whole = distill.train_draft(target, train, held, vocab, cfg)

    ck = tmp_path / "ck.pt"
    interrupted_at(4, lambda progress: distill.train_draft(target, train, held, vocab, cfg, ck, progress))
    seen: list[int] = []
    resumed = distill.train_draft(target, train, held, vocab, cfg, ck, lambda s, d, t, i: seen.append(d))
    assert seen[0] == 4
    a, b = draft_model.trainable_state(whole.draft), draft_model.trainable_state(resumed.draft)
    assert set(a) >= {"fc.weight", "fc.bias", "norm.weight", "head.bias"}
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-12)


def test_the_runner_returns_the_targets_final_hidden_states(trained):
    target, _, _, held = trained
    ids = held[0][0].ids
    runner = kv.Runner(target.model)
    got = runner.append(ids[:5], hidden=True)
    more = runner.append(ids[5:], logits="last", hidden=True)  # hidden states of every row, whatever the logits
    assert got.mid is None and runner.append(ids[:1]).hidden is None  # only when asked for
    _, final = distill.trunk_output(target.model, ids[None], 0)
    torch.testing.assert_close(torch.cat([got.hidden, more.hidden]), final[0], rtol=0, atol=1e-12)


def test_cached_drafting_equals_a_full_forward_with_the_same_features(trained):
    """FeatureDrafter's incremental path (catch-up in pieces, own features for drafted tokens,
    rollback) computes exactly what one uncached forward over the same inputs computes."""
    target, result, _, held = trained
    draft = result.draft
    ids = held[0][0].ids
    _, final = distill.trunk_output(target.model, ids[None], 0)
    final = final[0]
    n = len(ids)
    f_in = torch.cat([final.new_zeros(1, final.shape[-1]), final[:-1]])
    with torch.no_grad():
        full = draft(input_ids=ids[None], features=f_in[None], position_ids=torch.arange(n)[None], use_cache=False)
    st = FeatureDrafter(draft, None, torch.device("cpu"))
    st.add_features(final[:4], 0)
    out = st.catch_up(ids[:5].tolist())  # positions 0..4 read features 0..3
    torch.testing.assert_close(out.hidden[-1], full.hidden[0, 4], rtol=0, atol=1e-9)
    # draft two tokens on the draft's own features, then roll back and catch up with the truth
    own = st.forward([int(ids[5])], feats=out.hidden[-1:])
    st.forward([int(ids[6])], feats=own.hidden[-1:])
    st.rollback(7, kv.Out(None, final[4:7]))  # the target kept positions 0..6: features 4..6 are new
    out = st.catch_up(ids[:8].tolist())
    torch.testing.assert_close(out.logits[-1], full.logits[0, 7], rtol=0, atol=1e-9)
    assert torch.isinf(full.logits[0]).sum(-1).eq(64 - CFG.num_vocab).all()  # -inf outside the reduced vocabulary


def test_save_and_load_round_trip_gives_identical_logits(trained, tmp_path):
    target, result, _, held = trained
    distill.save(result.draft, tmp_path / "d", target.name, target.model, dtype=torch.float64)
    manifest = json.loads((tmp_path / "d" / draft_folder.MANIFEST).read_text())
    assert manifest["kind"] == "features" and manifest["num_shared"] == 0 and manifest["init_from"] == [1]
    loaded = drafts.derive(str(tmp_path / "d"), target)
    assert is_feature_draft(loaded.model)
    assert loaded.model.get_input_embeddings() is target.model.model.embed_tokens  # shared, not copied
    ids = held[0][1].ids
    _, final = distill.trunk_output(target.model, ids[None], 0)
    f_in = torch.cat([final.new_zeros(1, 1, final.shape[-1]), final[:, :-1]], dim=1)
    pos = torch.arange(len(ids))[None]
    with torch.no_grad():
        want = result.draft(input_ids=ids[None], features=f_in, position_ids=pos, use_cache=False).logits
        got = loaded.model(input_ids=ids[None], features=f_in, position_ids=pos, use_cache=False).logits
    assert torch.equal(want, got)
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "d" / draft_folder.WEIGHTS)))
    assert names == set(draft_model.trainable_state(result.draft)) | {"vocab_ids"}
    assert not any(n.startswith("embed") for n in names)


def test_a_feature_draft_refuses_any_other_target(trained, tmp_path):
    """It reads the target's final hidden states, so every target weight counts (unlike a
    layers draft, which only depends on its shared trunk)."""
    target, result, _, _ = trained
    distill.save(result.draft, tmp_path / "d", target.name, target.model)
    with pytest.raises(ModelError, match="was trained for target 'tiny-0' and does not fit 'tiny-1'"):
        drafts.derive(str(tmp_path / "d"), _target(seed=1))
    above = _target()
    with torch.no_grad():
        above.model.model.layers[1].mlp.up_proj.weight[0, 0] += 1.0
    with pytest.raises(ModelError, match=r"its weights differ"):
        drafts.derive(str(tmp_path / "d"), above)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_sd_with_a_feature_draft_equals_ar(trained, tmp_path, k):
    target, result, _, _ = trained
    draft = saved_draft(result, target, tmp_path / "d")
    params = SamplingParams(max_new_tokens=40)
    accepted = 0
    for prompt in [[5], *random_prompts(3, seed=9)]:
        out = {}
        for mode in ("ar", "sd"):
            events = list(Engine(EngineConfig(mode=mode, k=k), target, draft).stream(prompt, params))
            out[mode] = [e for e in events if isinstance(e, Done)][0].token_ids
            accepted += sum(e.accepted for e in events if isinstance(e, Round))
        assert len(out["ar"]) == 40
        assert out["sd"] == out["ar"]
    assert accepted > 0  # the trained draft is used, and right often enough to matter


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=3)], ids=["t1", "top_k3"]
)
def test_sd_with_a_feature_draft_samples_the_exact_target_distribution(params):
    """Vocabulary 8, a feature draft over 5 of the 8 tokens (so the residual must supply the rest)."""
    target = as_loaded(tiny_llama(vocab_size=8, seed=0, hidden=32, layers=2), CharTokenizer(8), "t8")
    torch.manual_seed(0)
    draft = FeatureDraft(target.model, (1,), torch.tensor([0, 2, 3, 5, 7]))
    with torch.no_grad():
        for p in draft.trainable_state().values():
            p.add_(0.05 * torch.randn_like(p))
    loaded = as_loaded(draft, target.tokenizer, "f8")
    exact = exact_distribution(target, [1, 2, 3], 3, params)
    counts = sample_outcomes(Engine(EngineConfig(mode="sd", k=3), target, loaded).stream, [1, 2, 3], params, 3, 1200)
    result = compare(counts, exact)
    assert result.p_value > 1e-3, result


def test_a_features_recipe_is_validated():
    with pytest.raises(ParamError, match="--kind"):
        distill.TrainConfig(kind="eagle")
    assert distill.TrainConfig(kind="features").shape(30).init_from == (29,)


def test_ssd_refuses_a_feature_draft_with_a_clear_message(trained):
    """Before any reply: when the engine is made for SSD, and when a running app switches to SSD."""
    target, result, _, _ = trained
    draft = as_loaded(result.draft, target.tokenizer, "feat")
    with pytest.raises(ParamError, match="'feat' is a feature draft.*--mode sd"):
        Engine(EngineConfig(mode="ssd", k=2), target, draft)
    engine = Engine(EngineConfig(mode="sd", k=2), target, draft)
    with pytest.raises(ParamError, match="'feat' is a feature draft"):
        engine.reconfigure(mode="ssd")
    assert engine.config.mode == "sd"  # unchanged: the app keeps decoding with SD


def test_measure_runs_sd_for_real_with_a_feature_draft(trained):
    """draft eval: the first-token agreement on true features, and real greedy SD rounds per k
    (the later tokens of a round are drafted on the draft's own features)."""
    target, result, _, _ = trained
    draft = as_loaded(result.draft, target.tokenizer, "feat")
    stats = distill.measure(target, draft, random_prompts(4, seed=5), max_new_tokens=16, ks=(1, 3))
    assert stats["num_tokens"] == 64 and 0.0 < stats["agreement"] < 1.0
    assert 0.0 < stats["acceptance_k1"] < 1.0  # SD visits other positions than the agreement (not every one)
    assert stats["tokens_per_round_k1"] == pytest.approx(1 + stats["acceptance_k1"], abs=0.1)
    assert 1.0 <= stats["tokens_per_round_k3"] <= 4.0
    same = distill.measure(target, as_loaded(target.model, target.tokenizer, "copy"), random_prompts(2, seed=5), 16, ks=(3,))
    assert same["agreement"] == 1.0 and same["acceptance_k3"] == 1.0


@pytest.mark.parametrize("k", [1, 3])
def test_sd_feeds_the_feature_draft_the_targets_true_features(trained, k):
    """Exactness cannot catch a draft fed the wrong features (it only costs acceptance), so:
    the first draft token of every SD round must be the draft's argmax under a teacher-forced
    pass with the target's true features over the final sequence."""
    target, result, _, _ = trained
    draft = result.draft
    prompt = random_prompts(1, seed=5)[0]
    events = list(Engine(EngineConfig(mode="sd", k=k), target, as_loaded(draft, target.tokenizer, "f")).stream(
        prompt, SamplingParams(max_new_tokens=24)))
    seq = list(prompt) + list([e for e in events if isinstance(e, Done)][0].token_ids)
    _, final = distill.trunk_output(target.model, torch.tensor([seq]), 0)
    f_in = torch.cat([final.new_zeros(1, 1, final.shape[-1]), final[:, :-1]], dim=1)
    with torch.no_grad():
        logits = draft(input_ids=torch.tensor([seq]), features=f_in, position_ids=torch.arange(len(seq))[None], use_cache=False).logits[0]
    want = logits.argmax(-1).tolist()
    pos, checked = len(prompt), 0
    for e in events:
        if isinstance(e, Round):
            if e.drafted:
                assert e.drafted[0] == want[pos - 1], (pos, e)
                checked += 1
            pos += e.accepted + 1
    assert checked >= 6


# --- fused feature drafts (--fuse-layer): the output of a lower target layer besides the final state ---

FUSED = distill.TrainConfig(**{**{f: getattr(CFG, f) for f in CFG.__slots__}, "fuse_layer": 1})


@pytest.fixture(scope="module")
def fused():
    """The tiny run of ``trained`` with a draft that also reads the output of target layer 1 of 2."""
    return tiny_run(FUSED)


def _true_features(target, ids, fuse_layer):
    """[T, 2H]: [output of the first ``fuse_layer`` layers | final normed state], computed directly."""
    mid, final = distill.trunk_output(target.model, ids[None], fuse_layer)
    return torch.cat([mid[0], final[0]], dim=-1)


def test_a_fused_draft_starts_as_the_plain_one():
    """fuse starts as "the final state alone", so before training the two drafts agree exactly."""
    target = _target()
    vocab = torch.arange(0, 64, 2)
    plain, fused_ = FeatureDraft(target.model, (1,), vocab), FeatureDraft(target.model, (1,), vocab, fuse_layer=1)
    ids = random_prompts(1, seed=3)[0]
    ids = torch.tensor(ids)
    true = _true_features(target, ids, 1)
    pos = torch.arange(len(ids))[None]
    with torch.no_grad():
        a = plain(input_ids=ids[None], features=distill.shift_own(plain.true_features(true[None, :, 64:])), position_ids=pos)
        b = fused_(input_ids=ids[None], features=distill.shift_own(fused_.true_features(true[None])), position_ids=pos)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-6)


def test_training_a_fused_draft_raises_agreement_and_trains_the_fusion(fused):
    target, result, before, _ = fused
    after = result.history[-1]
    assert after["kl"] < 0.6 * before["kl"], (before, after)
    assert after["agreement"] > before["agreement"] + 0.04, (before, after)
    w = result.draft.fuse.weight
    assert w[:, :64].abs().max() > 0  # the lower layer's half, zero at the start, was learned


def test_the_runner_returns_the_fused_layer_and_the_final_state(fused):
    target, _, _, held = fused
    ids = held[0][0].ids
    got = target_features(kv.Runner(target.model, mid_layer=1).append(ids, logits="none", hidden=True))
    torch.testing.assert_close(got, _true_features(target, ids, 1), rtol=0, atol=1e-12)


def test_cached_drafting_with_a_fused_draft_equals_a_full_forward(fused):
    target, result, _, held = fused
    draft = result.draft
    ids = held[0][0].ids
    true = _true_features(target, ids, 1)
    n = len(ids)
    with torch.no_grad():
        f_in = distill.shift_own(draft.true_features(true[None]))
        full = draft(input_ids=ids[None], features=f_in, position_ids=torch.arange(n)[None], use_cache=False)
    st = FeatureDrafter(draft, None, torch.device("cpu"))
    st.add_features(true[:4], 0)
    out = st.catch_up(ids[:5].tolist())
    torch.testing.assert_close(out.hidden[-1], full.hidden[0, 4], rtol=0, atol=1e-6)
    st.forward([int(ids[5])], feats=out.hidden[-1:])
    st.rollback(7, kv.Out(None, true[4:7, 64:], true[4:7, :64]))
    out = st.catch_up(ids[:8].tolist())
    torch.testing.assert_close(out.logits[-1], full.logits[0, 7], rtol=0, atol=1e-6)


def test_a_fused_draft_round_trips_and_sd_with_it_equals_ar(fused, tmp_path):
    target, result, _, _ = fused
    distill.save(result.draft, tmp_path / "d", target.name, target.model)
    manifest = json.loads((tmp_path / "d" / draft_folder.MANIFEST).read_text())
    assert manifest["fuse_layer"] == 1
    from safetensors.torch import load_file

    assert {"fuse.weight", "fuse.bias", "mid_norm.weight"} <= set(load_file(str(tmp_path / "d" / draft_folder.WEIGHTS)))
    draft = drafts.derive(str(tmp_path / "d"), target)
    assert draft.model.fuse_layer == 1
    params = SamplingParams(max_new_tokens=40)
    accepted = 0
    for prompt in [[5], *random_prompts(3, seed=9)]:
        out = {}
        for mode in ("ar", "sd"):
            events = list(Engine(EngineConfig(mode=mode, k=3), target, draft).stream(prompt, params))
            out[mode] = [e for e in events if isinstance(e, Done)][0].token_ids
            accepted += sum(e.accepted for e in events if isinstance(e, Round))
        assert out["sd"] == out["ar"]
    assert accepted > 0
    got = distill.measure(target, draft, random_prompts(2, seed=4), max_new_tokens=12, ks=(2,))
    assert got["agreement"] > 0 and got["num_tokens"] > 0


def test_sd_with_a_fused_draft_samples_the_exact_target_distribution():
    params = SamplingParams(temperature=1.0)
    target = as_loaded(tiny_llama(vocab_size=8, seed=0, hidden=32, layers=2), CharTokenizer(8), "t8")
    torch.manual_seed(0)
    draft = FeatureDraft(target.model, (1,), torch.tensor([0, 2, 3, 5, 7]), fuse_layer=1)
    with torch.no_grad():
        for p in draft.trainable_state().values():
            p.add_(0.05 * torch.randn_like(p))
    exact = exact_distribution(target, [1, 2, 3], 3, params)
    counts = sample_outcomes(Engine(EngineConfig(mode="sd", k=3), target, as_loaded(draft, target.tokenizer, "f8")).stream,
                             [1, 2, 3], params, 3, 1200)
    result = compare(counts, exact)
    assert result.p_value > 1e-3, result


def test_fuse_layer_is_validated(fused, tmp_path):
    with pytest.raises(ParamError, match="--fuse-layer needs --kind features"):
        distill.TrainConfig(kind="layers", fuse_layer=1)
    target, result, _, _ = fused
    with pytest.raises(ParamError, match="--fuse-layer must be between 0 and 1"):
        FeatureDraft(target.model, (1,), torch.arange(8), fuse_layer=2)
    with pytest.raises(ParamError, match="--fuse-layer must be between 0 and 1"):  # before any answer is generated
        distill.run(target, tmp_path / "out", distill.TrainConfig(kind="features", fuse_layer=7), ["a"], ["b"], work=tmp_path / "w")
    assert not list(tmp_path.rglob("*.pt"))
    distill.save(result.draft, tmp_path / "d", target.name, target.model)
    path = tmp_path / "d" / draft_folder.MANIFEST
    path.write_text(path.read_text().replace('"fuse_layer": 1', '"fuse_layer": 5'))
    with pytest.raises(ModelError, match="does not fit 'tiny-0'.*--fuse-layer must be between 0 and 1"):
        drafts.derive(str(tmp_path / "d"), target)


def test_feature_noise_is_drawn_per_step_so_a_resumed_run_is_identical(fused, tmp_path):
    target, _, _, held = fused
    base = {**{f: getattr(FUSED, f) for f in FUSED.__slots__}, "steps": 6, "eval_every": 3}
    cfg = distill.TrainConfig(**{**base, "feature_noise": 0.05})
    examples, feats = distill.generate(target, random_prompts(24, seed=2), cfg)
    train = (examples, feats[1])
    vocab = distill.choose_vocab(target, *train, cfg.num_vocab)
    whole = distill.train_draft(target, train, held, vocab, cfg)
    quiet = distill.train_draft(target, train, held, vocab, distill.TrainConfig(**base))

    ck = tmp_path / "ck.pt"
    interrupted_at(3, lambda progress: distill.train_draft(target, train, held, vocab, cfg, ck, progress))
    resumed = distill.train_draft(target, train, held, vocab, cfg, ck)
    a, b, c = (draft_model.trainable_state(r.draft) for r in (whole, resumed, quiet))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-12)
    assert not torch.equal(a["fc.weight"], c["fc.weight"])  # the noise is used
    with pytest.raises(ParamError, match="--feature-noise needs --kind features"):
        distill.TrainConfig(kind="layers", feature_noise=0.1)
