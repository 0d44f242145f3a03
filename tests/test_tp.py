"""Tensor parallelism (engine/tp/core.py, shard.py, worker.py): two real ranks over gloo on the CPU,
against the single-rank core on the same weights."""

from __future__ import annotations

import pytest
import torch

from ssd_chat.engine.model.core import Core
from ssd_chat.engine.errors import ModelError

from helpers.models import PROMPT, randomize, tiny_llama
from helpers.tp import close as _close, greedy, save as _save, start as _start

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random Llama (random norms too), its single-rank core, and a 2-rank TPCore over its folder."""
    model = randomize(tiny_llama(seed=0))
    folder = _save(model, tmp_path_factory.mktemp("tiny-llama"))
    tp = _start(folder, mid_layer=1)
    yield model, Core(model, "tiny", mid_layer=1), tp
    tp.close()


def test_prefill_steps_verify_and_hidden_states_equal_the_single_rank_core(llama):
    _, ref, tp = llama
    ref.reset(), tp.reset()
    a, b = ref.append(PROMPT, hidden=True), tp.append(PROMPT, hidden=True)
    _close(a.logits, b.logits), _close(a.hidden, b.hidden), _close(a.mid, b.mid)
    for block in ([7], [8, 19, 2, 55], [1]):  # a 1-row step, a verify of k+1 = 4 rows
        _close(ref.append(block).logits, tp.append(block).logits)
    assert tp.append([3], logits="none").logits is None and ref.append([3], logits="none").logits is None
    assert tp.kv.length == ref.kv.length == len(PROMPT) + 7


def test_greedy_tokens_equal_the_single_rank_core(llama):
    _, ref, tp = llama
    want = greedy(ref, PROMPT, 40)
    assert greedy(tp, PROMPT, 40) == want
    # a rollback in between (what SD does after a rejection) changes nothing either
    tp.reset()
    tp.append(PROMPT + want[:10], logits="none")
    tp.kv.truncate(len(PROMPT) + 4)
    got = tp.append(want[4:6], logits="last").logits[-1]
    ref.reset()
    ref.append(PROMPT + want[:6], logits="none")
    ref.kv.truncate(len(PROMPT) + 5)
    _close(got, ref.append(want[5:6]).logits[-1])


def test_ssd_tree_steps_and_adopting_a_branch_equal_the_single_rank_core(llama):
    """The SSD speculator's calls: a tree of B branches, one call per depth, then adopt a branch and go on."""
    _, ref, tp = llama
    k, glue = 3, [4, 40, 21, 14]
    branches = [(0, 11), (0, 12), (1, 13), (2, 14), (3, 15), (3, 16)]
    outs = []
    for core in (ref, tp):
        core.reset()
        core.append(PROMPT + glue, logits="none")
        L, base, B = len(PROMPT), len(PROMPT) + len(glue), len(branches)
        slots_of: list[list[int]] = [[] for _ in range(B)]
        x, got = [c for _, c in branches], []
        for d in range(k):
            slots = [base + d * B + b for b in range(B)]
            anc = [list(range(L, L + j + 1)) + slots_of[b] for b, (j, _) in enumerate(branches)]
            lg = core.tree(x, [L + 1 + j + d for j, _ in branches], slots, anc, prefix=L).logits
            got.append(lg)
            for b in range(B):
                slots_of[b].append(slots[b])
            x = lg.argmax(-1).tolist()
        assert core.kv.length == base
        core.kv.adopt(L + 3, slots_of[3])  # branch 3 (glue depth j = 2)
        got.append(core.append([x[3]]).logits)
        assert core.kv.length == L + 3 + k + 1
        outs.append(got)
    for a, b in zip(*outs):
        _close(a, b)


def test_each_rank_holds_half_the_layer_weights(llama):
    model, _, tp = llama
    assert [s.rank for s in tp.shards] == [0, 1] and tp.shards[1].device == "cpu"
    full = {n.split("layers.0.", 1)[1]: tuple(p.shape) for n, p in model.named_parameters() if ".layers.0." in n}
    split_dim = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1}
    for s in tp.shards:  # rank 1's shapes come from the worker process
        for name, shape in full.items():
            proj = name.split(".")[1]
            local = s.layer0[name.replace(f"{proj}.weight", f"{proj}.inner.weight") if proj in ("o_proj", "down_proj") else name]
            if proj in split_dim:
                want = list(shape)
                want[split_dim[proj]] //= 2
                assert local == tuple(want), (s.rank, name)
            else:
                assert local == shape, (s.rank, name)  # norms: replicated
        assert s.split.vocab_rows == 32 and 0.5 <= s.layer_bytes / s.full_layer_bytes < 0.51
    assert tp.shards[0].layer0["self_attn.q_proj.weight"][0] + tp.shards[1].layer0["self_attn.q_proj.weight"][0] == full["self_attn.q_proj.weight"][0]


def test_argument_errors_leave_the_ranks_in_step(llama):
    _, ref, tp = llama
    tp.reset()
    tp.append(PROMPT)
    with pytest.raises(ValueError, match="at least one token"):
        tp.append([])
    with pytest.raises(ValueError, match="past its context of 512"):
        tp.step([1], [600], [20], torch.ones(1, 21, dtype=torch.bool))
    with pytest.raises(ValueError, match="cannot adopt"):
        tp.kv.adopt(len(PROMPT) + 5, [20, 21])
    ref.reset()
    _close(ref.append(PROMPT + [2]).logits[-1], tp.append([2]).logits[-1])


def test_models_that_cannot_be_split_are_refused_before_any_process_starts(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = _save(tiny_llama(seed=0), tmp_path / "llama")  # 2 key/value heads
    with pytest.raises(ModelError, match="2 key/value heads, so it splits over at most 2 tensor-parallel ranks, not 3"):
        _start(folder, world=3)
    gpt2 = _save(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)), tmp_path / "gpt2")
    with pytest.raises(ModelError, match="architecture 'gpt2'.*pipeline:cuda:0,cuda:1"):
        _start(gpt2)
