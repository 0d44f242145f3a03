"""Two tensor-parallel ranks (gloo, one core each) on the real packaged SmolLM2-135M, against the
single-rank core on the model the app loads.  Its 3 key/value heads split 1 + 2 over the ranks."""

from __future__ import annotations

import pytest
import torch

from ssd_chat.engine.load import chat
from ssd_chat.engine.drafts import shipped as drafts
from ssd_chat.engine.model.core import Core
from ssd_chat.engine.params import SamplingParams
from ssd_chat.engine.tp.core import TPCore

from helpers.distribution import sample_outcomes
from helpers.tp import greedy, rank_cores, sd_stream

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
PROMPTS = ["Write one sentence about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def smol_cores(smollm2):
    lines: list[str] = []
    tp = TPCore(smollm2.folder, ["cpu", "cpu"], "smollm2", dtype=torch.float32, cores=rank_cores(2), progress=lines.append)
    yield Core(smollm2.model, "smollm2"), tp, lines
    tp.close()


def _prompt(smollm2, text: str) -> list[int]:
    return chat.prompt_ids(smollm2.tokenizer, [{"role": "user", "content": text}])[0]


def test_logits_and_greedy_replies_equal_the_single_rank_core(smollm2, smol_cores):
    ref, tp, _ = smol_cores
    for text in PROMPTS:
        prompt = _prompt(smollm2, text)
        ref.reset(), tp.reset()
        a, b = ref.append(prompt, logits="last").logits, tp.append(prompt, logits="last").logits
        assert (a - b).abs().max() < 1e-3 and int(a.argmax()) == int(b.argmax())
        block = [int(a.argmax()), 30, 31]  # a verify of k+1 = 3 rows
        a3, b3 = ref.append(block).logits, tp.append(block).logits
        assert (a3 - b3).abs().max() < 1e-3 and torch.equal(a3.argmax(-1), b3.argmax(-1))
        assert greedy(tp, prompt, 24) == greedy(ref, prompt, 24)


def test_greedy_sd_with_a_tensor_parallel_target_equals_ar(smollm2, smol_cores):
    """SD (and SSD's verifier, which makes the same target calls) with the layers:6 draft on one rank."""
    ref, tp, _ = smol_cores
    draft = Core(drafts.derive("layers:6", smollm2).model, "layers:6")
    prompt = _prompt(smollm2, PROMPTS[0])
    got = sample_outcomes(sd_stream(tp, draft, 2), prompt, SamplingParams(temperature=0.0), 20, 1)
    assert list(got) == [tuple(greedy(ref, prompt, 20))]


def test_tree_steps_and_adopt_on_the_packaged_model(smollm2, smol_cores):
    ref, tp, _ = smol_cores
    prompt, glue, B, k = _prompt(smollm2, PROMPTS[1]), [198, 20, 21], 4, 2
    outs = []
    for core in (ref, tp):
        core.reset()
        core.append(prompt + glue, logits="none")
        L, base = len(prompt), len(prompt) + len(glue)
        x, slots_of, got = [40, 41, 42, 43], [[] for _ in range(B)], []
        for d in range(k):
            slots = [base + d * B + b for b in range(B)]
            anc = [list(range(L, L + 1 + b % 3)) + slots_of[b] for b in range(B)]
            lg = core.tree(x, [L + 1 + b % 3 + d for b in range(B)], slots, anc, prefix=L).logits
            got.append(lg)
            x = lg.argmax(-1).tolist()
            for b in range(B):
                slots_of[b].append(slots[b])
        core.kv.adopt(L + 2, slots_of[1])
        got.append(core.append([x[1]]).logits)
        outs.append(got)
    for a, b in zip(*outs):
        assert (a - b).abs().max() < 1e-3 and torch.equal(a.argmax(-1), b.argmax(-1))


def test_each_rank_loaded_only_its_shard(smol_cores):
    _, tp, lines = smol_cores
    r0, r1 = tp.shards
    # 9 query heads over 3 key/value heads: rank 0 holds kv head 0 (3 query heads), rank 1 kv heads 1-2 (6)
    assert r0.layer0["self_attn.q_proj.weight"] == (192, 576) and r1.layer0["self_attn.q_proj.weight"] == (384, 576)
    assert r0.layer0["self_attn.k_proj.weight"] == (64, 576) and r1.layer0["self_attn.v_proj.weight"] == (128, 576)
    assert r0.layer0["self_attn.o_proj.inner.weight"] == (576, 192) and r1.layer0["self_attn.o_proj.inner.weight"] == (576, 384)
    for r in (r0, r1):  # the MLP and the vocabulary split in halves
        assert r.layer0["mlp.gate_proj.weight"] == (768, 576) and r.layer0["mlp.down_proj.inner.weight"] == (576, 768)
        assert r.split.vocab_rows == 24576
    assert r0.layer_bytes + r1.layer_bytes < 1.01 * r0.full_layer_bytes
    assert 0.4 < r0.layer_bytes / r0.full_layer_bytes < 0.5 < r1.layer_bytes / r1.full_layer_bytes < 0.6
    assert [ln.split(":")[0] for ln in lines if ln.startswith("rank ")] == ["rank 0 on cpu", "rank 1 on cpu"]
