"""The compact core (engine/model/core.py, cache.py, compile.py) against transformers' own forward."""

from __future__ import annotations

import pytest
import torch

from ssd_chat.engine.model import compile as core_compile, runner as kv
from ssd_chat.engine.drafts import shipped as drafts
from ssd_chat.engine.model.core import Core, supports
from ssd_chat.engine.errors import ModelError
from ssd_chat.engine.model.cache import MIN_CAPACITY, StaticKV, bucket

from helpers.models import as_loaded, PROMPT, randomize, tiny_llama, tiny_qwen

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_tied(dtype=torch.float64) -> torch.nn.Module:
    """A Llama with the head tied to the embedding (SmolLM2's layout) and llama3 RoPE scaling."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(12)
    return randomize(LlamaForCausalLM(cfg).to(dtype).eval())


MODELS = {
    "llama": lambda: randomize(tiny_llama(seed=0)),
    "llama-tied-llama3rope": tiny_tied,
    "qwen3": lambda: tiny_qwen("qwen3"),
    "qwen2": lambda: tiny_qwen("qwen2"),
}
def hf_logits(model: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    """transformers' logits for every position of ``seq`` (a fresh cache)."""
    return kv.forward(model, torch.tensor(seq), kv.new_cache(model))


@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_steps_and_verify_equal_transformers(name):
    model = MODELS[name]()
    assert supports(model) == (True, "")
    core = Core(model, name)
    ref_cache = kv.new_cache(model)
    ref = kv.forward(model, torch.tensor(PROMPT), ref_cache)
    got = core.append(PROMPT)
    torch.testing.assert_close(got.logits, ref, rtol=1e-9, atol=1e-9)
    last = core.append([7], logits="last").logits  # a 1-row step
    torch.testing.assert_close(last, kv.forward(model, torch.tensor([7]), ref_cache), rtol=1e-9, atol=1e-9)
    block = [8, 19, 2, 55]  # a verify of k+1 = 4 rows
    torch.testing.assert_close(core.append(block).logits, kv.forward(model, torch.tensor(block), ref_cache), rtol=1e-9, atol=1e-9)
    assert core.kv.length == kv.length(ref_cache) == len(PROMPT) + 5
    assert core.append([1], logits="none").logits is None


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_tree_step_equals_drafting_each_branch_token_by_token(name):
    """An SSD tree: prefix + glue committed, B branches (glue depth j_b, first token c_b) drafted
    k deep, one call per depth with ancestors masks; every branch's logits at every depth equal a
    plain forward over that branch's own sequence.  Then a branch is adopted into place."""
    model = MODELS[name]()
    core = Core(model, name)
    k, prefix, glue = 3, PROMPT, [4, 40, 21, 14]  # glue: [bonus, d1..dk]
    core.append(prefix + glue)
    L, base = len(prefix), len(prefix) + len(glue)
    branches = [(0, 11), (0, 12), (1, 13), (2, 14), (3, 15), (3, 16)]  # (j, candidate) as SSD's fan-out makes them
    B = len(branches)
    seqs = [prefix + glue[: j + 1] + [c] for j, c in branches]
    slots_of: list[list[int]] = [[] for _ in range(B)]
    x = [c for _, c in branches]
    for d in range(k):
        slots = [base + d * B + b for b in range(B)]
        anc = [list(range(L, L + j + 1)) + slots_of[b] for b, (j, _) in enumerate(branches)]
        pos = [L + 1 + j + d for j, _ in branches]
        out = core.tree(x, pos, slots, anc, prefix=L)
        for b in range(B):
            ref = hf_logits(model, seqs[b])[-1]
            torch.testing.assert_close(out.logits[b], ref, rtol=1e-9, atol=1e-9)
            slots_of[b].append(slots[b])
        x = out.logits.argmax(-1).tolist()
        for b in range(B):
            seqs[b].append(x[b])
    assert core.kv.length == base  # tree rows are scratch: nothing committed
    # adopt branch 3 (j = 2): keep prefix + glue[:3], then its k tree slots; the next step continues it
    b = 3
    j = branches[b][0]
    core.kv.adopt(L + j + 1, slots_of[b])
    assert core.kv.length == L + j + 1 + k
    nxt = core.append([x[b]]).logits[-1]
    torch.testing.assert_close(nxt, hf_logits(model, seqs[b])[-1], rtol=1e-9, atol=1e-9)


