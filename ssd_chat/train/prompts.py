"""Training prompts: the packaged sets, a user's file, and prompts the target writes itself."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch

from ..engine import LoadedModel, ModelError, ParamError, messages_for, prompt_ids as template_ids
from .spec import ProgressFn, _no_progress

PROMPT_TEMPERATURE = 0.9  # of the prompts the target writes itself (--self-prompts)


def load_prompts(path: str | Path | None = None, heldout: bool = False) -> list[str]:
    """Prompts from a JSON-lines file (``{"prompt": ...}`` per line) or the packaged set."""
    if path is None:
        where = "distill_heldout.jsonl" if heldout else "distill_prompts.jsonl"
        text = files("ssd_chat.assets").joinpath(where).read_text()
    else:
        try:
            text = Path(path).expanduser().read_text()
        except OSError as e:
            raise ParamError(f"cannot read prompt file '{path}': {e.strerror or e}") from e
        where = str(path)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(str(row["prompt"]) if isinstance(row, dict) else str(row))
        except (json.JSONDecodeError, KeyError) as e:
            raise ParamError(f"{where}:{n}: expected a JSON object with a \"prompt\" field") from e
    if not out:
        raise ParamError(f"{where} holds no prompts")
    return out


def prompt_ids(target: LoadedModel, prompts: list[str]) -> list[list[int]]:
    return [template_ids(target.tokenizer, messages_for(p))[0] for p in prompts]


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """The chat template's tokens up to where a user message's text starts (system prompt included)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ParamError("--self-prompts needs a target with a chat template (it writes user turns in that format)")
    mark = "\x00\x01"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=False, tokenize=False)
    if mark not in text:
        raise ParamError("--self-prompts: this chat template does not show the user's text verbatim")
    return list(tokenizer(text[: text.index(mark)], add_special_tokens=False)["input_ids"])


@torch.no_grad()
def write_prompts(target: LoadedModel, n: int, seed: int, exclude: set[str] = frozenset(),  # type: ignore[assignment]
                  progress: ProgressFn = _no_progress, batch: int = 64, max_tokens: int = 64,
                  temperature: float | None = None) -> list[str]:
    """``n`` distinct user prompts written by the target itself: its chat template opens a user
    turn and the target samples what a user would write, up to the end of the turn.  Kept: turns
    that end (an EOS within ``max_tokens``) with at least three words, not already in ``exclude``
    (the packaged and held-out prompts) nor written before.  Deterministic for a seed.  This is
    the distinct-context lever: sampled answers vary the replies but never the questions.
    ``temperature``: default :data:`PROMPT_TEMPERATURE`."""
    temperature = PROMPT_TEMPERATURE if temperature is None else temperature
    model, tok, dev = target.model, target.tokenizer, target.device
    prefix = torch.tensor([user_turn_prefix(tok)], dtype=torch.long)
    eos = sorted(target.eos_ids)
    if not eos:
        raise ParamError("--self-prompts needs a target with an end-of-turn token")
    seen = {p.strip() for p in exclude}
    out: list[str] = []
    torch.manual_seed(seed * 1_000_003 + 7919)
    tries = 0
    while len(out) < n:
        if tries > 8 + 4 * n // batch:
            raise ModelError(f"the target wrote only {len(out)} usable prompts of the {n} asked for")
        tries += 1
        ids = prefix.repeat(batch, 1).to(dev)
        seqs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                              top_p=1.0, top_k=0, max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=eos[0]).cpu()
        for row in seqs[:, prefix.shape[1] :].tolist():
            cut = next((j for j, t in enumerate(row) if t in target.eos_ids), None)
            if cut is None:
                continue  # ran past max_tokens: an unfinished turn
            text = tok.decode(row[:cut], skip_special_tokens=True).strip()
            if len(text.split()) < 3 or text in seen:
                continue
            seen.add(text)
            out.append(text)
            if len(out) == n:
                break
        progress("writing prompts", len(out), n, {})
    return out
