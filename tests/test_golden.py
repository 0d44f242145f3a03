"""Greedy AR, SD and SSD on the packaged SmolLM2 give the token ids recorded in
tests/data/greedy_golden.json (recorded before the engine was restructured): a refactor of
the decoders, drafts or speculator must not change a single greedy token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssd_chat.engine.load import chat
from ssd_chat.engine.drafts import shipped as drafts
from ssd_chat.engine.engine import Engine, EngineConfig
from ssd_chat.engine.events import Done
from ssd_chat.engine.params import SamplingParams

GOLDEN = json.loads((Path(__file__).parent / "data" / "greedy_golden.json").read_text())
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: f"{c['mode']}-{c['draft']}-k{c['k']}")
def test_greedy_tokens_match_the_recording(smollm2, case):
    draft = drafts.derive(case["draft"], smollm2) if case["draft"] else None
    eng = Engine(EngineConfig(mode=case["mode"], k=max(case["k"], 1), draft=case["draft"]), smollm2, draft)
    try:
        for prompt, want in zip(GOLDEN["prompts"], case["token_ids"], strict=True):
            ids, _ = chat.prompt_ids(smollm2.tokenizer, [{"role": "user", "content": prompt}])
            events = list(eng.stream(ids, SamplingParams(max_new_tokens=GOLDEN["max_new_tokens"], ignore_eos=True)))
            done = events[-1]
            assert isinstance(done, Done), done
            assert list(done.token_ids) == want, f"{case['mode']} with {case['draft']}: {prompt!r}"
            if case["mode"] == "ssd":
                assert done.stats.ran_as is None, "the reply must come from the speculator process, not a fallback"
    finally:
        eng.close()