def test_hidden_states_are_what_the_feature_tap_reads():
    from ssd_chat.train import trunk_output

    model = MODELS["llama"]()
    core = Core(model, "tiny", mid_layer=1)
    out = core.append(PROMPT, logits="last", hidden=True)
    mid, final = trunk_output(model, torch.tensor([PROMPT]), 1)
    torch.testing.assert_close(out.hidden, final[0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out.mid, mid[0], rtol=1e-9, atol=1e-9)
    emb = Core(model, "tiny", mid_layer=0).append(PROMPT, hidden=True).mid
    torch.testing.assert_close(emb, model.model.embed_tokens(torch.tensor(PROMPT)))


def test_int8_copy_through_the_core_equals_the_same_module_through_transformers():
    base = as_loaded(tiny_llama(seed=0, dtype=torch.float32), None)
    int8 = drafts.derive("int8", base).model
    assert type(int8.model.layers[0].self_attn.q_proj).__module__.startswith("torch.ao.nn.quantized")
    core = Core(int8, "int8")
    ref_cache = kv.new_cache(int8)
    torch.testing.assert_close(core.append(PROMPT).logits, kv.forward(int8, torch.tensor(PROMPT), ref_cache), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(core.append([4, 5, 6]).logits, kv.forward(int8, torch.tensor([4, 5, 6]), ref_cache),
                               rtol=1e-6, atol=1e-6)


def test_layers_draft_core_shares_the_targets_weights():
    target = as_loaded(randomize(tiny_llama(seed=0, layers=3)), None)
    draft = drafts.derive("layers:2", target).model
    tcore, dcore = Core(target.model, "target"), Core(draft, "layers:2")
    assert len(dcore.layers) == 2 and len(dcore.kv.k) == 2
    for i in range(2):  # the very modules of the target's layers: nothing copied
        assert dcore.layers[i].proj["q"] is target.model.model.layers[i].self_attn.q_proj
        assert dcore.layers[i].proj["down"] is tcore.layers[i].proj["down"]
    assert dcore.head is target.model.lm_head and dcore.embed is target.model.model.embed_tokens
    torch.testing.assert_close(dcore.append(PROMPT).logits, hf_logits(draft, PROMPT), rtol=1e-9, atol=1e-9)
    with torch.no_grad():  # a change to the target's weights is the draft's change too
        target.model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    dcore.reset()
    torch.testing.assert_close(dcore.append(PROMPT).logits, hf_logits(draft, PROMPT), rtol=1e-9, atol=1e-9)


def test_unsupported_models_say_why():
    from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    ok, why = supports(gpt2)
    assert not ok and "gpt2" in why
    with pytest.raises(ModelError, match="cannot run on the compact core"):
        Core(gpt2, "gpt2")
    mk = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=4096)
    assert supports(MistralForCausalLM(MistralConfig(sliding_window=128, **mk))) == (False, "sliding-window attention")
    assert supports(MistralForCausalLM(MistralConfig(sliding_window=None, **mk))) == (True, "")


# --- the cache: rollback, growth, limits --------------------------------------------------------------


def test_rollback_to_the_prompt_then_a_different_continuation():
    model = MODELS["qwen2"]()
    core = Core(model, "qwen2")
    core.append(PROMPT)
    core.append([1, 2, 3, 4, 5])
    core.kv.truncate(len(PROMPT))
    got = core.append([6, 7]).logits
    torch.testing.assert_close(got, hf_logits(model, PROMPT + [6, 7])[-2:], rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError):
        core.kv.truncate(core.kv.length + 1)


def test_a_reply_that_reaches_the_bucket_limit_grows_the_cache():
    model = randomize(tiny_llama(seed=0, max_pos=2048))
    core = Core(model, "tiny")
    seq = [(7 * i + 3) % 64 for i in range(MIN_CAPACITY - 2)]
    core.append(seq)
    assert core.kv.capacity == MIN_CAPACITY
    data, version = core.kv.k[0], core.kv.version
    for tok in [5, 6, 7, 8]:  # steps across the bucket edge: 254, 255 fit, 256 does not
        lg = core.append([tok]).logits[-1]
        seq.append(tok)
    assert core.kv.capacity == 2 * MIN_CAPACITY and core.kv.k[0] is not data and core.kv.version == version + 1
    torch.testing.assert_close(lg, hf_logits(model, seq)[-1], rtol=1e-9, atol=1e-9)
    assert bucket(MIN_CAPACITY + 1) == 2 * MIN_CAPACITY and bucket(3) == MIN_CAPACITY and bucket(5000, limit=4100) == 4100


def test_the_context_limit():
    model = randomize(tiny_llama(seed=0, max_pos=300))
    core = Core(model, "tiny", lookahead=8)
    seq = [(5 * i + 1) % 64 for i in range(300)]
    out = core.append(seq, logits="last").logits  # the whole context: positions 0..299
    torch.testing.assert_close(out[-1], hf_logits(model, seq)[-1], rtol=1e-9, atol=1e-9)
    assert core.kv.capacity == 308  # the bucket (512) cut to context + lookahead
    with pytest.raises(ValueError, match="past its context of 300"):
        core.append([1])
    # scratch rows may use the lookahead slots past the context, at positions inside it
    mask = core.kv.tree_mask(torch.tensor([305]), [[]], 300, 306)
    core.step([1], [299], [305], mask)
    with pytest.raises(ValueError, match="context limit is 308"):
        core.step([1], [299], [308], core.kv.tree_mask(torch.tensor([308]), [[]], 300, 309))
    with pytest.raises(ValueError, match="at least one token"):
        core.append([])
    with pytest.raises(ValueError, match="logits must be"):
        core.step([1], [1], [301], core.kv.tree_mask(torch.tensor([301]), [[]], 300, 302), logits="first")


def test_cache_out_of_memory_is_one_clear_error():
    kvc = StaticKV(2, 64, 128, torch.float32, torch.device("cpu"), name="huge-model")
    with pytest.raises(ModelError, match=r"out of memory allocating the KV cache of 'huge-model': 1073741824 tokens \(\d+"):
        kvc.reserve(1 << 30)  # 32 TiB per K or V tensor: refused at once, nothing touched


# --- compiling ----------------------------------------------------------------------------------------


def _greedy(core: Core, prompt: list[int], n: int, block: int = 1) -> list[int]:
    """Greedy tokens, fed back ``block`` at a time (block > 1: a verify-shaped call of block rows)."""
    core.reset()
    lg = core.append(prompt, logits="last").logits[-1]
    out: list[int] = []
    while len(out) < n:
        out.append(int(lg.argmax()))
        lg = core.append(out[-1:]).logits[-1]
    return out


def test_an_injected_compile_failure_falls_back_to_eager_with_one_notice(monkeypatch):
    def broken(fn, cuda):
        def run(*a, **k):
            raise RuntimeError("InductorError: C++ compile error\nno compiler found")
        return run

    monkeypatch.setattr(core_compile, "_compile", broken)
    model = tiny_llama(seed=0, dtype=torch.float32)
    notices, progress = [], []
    core = Core(model, "tiny", compile="on", rows=(1, 4), notify=notices.append, progress=progress.append)
    got = _greedy(core, PROMPT, 8)
    assert got == _greedy(Core(model, "tiny"), PROMPT, 8)
    assert progress == ["compiling tiny for 1 row (once)"]
    assert len(notices) == 1 and "compiling tiny failed (RuntimeError: InductorError: C++ compile error)" in notices[0]
    assert not core.compiler.active and core.compiler.run(*[torch.zeros(1, dtype=torch.long)] * 3, torch.ones(1, 1, dtype=torch.bool)) is None


def test_a_bare_assert_while_compiling_says_where_it_was_raised(monkeypatch):
    def broken(fn, cuda):
        def run(*a, **k):
            raise AssertionError  # what `assert x` raises outside pytest
        return run

    monkeypatch.setattr(core_compile, "_compile", broken)
    notices: list[str] = []
    core = Core(tiny_llama(seed=0, dtype=torch.float32), "tiny", compile="on", rows=(1,), notify=notices.append)
    _greedy(core, PROMPT, 2)
    assert len(notices) == 1 and "(AssertionError: at test_core.py:" in notices[0]


def test_cuda_graph_trees_get_thread_local_state_in_any_thread():
    """torch < 2.13 asserts when a thread other than the importing one first compiles a CUDA graph
    (the GPU check's draft worker did); core_compile gives each thread its own state."""
    import threading

    from torch._inductor import cudagraph_trees as ct

    seen = []

    def worker():
        seen.append(hasattr(ct.local, "tree_manager_containers"))
        core_compile._graph_tls()
        seen.append(ct.local.tree_manager_containers is not ct.get_obj(ct.local, "tree_manager_locks"))
        seen.append(isinstance(ct.local.tree_manager_containers, dict))

    t = threading.Thread(target=worker)
    t.start(), t.join()
    assert seen == [False, True, True]


def uncompiled_graphs(monkeypatch, tmp_path) -> list[int]:
    """The compile seam returns each graph as it is, counting the rows of every call (the list returned)."""
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path))
    calls: list[int] = []

    def fake(fn, cuda):
        def run(ks, vs, ids, *rest):
            calls.append(ids.shape[0])
            return fn(ks, vs, ids, *rest)
        return run

    monkeypatch.setattr(core_compile, "_compile", fake)
    return calls


def test_compiled_rows_pad_up(monkeypatch, tmp_path):
    """The seam returns the graph uncompiled, so padding and routing are tested without inductor."""
    calls = uncompiled_graphs(monkeypatch, tmp_path)
    model = randomize(tiny_llama(seed=0))
    core = Core(model, "tiny", compile="on", rows=(1, 4))
    ref = Core(model, "tiny")
    core.append(PROMPT), ref.append(PROMPT)
    torch.testing.assert_close(core.append([5, 6]).logits, ref.append([5, 6]).logits, rtol=1e-9, atol=1e-9)
    assert calls == [4]  # 2 rows ran in the 4-row graph (2 padding rows in the trash slot)
    torch.testing.assert_close(core.append([1, 2, 3, 4, 5]).logits, ref.append([1, 2, 3, 4, 5]).logits, rtol=1e-9, atol=1e-9)
    assert calls == [4]  # 5 rows: more than any graph, eager


def test_a_one_row_draft_step_runs_compiled_and_a_prefill_eagerly(monkeypatch, tmp_path):
    """A draft's step asks for the last row's logits: with one row that is a decode step (the compiled
    graph); several rows with last or none are a prefill (eager)."""
    calls = uncompiled_graphs(monkeypatch, tmp_path)
    core = Core(randomize(tiny_llama(seed=0)), "tiny", compile="on", rows=(1, 4))
    core.append(PROMPT, logits="none")
    core.append([5, 6], logits="last")
    assert calls == []
    core.append([7], logits="last")
    assert calls == [1]


@pytest.mark.slow
def test_no_cpp_compiler_falls_back_with_the_same_tokens(monkeypatch, tmp_path):
    """A real inductor failure: the C++ compiler does not exist (and no cached kernels to reuse)."""
    import torch._inductor.config as ic

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(ic, "fx_graph_cache", False)
    monkeypatch.setattr(ic.cpp, "cxx", (None, str(tmp_path / "no-such-g++")))
    torch._dynamo.reset()
    model = tiny_llama(seed=0, dtype=torch.float32)
    notices: list[str] = []
    core = Core(model, "tiny", compile="on", rows=(1,), notify=notices.append)
    assert _greedy(core, PROMPT, 6) == _greedy(Core(model, "tiny"), PROMPT, 6)
    assert len(notices) == 1 and "runs uncompiled" in notices[0]
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_and_eager_give_the_same_greedy_tokens_on_the_packaged_model(smollm2):
    """Real inductor on the real model: one compiled shape (1 row), a short AR loop.  Inductor
    on this 2-core CPU takes minutes to compile the first time (its cache dir makes it seconds after)."""
    prompt = smollm2.tokenizer("The three primary colours are")["input_ids"]
    notices: list[str] = []
    comp = Core(smollm2.model, "smollm2", compile="on", rows=(1,), notify=notices.append)
    eager = Core(smollm2.model, "smollm2")
    assert _greedy(comp, prompt, 12) == _greedy(eager, prompt, 12)
    assert not notices and 1 in comp.compiler.compile_s


@pytest.mark.slow
def test_packaged_model_through_the_core_matches_transformers(smollm2):
    m = smollm2.model
    prompt = smollm2.tokenizer("Write a haiku about the sea.")["input_ids"]
    core = Core(m, "smollm2")
    cache = kv.new_cache(m)
    ref = kv.forward(m, torch.tensor(prompt), cache, last_only=True)
    got = core.append(prompt, logits="last").logits
    assert (got - ref).abs().max() < 1e-3 and int(got.argmax()) == int(ref.argmax())
    block = [int(ref.argmax()), 30, 31]
    ref3, got3 = kv.forward(m, torch.tensor(block), cache), core.append(block).logits
    assert (got3 - ref3).abs().max() < 1e-3 and torch.equal(got3.argmax(-1), ref3.argmax(-1))


def test_compiled_projections_compute_the_linear_for_every_row_count(tmp_path):
    """What a compiled graph calls for a fastlinear-installed Linear (the timed choice per row count,
    numba kernels through the ssd_chat::row_matmul custom op) is the same product."""
    from torch import nn

    from ssd_chat.engine.cpu import fastlinear
    from ssd_chat.engine.model.core import traceable

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 40), nn.Linear(40, 96, bias=False)).eval()
    fastlinear.FastPath(store=tmp_path / "fastlinear.json").install(model)
    for m in model:
        assert isinstance(m, fastlinear.FastLinear)
        for rows in range(1, 9):
            x = torch.randn(rows, m.in_features)
            torch.testing.assert_close(traceable(m, rows)(x), torch.nn.functional.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
    if fastlinear.rowkernels.available():
        x = torch.randn(3, 96)
        torch.testing.assert_close(fastlinear.row_op()(x, model[0].weight, 4), x @ model[0].weight.T, rtol=1e-5, atol=1e-5)
